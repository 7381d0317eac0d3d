"""QLoRA (bitsandbytes 4-bit base + LoRA) with trl_turbo's training features against stock TRL's QLoRA path.

bitsandbytes' CPU backend quantizes and runs `Linear4bit` layers, so the parity runs on CPU in CI: the same saved
model is quantized identically for both variants, and losses, LoRA gradients and parameters must agree per step.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from trl_turbo.offload.install import runtime_of
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
    matmul, where stock rounds one whole-batch product: per tensor, |Δ| ≤ `ulps` bf16 ulps of its largest entry.
    The loss is computed in fp32 from the same forward values, so it must agree to fp32 reassociation."""
    resolution = ulps * torch.finfo(torch.bfloat16).eps
    assert len(stock) == len(turbo) and stock
    for step, (a, b) in enumerate(zip(stock, turbo)):
        assert abs(a.loss - b.loss) <= 1e-5 * abs(a.loss) + 1e-7, (step, a.loss, b.loss)
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
    assert runtime_of(trainer.model) is not None
    tiles = [layer.mlp.forward for layer in base.model.layers]
    assert all(isinstance(tile, TiledMLPForward) and tile.grad_path for tile in tiles)


# ------------------------------------------------------------------------------------------------------ GPU
def _gpu_loss_and_grads(tmp_path, variant: str, bf16: bool, quantization: dict) -> tuple[torch.Tensor, dict]:
    dtype = torch.bfloat16 if bf16 else torch.float32
    quantization = {**quantization, "bnb_4bit_compute_dtype": dtype} if "load_in_4bit" in quantization else quantization
    extra = {"turbo_tiled_mlp_tokens": 64, "turbo_offload_host_budget_gib": 1.0} if variant == "turbo" else {}
    with parity.patch_state(variant):
        config = parity.base_config_kwargs(str(tmp_path / f"{variant}-{bf16}"), use_cpu=False, bf16=bf16,
                                           gradient_checkpointing=True, **extra)
        torch.manual_seed(0)
        trainer = parity.build_trainer(config, peft=True, quantization=quantization,
                                       model_kwargs={"hidden_size": 128, "layers": 3, "dtype": dtype,
                                                     "tie_word_embeddings": False})
        trainer.model.train()
        inputs = parity.synthetic_batch(trainer, batch=4, prompt_len=32, completion_len=96)
        inputs = {name: value.cuda() for name, value in inputs.items()}
        loss, grads = parity.loss_and_grads(trainer, inputs, fused=variant == "turbo")
    return loss.float().cpu(), {name: grad.float().cpu() for name, grad in grads.items()}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("quantization", ["nf4-double", "int8"])
def test_qlora_gpu_bf16_errors_within_twice_stock(tmp_path, quantization):
    """On the GPU, in bf16, with every feature on (fused loss, offloaded checkpoints, MLP tiles): against the same
    quantized model computed in fp32, trl_turbo's loss and LoRA gradients err at most twice as much as stock TRL's."""
    settings = QUANTIZATIONS[quantization]
    reference_loss, reference = _gpu_loss_and_grads(tmp_path, "stock", False, settings)
    stock_loss, stock = _gpu_loss_and_grads(tmp_path, "stock", True, settings)
    turbo_loss, turbo = _gpu_loss_and_grads(tmp_path, "turbo", True, settings)
    assert reference.keys() == stock.keys() == turbo.keys() and any("lora_B" in name for name in reference)
    floor = 1e-6 * max(1.0, abs(float(reference_loss)))
    assert abs(turbo_loss - reference_loss) <= 2 * abs(stock_loss - reference_loss) + floor
    for name, ref in reference.items():
        scale = ref.abs().max().item()
        stock_error = (stock[name] - ref).abs().max().item()
        turbo_error = (turbo[name] - ref).abs().max().item()
        assert turbo_error <= 2 * stock_error + 1e-6 * scale, (name, turbo_error, stock_error, scale)


def test_a_short_device_tiles_4bit_mlps_through_the_training_kernel_even_without_grad(tmp_path):
    """A checkpointed layer's no-grad forward tiles a quantized MLP where memory is short; each tile then runs with
    autograd recording, as the untiled MLP does in a training forward (bitsandbytes picks its kernel by that)."""
    trainer = parity.build_trainer(parity.base_config_kwargs(str(tmp_path), **FEATURES_ON), peft=True,
                                   quantization=QUANTIZATIONS["nf4-double"])
    forward = trainer.model.get_base_model().model.layers[0].mlp.forward
    forward.free_bytes = lambda device: 2 * 300 * 8 * forward.intermediate_size * 4  # room for ~300 tokens
    real, calls = forward.original, []

    def recording(x):
        calls.append((x.numel() // x.shape[-1], torch.is_grad_enabled()))
        return real(x)

    x = torch.randn(2, 400, trainer.model.config.hidden_size)
    with torch.enable_grad():
        expected = real(x.detach().requires_grad_()).detach()
    forward.original = recording
    with torch.no_grad():
        out = forward(x)
    assert calls == [(256, True), (256, True), (256, True), (32, True)]
    torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6)
