"""GPU: Liger's fused RMSNorm and SwiGLU installed by `turbo_liger_layers` (Liger's Triton kernels do not run under
Triton's CPU interpreter, so these tests need CUDA). The flash-attention rule: in bf16 and fp16, against an fp32
computation of the same weights, Liger's outputs and gradients err at most twice as much as transformers' layers."""

from __future__ import annotations

import copy
import importlib.util

import pytest
import torch

from trl_turbo.testing import parity
from trl_turbo.testing.models import tiny_model
from trl_turbo.testing.tokenizer import VOCAB

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
              pytest.mark.skipif(importlib.util.find_spec("liger_kernel") is None, reason="needs liger-kernel")]


def _loss_and_grads(model: torch.nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    out = model(ids, labels=ids)
    out.loss.backward()
    grads = {n: p.grad.float() for n, p in model.named_parameters() if p.grad is not None}
    return out.logits.float(), grads


def _assert_within_twice(reference, stock, turbo, what: str) -> None:
    scale = reference.abs().max().item()
    stock_error = (stock - reference).abs().max().item()
    turbo_error = (turbo - reference).abs().max().item()
    assert turbo_error <= 2 * stock_error + 1e-6 * scale, (what, turbo_error, stock_error, scale)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("arch", ["llama", "qwen3", "mistral", "qwen2"])
def test_liger_layers_err_at_most_twice_transformers(arch, dtype):
    from trl_turbo.offload.install import install_liger_layers
    from trl_turbo.ops.liger_layers import LigerRMSNormForward, LigerSwiGLUForward

    reference_model = tiny_model(arch, vocab_size=len(VOCAB), hidden_size=256, layers=3,
                                 tie_word_embeddings=False).cuda()
    reference_model.train()
    low = copy.deepcopy(reference_model).to(dtype)
    liger = copy.deepcopy(low)
    installed = install_liger_layers(liger)
    norms = sum(isinstance(m.__dict__.get("forward"), LigerRMSNormForward) for m in liger.modules())
    mlps = sum(isinstance(m.__dict__.get("forward"), LigerSwiGLUForward) for m in liger.modules())
    assert mlps == 3 and norms >= 2 * 3 + 1 and installed == norms + mlps
    ids = torch.randint(3, len(VOCAB), (4, 64), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    reference = _loss_and_grads(reference_model, ids)
    stock = _loss_and_grads(low, ids)
    turbo = _loss_and_grads(liger, ids)
    _assert_within_twice(reference[0], stock[0], turbo[0], "logits")
    assert reference[1].keys() == turbo[1].keys()
    for name in reference[1]:
        _assert_within_twice(reference[1][name], stock[1][name], turbo[1][name], name)


def _trainer_loss_and_grads(tmp_path, variant: str, bf16: bool, liger: bool):
    extra = {"turbo_liger_layers": liger, "turbo_tiled_mlp_tokens": 64} if variant == "turbo" else {}
    dtype = torch.bfloat16 if bf16 else torch.float32
    with parity.patch_state(variant):
        config = parity.base_config_kwargs(str(tmp_path / f"{variant}-{bf16}-{liger}"), use_cpu=False, bf16=bf16,
                                           gradient_checkpointing=True, **extra)
        torch.manual_seed(0)
        trainer = parity.build_trainer(config, peft=True, model_kwargs={"hidden_size": 128, "layers": 3,
                                                                        "dtype": dtype, "tie_word_embeddings": False})
        trainer.model.cuda().train()
        inputs = parity.synthetic_batch(trainer, batch=4, prompt_len=32, completion_len=96)
        inputs = {name: value.cuda() for name, value in inputs.items()}
        loss, grads = parity.loss_and_grads(trainer, inputs, fused=variant == "turbo")
        tiled = [layer.mlp.forward for layer in trainer.model.get_base_model().model.layers]
    return loss.float().cpu(), {name: grad.float().cpu() for name, grad in grads.items()}, tiled


def test_liger_layers_in_the_trainer_compose_with_tiles_and_offload(tmp_path):
    from trl_turbo.offload.tiled_mlp import TiledMLPForward
    from trl_turbo.ops.liger_layers import LigerSwiGLUForward

    reference_loss, reference, _ = _trainer_loss_and_grads(tmp_path, "stock", False, False)
    stock_loss, stock, _ = _trainer_loss_and_grads(tmp_path, "stock", True, False)
    turbo_loss, turbo, tiled = _trainer_loss_and_grads(tmp_path, "turbo", True, True)
    assert all(isinstance(f, TiledMLPForward) and isinstance(f.original, LigerSwiGLUForward) for f in tiled)
    assert reference.keys() == turbo.keys() and any("lora_B" in name for name in reference)
    assert abs(turbo_loss - reference_loss) <= 2 * abs(stock_loss - reference_loss) + 1e-6
    for name in reference:
        _assert_within_twice(reference[name], stock[name], turbo[name], name)
