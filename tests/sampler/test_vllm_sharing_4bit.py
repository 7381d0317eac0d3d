"""The HF side of sharing 4-bit (bitsandbytes) weights with vLLM, on CPU (bitsandbytes' CPU backend quantizes):
what vLLM's bitsandbytes loader is fed, that the training model's quantization states survive what vLLM does to
its copies, and which quantization configs cannot share (a warning: vLLM gets a separate copy) or are refused before
anything loads. The engine side (vLLM's loader, views of its packed shards, sampling through the adapter) is
GPU-only: tests/sampler/test_vllm_families.py."""

from __future__ import annotations

import types
import warnings

import pytest
import torch
from helpers import needs_bnb, quantized_peft_model

from trl_turbo.testing.models import tiny_model
from trl_turbo.testing.tokenizer import VOCAB
from trl_turbo.vllm import quantized


@needs_bnb
@pytest.mark.parametrize("double_quant", [True, False], ids=["nf4-double", "nf4"])
def test_loader_is_fed_packed_bytes_and_new_states_under_hf_names(tmp_path, double_quant):
    from trl_turbo.vllm.engine import hf_state_for_vllm, peft_base

    model = quantized_peft_model(tmp_path, load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                  bnb_4bit_use_double_quant=double_quant)
    base = peft_base(model)
    packed = quantized.four_bit_weights(base)
    assert len(packed) == 2 * 7  # every projection of both layers; the embedding and LM head stay 16-bit
    tensors, states = quantized.weights_for_vllm(base, hf_state_for_vllm(base))
    tensors = dict(tensors)
    assert set(states) == set(packed)
    assert not [n for n in tensors if "lora_" in n or "base_layer" in n or n.count(".weight") != 1
                or not n.endswith(".weight")], "only plain HF weight names, no quantization statistics"
    for name, weight in packed.items():
        assert tensors[name].dtype == torch.uint8 and torch.equal(tensors[name], weight.data)
        ours, theirs = weight.quant_state, states[name]
        assert theirs is not ours and theirs.absmax is ours.absmax and theirs.nested == double_quant
    assert tensors["model.embed_tokens.weight"].dtype == torch.float32


@needs_bnb
def test_vllm_undoing_double_quantization_leaves_training_states_alone(tmp_path):
    from bitsandbytes.functional import dequantize_4bit

    model = quantized_peft_model(tmp_path, load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                  bnb_4bit_use_double_quant=True)
    packed = quantized.four_bit_weights(model.get_base_model())
    name, weight = next(iter(packed.items()))
    before = dequantize_4bit(weight.data, weight.quant_state).clone()
    theirs = quantized.state_for_vllm(weight.quant_state)
    # what vLLM's loader does to the states it is given (BitsAndBytesModelLoader._dequantize_dq)
    theirs.absmax, theirs.nested, theirs.offset, theirs.state2 = quantized.dequantized_absmax(theirs), False, None, None
    assert weight.quant_state.nested and weight.quant_state.absmax.dtype == torch.uint8
    assert quantized.same_quantization(weight.quant_state, theirs)
    assert torch.equal(dequantize_4bit(weight.data, theirs), before)  # vLLM's copy dequantizes to the same values
    other_name, other = list(packed.items())[1]
    assert not quantized.same_quantization(other.quant_state, theirs), (name, other_name)


def test_quantization_configs_that_cannot_share_are_named():
    from trl_turbo.vllm.dequantized import unsupported_quantization

    nf4 = {"load_in_4bit": True, "bnb_4bit_quant_type": "nf4", "bnb_4bit_use_double_quant": True}
    assert quantized.sharing_problems(nf4) == []
    assert quantized.sharing_problems({"load_in_4bit": True, "bnb_4bit_quant_type": "fp4"}) == []
    assert "8-bit" in quantized.sharing_problems({"load_in_8bit": True})[0]
    assert "uint8" in quantized.sharing_problems({**nf4, "bnb_4bit_quant_storage": "bfloat16"})[0]
    assert "host" in quantized.sharing_problems({**nf4, "llm_int8_enable_fp32_cpu_offload": True})[0]
    assert "'gptq'" in unsupported_quantization({"quant_method": "gptq"})  # neither shared nor copied
    assert unsupported_quantization({"load_in_8bit": True}) is None
    assert "llm_int8_skip_modules" in quantized.sharing_problems({**nf4, "llm_int8_skip_modules": ["down_proj"]})[0]
    assert quantized.sharing_problems({**nf4, "llm_int8_skip_modules": ["lm_head"]}) == []
    vllm_config = quantized.vllm_quantization_config({**nf4, "llm_int8_skip_modules": ["lm_head"]})
    assert vllm_config["quant_method"] == "bitsandbytes" and vllm_config["llm_int8_skip_modules"] == []
    assert quantized.compute_dtype_warning({**nf4, "bnb_4bit_compute_dtype": "bfloat16"}) is None
    assert "bfloat16" in quantized.compute_dtype_warning(nf4)  # bitsandbytes' default compute dtype is float32


@needs_bnb
def test_layers_vllm_would_quantize_differently_are_named(tmp_path):
    standard = quantized_peft_model(tmp_path / "standard", load_in_4bit=True, bnb_4bit_quant_type="nf4")
    assert quantized.layout_problems(standard) == []
    # a skip list replaces transformers' default (the LM head) and matches by suffix: down_proj stays 16-bit, the
    # head becomes 4-bit, where vLLM would quantize every down_proj and never the head
    custom = quantized_peft_model(tmp_path / "custom", load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                   llm_int8_skip_modules=["down_proj"])
    problems = " ".join(quantized.layout_problems(custom))
    assert "LM head is 4-bit" in problems and "down_proj" in problems


