"""QLoRA (bitsandbytes 4-bit base + LoRA) with trl_turbo's training features against stock TRL's QLoRA path.

bitsandbytes' CPU backend quantizes and runs `Linear4bit` layers, so the parity runs on CPU in CI: the same saved
model is quantized identically for both variants, and losses, LoRA gradients and parameters must agree per step.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from trl_turbo.testing import parity

pytestmark = pytest.mark.skipif(importlib.util.find_spec("bitsandbytes") is None, reason="needs bitsandbytes")

QUANTIZATIONS = {
    "nf4-double": {"load_in_4bit": True, "bnb_4bit_quant_type": "nf4", "bnb_4bit_use_double_quant": True,
                   "bnb_4bit_compute_dtype": "float32"},
    "fp4": {"load_in_4bit": True, "bnb_4bit_quant_type": "fp4", "bnb_4bit_compute_dtype": "float32"},
    "int8": {"load_in_8bit": True},
}
FEATURES_ON = {"gradient_checkpointing": True, "max_completion_length": 8, "turbo_tiled_mlp_tokens": 5,
               "turbo_forward_token_budget": 40}


@pytest.mark.parametrize("quantization", sorted(QUANTIZATIONS))
def test_qlora_training_matches_stock(quantization):
    kwargs = {"steps": 2, "peft": True, "model_kwargs": {"tie_word_embeddings": False},
              "quantization": QUANTIZATIONS[quantization]}
    stock = parity.run_training("stock", {"gradient_checkpointing": True, "max_completion_length": 8}, **kwargs)
    turbo = parity.run_training("turbo", FEATURES_ON, **kwargs)
    assert any("lora_" in name for name in stock[0].grads)
    assert_close_to_bf16_resolution(stock, turbo)


def assert_close_to_bf16_resolution(stock, turbo, ulps: int = 4) -> None:
    """TRL's QLoRA keeps LoRA weights in bf16, so each MLP tile's LoRA gradient is rounded to bf16 inside its
    matmul, where stock rounds one whole-batch product: per tensor, |Δ| ≤ `ulps` bf16 ulps of its largest entry."""
    resolution = ulps * torch.finfo(torch.bfloat16).eps
    assert len(stock) == len(turbo) and stock
    for step, (a, b) in enumerate(zip(stock, turbo)):
        assert abs(a.loss - b.loss) <= resolution * max(1.0, abs(a.loss)), (step, a.loss, b.loss)
        assert a.grads.keys() == b.grads.keys()
        for name in a.grads:
            for kind, x, y in (("grad", a.grads[name], b.grads[name]), ("param", a.params[name], b.params[name])):
                error = (x.float() - y.float()).abs().max().item()
                assert error <= resolution * x.float().abs().max().item() + 1e-12, (step, kind, name, error)


@pytest.mark.parametrize("quantization", sorted(QUANTIZATIONS))
def test_qlora_model_is_quantized_and_turbo_features_installed(tmp_path, quantization):
    import bitsandbytes as bnb

    from trl_turbo.offload.tiled_mlp import TiledMLPForward

    trainer = parity.build_trainer(parity.base_config_kwargs(str(tmp_path), **FEATURES_ON), peft=True,
                                   quantization=QUANTIZATIONS[quantization])
    base = trainer.model.get_base_model()
    expected = bnb.nn.Linear8bitLt if quantization == "int8" else bnb.nn.Linear4bit
    assert isinstance(base.model.layers[0].mlp.down_proj.base_layer, expected)
    assert trainer._trl_turbo_checkpointing is not None
    tiles = [layer.mlp.forward for layer in base.model.layers]
    assert all(isinstance(tile, TiledMLPForward) and tile.grad_path for tile in tiles)
