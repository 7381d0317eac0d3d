"""CPU side of the separate copy vLLM holds where the base weights cannot be shared: the mode each engine is built in,
the dequantized state it is fed (on real bitsandbytes CPU layers), its engine arguments and KV budget, the copy into a
stand-in vLLM model, and TRL's bitsandbytes probe switched off only for the call. The engine side (vLLM's loader,
sampling through the adapter) is GPU-only: tests/sampler/test_vllm_families.py."""

from __future__ import annotations

import inspect
import sys
import types
import warnings

import pytest
import torch
from helpers import StandInVllmModel, needs_bnb, quantized_peft_model, tiny_llama

from trl_turbo.config import Settings
from trl_turbo.patches import construction, trl_vllm
from trl_turbo.testing.models import tiny_model
from trl_turbo.testing.tokenizer import VOCAB
from trl_turbo.vllm import dequantized, engine_plan
from trl_turbo.vllm import engine as vllm_engine
from trl_turbo.vllm.sharing import COPY, SHARED, sharing_mode

NF4 = {"load_in_4bit": True, "bnb_4bit_quant_type": "nf4", "bnb_4bit_compute_dtype": torch.bfloat16}
# bitsandbytes configs vLLM cannot share, each with the bound on the relative error of its dequantized weights
COPIED = {
    "int8": ({"load_in_8bit": True}, 0.02),
    "nf4-double": ({**NF4, "bnb_4bit_use_double_quant": True}, 0.15),
    "fp4-bf16storage": ({**NF4, "bnb_4bit_quant_type": "fp4", "bnb_4bit_quant_storage": torch.bfloat16}, 0.2),
}


def _peft(model):
    from peft import LoraConfig, get_peft_model

    return get_peft_model(model, LoraConfig(r=4, target_modules="all-linear"))


def _phi3():
    """A 16-bit model of a family whose vLLM layout trl_turbo does not map."""
    return _peft(tiny_model("phi3", vocab_size=len(VOCAB), dtype=torch.bfloat16))


# ------------------------------------------------------------------------------------------------------ mode
@needs_bnb
def test_each_loaded_model_gets_the_mode_its_config_names(tmp_path):
    shared = sharing_mode(quantized_peft_model(tmp_path / "nf4", **NF4))
    assert shared.mode == SHARED and shared.reasons == ()
    eight_bit = sharing_mode(quantized_peft_model(tmp_path / "int8", load_in_8bit=True))
    assert eight_bit.mode == COPY and "8-bit" in eight_bit.reasons[0] and eight_bit.unforeseen == ()
    phi3 = sharing_mode(_phi3())
    assert phi3.mode == COPY and "'phi3'" in phi3.reasons[0]
    assert sharing_mode(_peft(tiny_llama(torch.bfloat16))).mode == SHARED


@needs_bnb
def test_a_layout_only_the_loaded_model_shows_is_warned_about_when_the_engine_is_built(tmp_path):
    model = quantized_peft_model(tmp_path, **NF4, llm_int8_skip_modules=["down_proj"])
    model.config.quantization_config.llm_int8_skip_modules = None  # the config no longer tells (foreseen: nothing)
    sharing = sharing_mode(model)
    assert sharing.mode == COPY and sharing.unforeseen == sharing.reasons
    settings = Settings.of(types.SimpleNamespace(turbo_vllm_shared_weights=True))

    def engine_sharing():  # as the vLLM seam plans and warns
        plan = engine_plan.plan_engine(settings, engine_plan.engine_facts(model))
        engine_plan.warn_engine_plan(plan, settings)
        return plan.sharing

    with pytest.warns(RuntimeWarning, match="LM head is 4-bit.*separate 16-bit copy.*dequantized"):
        assert engine_sharing() == sharing
    model.config.quantization_config.load_in_4bit, model.config.quantization_config.load_in_8bit = False, True
    with warnings.catch_warnings():  # warned at config time already: the engine stays quiet
        warnings.simplefilter("error")
        assert engine_sharing().unforeseen == ()