@needs_bnb
def test_vllm_statistics_are_counted_only_where_vllm_makes_its_own(tmp_path):
    double = quantized_peft_model(tmp_path / "double", load_in_4bit=True, bnb_4bit_use_double_quant=True)
    single = quantized_peft_model(tmp_path / "single", load_in_4bit=True, bnb_4bit_use_double_quant=False)
    blocks = sum(w.numel() * 2 // 64 for w in quantized.four_bit_weights(double).values())  # 2 values a byte
    assert quantized.statistics_bytes(double) == 4 * blocks
    assert quantized.statistics_bytes(single) == 0
    # vLLM's own copy (not shared) holds fp32 scales for every 4-bit weight, double-quantized or not
    assert quantized.statistics_bytes(double, shared=False) == quantized.statistics_bytes(single, shared=False)
    assert quantized.statistics_bytes(single, shared=False) == 4 * blocks


@needs_bnb
def test_hf_bitsandbytes_config_becomes_a_plain_dict():
    import json

    from transformers import BitsAndBytesConfig

    config = quantized.quantization_config_dict(BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                                                   bnb_4bit_compute_dtype=torch.bfloat16))
    assert json.loads(json.dumps(config)) == config
    assert config["quant_method"] == "bitsandbytes" and config["bnb_4bit_compute_dtype"] == "bfloat16"


def _one_warning(call) -> str:
    """The message of the one warning `call()` emits."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        call()
    assert len(caught) == 1, [str(w.message) for w in caught]
    return str(caught[0].message)


def test_quantized_trainer_inputs_are_checked_before_loading(tmp_path):
    from peft import LoraConfig

    from trl_turbo.checks import check_trainer_inputs

    def config(**quantization):
        return types.SimpleNamespace(turbo_vllm_shared_weights=True,
                                     model_init_kwargs={"quantization_config": quantization})

    checkpoint = str(tmp_path)
    tiny_model("llama", vocab_size=len(VOCAB)).config.save_pretrained(checkpoint)
    nf4 = {"load_in_4bit": True, "bnb_4bit_quant_type": "nf4", "bnb_4bit_compute_dtype": "bfloat16"}
    # vLLM cannot share these: one warning names the reason, the separate copy and its cost, and how to get one copy
    # (no 4-bit compute-dtype warning: nothing is shared 4-bit)
    message = _one_warning(lambda: check_trainer_inputs(config(load_in_8bit=True), checkpoint, LoraConfig(r=8)))
    assert message.startswith("trl_turbo:") and "8-bit" in message
    assert "separate 16-bit copy" in message and "dequantized" in message and "2 bytes per base parameter" in message
    assert "as tensors" in message and "load_in_4bit=True" in message
    for fallback, reason in (({"bnb_4bit_quant_storage": "bfloat16"}, "bnb_4bit_quant_storage='bfloat16'"),
                             ({"llm_int8_enable_fp32_cpu_offload": True}, "llm_int8_enable_fp32_cpu_offload"),
                             ({"llm_int8_skip_modules": ["down_proj"]}, r"llm_int8_skip_modules=\['down_proj'\]")):
        with pytest.warns(RuntimeWarning, match=f"{reason}.*separate 16-bit copy"):
            check_trainer_inputs(config(**nf4, **fallback), checkpoint, LoraConfig(r=8))
    llama = tiny_model("llama", vocab_size=len(VOCAB))
    llama.config.quantization_config = {"load_in_8bit": True}
    with pytest.warns(RuntimeWarning, match="8-bit.*separate 16-bit copy"):
        check_trainer_inputs(config(), llama, LoraConfig(r=8))
    llama.config.quantization_config = {"quant_method": "gptq", "bits": 4}  # nothing can dequantize it
    with pytest.raises(ValueError, match="'gptq'.*BitsAndBytesConfig.*turbo_vllm_shared_weights=False"):
        check_trainer_inputs(config(), llama, LoraConfig(r=8))
    llama.config.quantization_config = nf4
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_trainer_inputs(config(), llama, LoraConfig(r=8))  # a 4-bit model is shared
    llama.config.quantization_config = {"load_in_4bit": True}
    with pytest.warns(RuntimeWarning, match="always compute in bfloat16"):
        check_trainer_inputs(config(), llama, LoraConfig(r=8))


def test_every_route_to_a_quantized_model_is_checked(tmp_path):
    from peft import LoraConfig

    from trl_turbo.checks import check_trainer_inputs

    plain = types.SimpleNamespace(turbo_vllm_shared_weights=True, model_init_kwargs=None)
    checkpoint = tmp_path / "prequantized"
    model = tiny_model("llama", vocab_size=len(VOCAB))
    model.config.quantization_config = {"quant_method": "bitsandbytes", "load_in_8bit": True}
    model.config.save_pretrained(checkpoint)
    with pytest.warns(RuntimeWarning, match="8-bit"):  # a checkpoint saved quantized
        check_trainer_inputs(plain, str(checkpoint), LoraConfig(r=8))
    unquantized = tmp_path / "plain"
    tiny_model("llama", vocab_size=len(VOCAB)).config.save_pretrained(unquantized)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_trainer_inputs(plain, str(unquantized), LoraConfig(r=8))
    with pytest.warns(RuntimeWarning, match="8-bit"):  # GRPOTrainer's own `quantization_config` argument
        check_trainer_inputs(plain, str(unquantized), LoraConfig(r=8), {"load_in_8bit": True})
