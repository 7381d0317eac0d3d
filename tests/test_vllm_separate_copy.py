"""CPU side of the separate copy vLLM holds where the base weights cannot be shared: the dequantized state it is fed,
on real bitsandbytes CPU layers."""

from __future__ import annotations

import inspect
import warnings

import pytest
import torch
from test_vllm_sharing_4bit import _quantized_peft_model, needs_bnb, tiny_llama

from trl_turbo.patches import vllm_engine
from trl_turbo.testing.tokenizer import VOCAB
from trl_turbo.vllm import dequantized

NF4 = {"load_in_4bit": True, "bnb_4bit_quant_type": "nf4", "bnb_4bit_compute_dtype": torch.bfloat16}
# bitsandbytes configs vLLM cannot share, each with the bound on the relative error of its dequantized weights
COPIED = {
    "int8": ({"load_in_8bit": True}, 0.02),
    "nf4-double": ({**NF4, "bnb_4bit_use_double_quant": True}, 0.15),
    "fp4-bf16storage": ({**NF4, "bnb_4bit_quant_type": "fp4", "bnb_4bit_quant_storage": torch.bfloat16}, 0.2),
}


# ------------------------------------------------------------------------------------------ dequantized state
@needs_bnb
@pytest.mark.parametrize("quantization", sorted(COPIED))
def test_dequantized_state_is_the_training_weights_under_hf_names(tmp_path, quantization):
    from bitsandbytes.functional import dequantize_4bit, int8_vectorwise_dequant

    bnb_kwargs, bound = COPIED[quantization]
    model = _quantized_peft_model(tmp_path, dtype=torch.bfloat16, **bnb_kwargs)
    base = model.get_base_model()
    hf_state = dict(vllm_engine._hf_state_for_vllm(base))
    layers = dequantized.quantized_layers(base)
    assert len(layers) == 2 * 7  # every projection of both layers; the embedding and LM head stay 16-bit
    state = dequantized.dequantized_state(base, vllm_engine._hf_state_for_vllm(base), torch.bfloat16)
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

    model = _quantized_peft_model(tmp_path, load_in_8bit=True)
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
    model = _quantized_peft_model(tmp_path, load_in_8bit=True)
    base = model.get_base_model()
    layers = dequantized.quantized_layers(base)
    made = []
    original = dequantized.dequantized_weight
    monkeypatch.setattr(dequantized, "dequantized_weight",
                        lambda layer, dtype: made.append(layer) or original(layer, dtype))
    seen = 0
    for name, _ in dequantized.dequantized_state(base, vllm_engine._hf_state_for_vllm(base), torch.bfloat16):
        seen += name in layers
        assert len(made) == seen  # each matrix is made when it is reached, not before
    assert seen == len(layers)


@needs_bnb
@pytest.mark.parametrize("quantization", ["int8", "nf4-double"])
def test_copy_size_is_the_16_bit_size_of_the_unquantized_model(tmp_path, quantization):
    model = _quantized_peft_model(tmp_path, **COPIED[quantization][0])
    assert dequantized.copy_bytes(model) == 2 * sum(p.numel() for p in tiny_llama().parameters())