# ------------------------------------------------------------------------------------------ dequantized state
@needs_bnb
@pytest.mark.parametrize("quantization", sorted(COPIED))
def test_dequantized_state_is_the_training_weights_under_hf_names(tmp_path, quantization):
    from bitsandbytes.functional import dequantize_4bit, int8_vectorwise_dequant

    bnb_kwargs, bound = COPIED[quantization]
    model = quantized_peft_model(tmp_path, dtype=torch.bfloat16, **bnb_kwargs)
    base = model.get_base_model()
    hf_state = dict(vllm_engine.hf_state_for_vllm(base))
    layers = dequantized.quantized_layers(base)
    assert len(layers) == 2 * 7  # every projection of both layers; the embedding and LM head stay 16-bit
    state = dequantized.dequantized_state(base, vllm_engine.hf_state_for_vllm(base), torch.bfloat16)
    assert inspect.isgenerator(state)
    state = dict(state)
    statistics = {n for n in hf_state if n.startswith(tuple(f"{w.removesuffix('.weight')}." for w in layers))
                  and not n.endswith((".weight", ".bias"))}
    assert statistics and state.keys() == hf_state.keys() - statistics
    reference = dict(tiny_llama().named_parameters())
    for name, tensor in state.items():
        if name not in layers:  # 16-bit tensors go through as they are
            assert tensor.data_ptr() == hf_state[name].data_ptr() and tensor.dtype == hf_state[name].dtype, name
            continue
        weight = layers[name].weight
        if quantization == "int8":
            expected = int8_vectorwise_dequant(weight.data, weight.SCB)
        else:
            expected = dequantize_4bit(weight.data, weight.quant_state)
        assert tensor.dtype == torch.bfloat16 and torch.equal(tensor, expected.to(torch.bfloat16)), name
        assert tensor.shape == reference[name].shape, name
        error = (tensor.float() - reference[name]).norm() / reference[name].norm()
        assert error < bound, (name, float(error))


@needs_bnb
def test_eight_bit_scales_are_found_after_a_forward_moved_them(tmp_path):
    from bitsandbytes.functional import int8_vectorwise_dequant

    model = quantized_peft_model(tmp_path, load_in_8bit=True)
    layer = next(iter(dequantized.quantized_layers(model).values()))
    before = dequantized.dequantized_weight(layer, torch.bfloat16)
    scales = layer.weight.SCB
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # bitsandbytes: inputs cast to float16
        model(torch.randint(3, len(VOCAB), (1, 6)))
    assert layer.weight.SCB is None and layer.state.SCB is scales  # where bitsandbytes keeps them after a forward
    assert torch.equal(dequantized.dequantized_weight(layer, torch.bfloat16), before)
    assert torch.equal(before, int8_vectorwise_dequant(layer.weight.data, scales).to(torch.bfloat16))


@needs_bnb
def test_dequantized_state_holds_one_matrix_at_a_time(tmp_path, monkeypatch):
    model = quantized_peft_model(tmp_path, load_in_8bit=True)
    base = model.get_base_model()
    layers = dequantized.quantized_layers(base)
    made = []
    original = dequantized.dequantized_weight
    monkeypatch.setattr(dequantized, "dequantized_weight",
                        lambda layer, dtype: made.append(layer) or original(layer, dtype))
    seen = 0
    for name, _ in dequantized.dequantized_state(base, vllm_engine.hf_state_for_vllm(base), torch.bfloat16):
        seen += name in layers
        assert len(made) == seen  # each matrix is made when it is reached, not before
    assert seen == len(layers)


@needs_bnb
@pytest.mark.parametrize("quantization", ["int8", "nf4-double"])
def test_copy_size_is_the_16_bit_size_of_the_unquantized_model(tmp_path, quantization):
    model = quantized_peft_model(tmp_path, **COPIED[quantization][0])
    assert dequantized.copy_bytes(model) == 2 * sum(p.numel() for p in tiny_llama().parameters())


# ---------------------------------------------------------------------------------------------- engine
def _generation(model, mixed_precision="no"):
    return types.SimpleNamespace(mode="colocate", model=model, accelerator=types.SimpleNamespace(
        mixed_precision=mixed_precision, device=torch.device("cpu")), max_num_seqs=8, max_model_length=512,
        max_completion_length=64)


def _engine_config(**overrides):
    return types.SimpleNamespace(turbo_vllm_shared_weights=True, turbo_vllm_standby=False,
                                 turbo_vllm_kv_cache_dtype="auto", **overrides)


