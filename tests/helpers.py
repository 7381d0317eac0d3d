"""Helpers shared by several test modules (test modules never import each other): a stand-in of the vLLM model
layout, tiny quantized PEFT models, a random model tilted to stop early, and the checkpointing tests' tiny models,
token batches and gradients."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest
import torch

from trl_turbo.testing.models import tiny_model
from trl_turbo.testing.tokenizer import EOS_ID, VOCAB

PACKED = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}
VOCAB_PADDING = 64
CAP = 16  # completion cap of the learning probes


class StandInVllmModel(torch.nn.Module):
    """What vLLM 0.24 builds for these families, reduced to the layout: q/k/v and gate/up stacked along rows in
    `packed_modules_mapping` order, vocabulary padded to a multiple of 64, LoRA-wrapped layers' weights under
    `.base_layer`, tied heads aliasing the embedding, dummy values until `load_weights`."""

    packed_modules_mapping = PACKED

    def __init__(self, hf_model: torch.nn.Module, shard_order: dict[str, list[str]] = PACKED) -> None:
        super().__init__()
        self._order = shard_order
        self._where: dict[str, tuple[str, int]] = {}
        shapes: dict[str, list[int]] = {}
        tied = hf_model.config.tie_word_embeddings
        # a PEFT-injected model: its base weights, not its adapter
        hf_state = {n.replace(".base_layer", ""): t for n, t in hf_model.state_dict().items() if "lora_" not in n}
        for name, tensor in hf_state.items():
            if tied and name == "lm_head.weight":
                continue
            module, _, leaf = name.rpartition(".")
            parent, _, child = module.rpartition(".")
            packed = next((p for p, shards in shard_order.items() if child in shards), None)
            if packed is None:
                rows = tensor.shape[0]
                if "embed_tokens" in name or "lm_head" in name:
                    rows = -(-rows // VOCAB_PADDING) * VOCAB_PADDING
                shapes[name] = [rows, *tensor.shape[1:]]
                self._where[name] = (name, 0)
                continue
            target = f"{parent}.{packed}.base_layer.{leaf}"
            shards = [hf_state[f"{parent}.{s}.{leaf}"] for s in shard_order[packed]]
            before = shard_order[packed].index(child)
            # like vLLM's loader after LoRA wrapping: only the `.base_layer` name reaches the wrapped parameter
            self._where[f"{module}.base_layer.{leaf}"] = (target, sum(t.shape[0] for t in shards[:before]))
            shapes[target] = [sum(t.shape[0] for t in shards), *tensor.shape[1:]]
        self._params = torch.nn.ParameterDict()
        for name, shape in shapes.items():
            self._params[name.replace(".", "__")] = torch.nn.Parameter(
                torch.empty(shape, dtype=hf_model.dtype).uniform_(-1e-3, 1e-3), requires_grad=False)

    def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
        for key, param in self._params.items():
            yield key.replace("__", "."), param

    def param(self, name: str) -> torch.Tensor:
        return self._params[name.replace(".", "__")]

    def load_weights(self, weights) -> None:
        for name, tensor in weights:
            if name == "lm_head.weight" and "lm_head.weight" not in self._where:  # tied: vLLM skips it
                continue
            target, offset = self._where[name]  # KeyError for a name vLLM would not find, as vLLM raises
            self.param(target).data[offset : offset + tensor.shape[0]].copy_(tensor)


needs_bnb = pytest.mark.skipif(importlib.util.find_spec("bitsandbytes") is None, reason="needs bitsandbytes")


def tiny_llama(dtype=torch.float32):
    """The unquantized model `quantized_peft_model` quantizes."""
    return tiny_model("llama", vocab_size=len(VOCAB), hidden_size=64, intermediate_size=128, dtype=dtype)


def quantized_peft_model(tmp_path, dtype=torch.float32, **bnb_kwargs):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    tiny_llama().save_pretrained(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(tmp_path, quantization_config=BitsAndBytesConfig(**bnb_kwargs),
                                                 dtype=dtype, device_map="cpu")
    return get_peft_model(model, LoraConfig(r=4, target_modules="all-linear"))


@torch.no_grad()
def randomize_adapter(peft_model, seed: int, scale: float = 0.5) -> None:
    """A trained-looking adapter: B is no longer zero, so merging it changes every adapted weight."""
    generator = torch.Generator().manual_seed(seed)
    for name, parameter in peft_model.named_parameters():
        if "lora_" in name:
            parameter.copy_(torch.randn(parameter.shape, generator=generator) * scale)


@torch.no_grad()
def make_model_stop_early(model: torch.nn.Module) -> None:
    """Point the EOS row of the LM head along the mean final hidden state, so a random model ends after ~3 tokens
    and the probe has room to rise."""
    weight = model.lm_head.weight
    ids = torch.randint(3, weight.shape[0], (8, 24), generator=torch.Generator().manual_seed(0))
    hidden = model(ids, output_hidden_states=True).hidden_states[-1].reshape(-1, weight.shape[1])
    direction = hidden.mean(0)
    weight[EOS_ID] += 3.0 * direction / direction.pow(2).sum()


def assert_fused_equals_stock(trainer, stock_inputs: dict, turbo_inputs: dict) -> None:
    """Stock TRL's loss and gradients on `stock_inputs` equal trl_turbo's fused loss on `turbo_inputs`."""
    from trl_turbo.testing import parity

    stock_loss, stock_grads = parity.loss_and_grads(trainer, stock_inputs, fused=False)
    turbo_loss, turbo_grads = parity.loss_and_grads(trainer, turbo_inputs, fused=True)
    torch.testing.assert_close(turbo_loss, stock_loss, rtol=2e-5, atol=1e-7)
    assert stock_grads and stock_grads.keys() == turbo_grads.keys()
    for name, grad in stock_grads.items():
        torch.testing.assert_close(turbo_grads[name], grad, rtol=2e-5, atol=1e-7)


def decoder_model(arch="llama", layers=4, device="cpu", dtype=torch.float32, seed=0):
    """A tiny ``arch`` model (untied head) in train mode, for the checkpointing tests."""
    model = tiny_model(arch, vocab_size=len(VOCAB), layers=layers, dtype=dtype, seed=seed,
                       tie_word_embeddings=False).to(device)
    model.train()
    return model


def token_batch(batch=2, length=24, seed=0):
    """Seeded random token ids (no special tokens)."""
    return torch.randint(3, len(VOCAB), (batch, length), generator=torch.Generator().manual_seed(seed))


def checkpointed_grads(model, ids, *, runtime=None, tiled_tokens=None, checkpointing=True):
    """The causal-LM loss and the parameter gradients of one forward/backward over `ids`, with transformers'
    checkpointing enabled (unless `checkpointing=False`) and, if given, trl_turbo's runtime and tiled MLP installed."""
    from trl_turbo.offload.install import install_runtime, install_tiled_mlp

    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if runtime is not None:
        install_runtime(model, runtime)
    if tiled_tokens is not None:
        install_tiled_mlp(model, tiled_tokens)
    model.zero_grad(set_to_none=True)
    out = model(ids, labels=ids)
    out.loss.backward()
    return out.loss.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def as_if_vllm_installed(monkeypatch: Any, version: str = "0.24.0", package: Path | None = None) -> None:
    """Make trl_turbo's version checks see vLLM `version` (a GPU-verified one by default) on a machine without it;
    with `package`, the contract check reads the (fake) `vllm` sources there, and config notices show anew."""
    from trl_turbo import versions, vllm_contract

    real = versions.installed_version
    monkeypatch.setattr(versions, "installed_version", lambda name: version if name == "vllm" else real(name))
    if package is not None:
        monkeypatch.setattr(vllm_contract, "installed_vllm_package", lambda: package)
        monkeypatch.setattr("trl_turbo.checks._noticed", set())
    vllm_contract._installed_verdict.cache_clear()