def _engine_kwargs(model, mixed_precision="no"):
    generation = _generation(model, mixed_precision)
    return engine_plan.engine_kwargs(generation, _engine_config(), sharing_mode(model), "lora")  # a copy: LoRA


@needs_bnb
def test_a_separate_copy_gets_a_16_bit_engine_with_one_lora_slot(tmp_path, monkeypatch):
    from trl_turbo import versions

    # the engine's dtype follows the training precision only with a vLLM in precision matching's range
    monkeypatch.setattr(versions, "installed_version", lambda package: {"vllm": "0.24.0"}.get(package))
    kwargs = _engine_kwargs(quantized_peft_model(tmp_path / "int8", load_in_8bit=True))
    assert kwargs["load_format"] == "dummy" and kwargs["dtype"] == "bfloat16"
    assert "quantization" in kwargs and kwargs["quantization"] is None  # TRL would ask for bitsandbytes
    # the checkpoint vLLM reads may itself be quantized; vLLM must not read its quantization config
    assert kwargs["hf_overrides"] == {"quantization_config": None}
    assert kwargs["enable_lora"] and kwargs["max_lora_rank"] == 8 and kwargs["max_loras"] == 1
    copied_4bit = _engine_kwargs(quantized_peft_model(tmp_path / "bf16storage", **NF4,
                                                       bnb_4bit_quant_storage=torch.bfloat16), "fp16")
    assert copied_4bit["quantization"] is None and copied_4bit["dtype"] == "float16"  # the training precision
    phi3 = _engine_kwargs(_phi3())
    assert phi3["load_format"] == "dummy" and phi3["quantization"] is None and "hf_overrides" not in phi3
    assert phi3["enable_lora"]
    shared = _engine_kwargs(quantized_peft_model(tmp_path / "nf4", **NF4))  # shared 4-bit: unchanged
    assert shared["quantization"] == "bitsandbytes" and "load_format" not in shared and "dtype" not in shared
    assert shared["hf_overrides"]["quantization_config"]["load_in_4bit"]
    shared = _engine_kwargs(_peft(tiny_llama(torch.bfloat16)))  # shared 16-bit: unchanged
    assert shared["load_format"] == "dummy" and "quantization" not in shared and "hf_overrides" not in shared


@needs_bnb
def test_kv_budget_counts_the_weights_vllm_adds(tmp_path, monkeypatch):
    from trl_turbo.vllm.quantized import statistics_bytes

    counted = []
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (100 * 2**30, 140 * 2**30))
    monkeypatch.setattr(engine_plan, "auto_kv_cache_bytes", lambda **kw: counted.append(kw["vllm_weight_bytes"]) or 0)
    copied = quantized_peft_model(tmp_path / "int8", load_in_8bit=True)
    engine_plan.kv_budget(_generation(copied), sharing_mode(copied), "auto")
    # a 16-bit copy next to the training model's weights: 2 bytes per element, no 4-bit block scales
    assert counted[-1] == dequantized.copy_bytes(copied) == 2 * sum(p.numel() for p in tiny_llama().parameters())
    copied = quantized_peft_model(tmp_path / "bf16storage", **NF4, bnb_4bit_use_double_quant=True,
                                   bnb_4bit_quant_storage=torch.bfloat16)
    engine_plan.kv_budget(_generation(copied), sharing_mode(copied), "auto")
    assert counted[-1] == dequantized.copy_bytes(copied) and statistics_bytes(copied) == 0
    shared = quantized_peft_model(tmp_path / "nf4", **NF4, bnb_4bit_use_double_quant=True)
    engine_plan.kv_budget(_generation(shared), sharing_mode(shared), "auto")
    frozen = sum(p.numel() * p.element_size() for p in shared.parameters() if not p.requires_grad)
    assert counted[-1] == frozen + statistics_bytes(shared) and statistics_bytes(shared) > 0
    engine_plan.kv_budget(_generation(shared), None, "auto")  # standby alone: TRL's engine loads a copy of its own
    assert counted[-1] == frozen + statistics_bytes(shared, shared=False)
    single = quantized_peft_model(tmp_path / "nf4-single", **NF4, bnb_4bit_use_double_quant=False)
    frozen = sum(p.numel() * p.element_size() for p in single.parameters() if not p.requires_grad)
    engine_plan.kv_budget(_generation(single), None, "auto")  # its own copy's fp32 scales: counted
    assert counted[-1] == frozen + statistics_bytes(single, shared=False) > frozen


def test_metrics_report_the_separate_copy():
    state = engine_plan.EngineState()
    state.copy_bytes = 3 * 2**29
    metrics = engine_plan.drain_metrics(types.SimpleNamespace(_trl_turbo_engine=state))
    assert metrics == {"vllm/separate_copy_gib": 1.5}


@needs_bnb
@pytest.mark.parametrize("quantization", ["int8", "nf4-double"])
def test_copy_loads_the_dequantized_weights_and_leaves_the_training_ones(tmp_path, monkeypatch, quantization):
    from trl_turbo.testing.vllm_checks import copy_mismatches

    model = quantized_peft_model(tmp_path, dtype=torch.bfloat16, **COPIED[quantization][0])
    stand_in = StandInVllmModel(tiny_llama(torch.bfloat16))  # vLLM's 16-bit layout of the same model
    monkeypatch.setattr(vllm_engine, "driver_model", lambda llm: stand_in)
    monkeypatch.setattr(vllm_engine, "engine_dtype", lambda llm: torch.bfloat16)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    assert len(copy_mismatches(object(), model)) == 2 * 7 + 2  # dummy weights: every matrix differs

    copied = vllm_engine.copy_base_weights(object(), model)

    assert copied == dequantized.copy_bytes(model)
    assert copy_mismatches(object(), model) == []  # each matrix's dequantized values are its rows of vLLM's
    storages = {p.untyped_storage().data_ptr() for _, p in stand_in.named_parameters()}
    for name, param in model.named_parameters():  # the training model keeps its own weights, unchanged
        assert param.untyped_storage().data_ptr() not in storages and torch.equal(param, before[name]), name


# ------------------------------------------------------------------------------------ TRL's bitsandbytes probe
def _trl_init_vllm(self):
    """Stands in for TRL's `_init_vllm`: refuses 8-bit layers when bitsandbytes is available, then builds the engine
    from its module's `LLM` with the quantization it picked."""
    module = sys.modules[__name__]
    if module.is_bitsandbytes_available():
        raise ValueError("vLLM does not support in-flight 8-bit quantization.")
    self.llm = module.LLM(model="some/model", quantization="bitsandbytes")


def _available():
    return True


@pytest.fixture
def trl_module(monkeypatch):
    module = sys.modules[__name__]
    monkeypatch.setattr(module, "LLM", lambda **kwargs: kwargs, raising=False)
    monkeypatch.setattr(module, "is_bitsandbytes_available", _available, raising=False)
    return module


def test_trl_probe_is_off_only_while_a_separate_copy_is_built(trl_module, monkeypatch):
    config = _engine_config(turbo_vllm_match_precision=True)
    monkeypatch.setattr(construction, "constructing_config", lambda: config)
    features = []
    monkeypatch.setattr(trl_vllm.engine_session, "start_engine",
                        lambda *args: (features.append(args[1].sharing), args[1]))
    generation = _generation(_phi3(), "bf16")

    trl_vllm._wrap_init_vllm(_trl_init_vllm)(generation)

    assert generation.llm["quantization"] is None and generation.llm["load_format"] == "dummy"
    assert features[0].mode == COPY
    assert trl_module.is_bitsandbytes_available is _available and trl_module.LLM(a=1) == {"a": 1}
    config.turbo_vllm_shared_weights = False  # no trl_turbo quantization: TRL's probe stays
    with pytest.raises(ValueError, match="8-bit"):
        trl_vllm._wrap_init_vllm(_trl_init_vllm)(generation)


def test_trl_probe_comes_back_when_the_engine_fails(trl_module, monkeypatch):
    config = _engine_config(turbo_vllm_match_precision=True)
    monkeypatch.setattr(construction, "constructing_config", lambda: config)

    def failing_init_vllm(self):
        assert not sys.modules[__name__].is_bitsandbytes_available()
        raise RuntimeError("vLLM could not start")

    with pytest.raises(RuntimeError, match="could not start"):
        trl_vllm._wrap_init_vllm(failing_init_vllm)(_generation(_phi3(), "bf16"))
    assert trl_module.is_bitsandbytes_available is _available
    assert trl_module.LLM(a=1) == {"a": 1}
