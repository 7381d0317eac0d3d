"""Which slice of which vLLM tensor each frozen HF weight is.

Design: the mapping is derived, not tabulated per architecture. vLLM's model class declares
`packed_modules_mapping` (e.g. `qkv_proj: [q_proj, k_proj, v_proj]`, `gate_up_proj: [gate_proj, up_proj]`) and
stacks the shards along the output rows in that order; an HF shard's rows therefore start at the sum of the
out-features of the shards before it. Every other weight keeps its name; embeddings and LM heads are vocab-padded
by vLLM, so the HF tensor is their first `vocab_size` rows. A plan is checked against the shapes of both sides
here and against the values by the engine (after vLLM has loaded the HF weights), so a wrong mapping is refused,
never used.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

_MODULE_WRAPPERS = ("_checkpoint_wrapped_module.", "_fsdp_wrapped_module.")
_LORA_WRAPPER = ".base_layer"


@dataclass(frozen=True)
class SharedView:
    """HF weight `hf_name` == rows [start, stop) of vLLM parameter `vllm_name`."""

    hf_name: str
    vllm_name: str
    start: int
    stop: int


class LayoutMismatch(ValueError):
    """The HF model and the vLLM model do not line up; sharing is refused."""


def hf_weight_name(name: str) -> str:
    """A wrapped parameter's name as the plain HF model has it (PEFT's `base_model.model.` and `.base_layer`, and the
    checkpoint and FSDP1 wrappers' module names, gone)."""
    name = name.removeprefix("base_model.model.")
    for wrapper in _MODULE_WRAPPERS:
        name = name.replace(wrapper, "")
    return name.replace(_LORA_WRAPPER, "")


def vllm_weight_name(name: str) -> str:
    """A vLLM parameter's name without the `.base_layer` that vLLM's LoRA wrappers insert."""
    return name.replace(_LORA_WRAPPER, "")


def plan_shared_views(hf_weights: Mapping[str, Sequence[int]], vllm_params: Mapping[str, Sequence[int]],
                      packed_modules: Mapping[str, Sequence[str]]) -> list[SharedView]:
    """Plan a view for each HF weight (name → shape, names as `hf_weight_name` gives them).

    `vllm_params`: vLLM's parameters (name → shape, `.base_layer` removed); `packed_modules`: the vLLM model
    class's `packed_modules_mapping`. Raises LayoutMismatch when a weight has no counterpart of a fitting shape.
    """
    shard_of = {shard: (packed, i) for packed, shards in packed_modules.items() for i, shard in enumerate(shards)}
    views = []
    for hf_name, shape in hf_weights.items():
        module, _, leaf = hf_name.rpartition(".")
        parent, _, child = module.rpartition(".")
        if child in shard_of:
            packed, index = shard_of[child]
            vllm_name = f"{parent}.{packed}.{leaf}" if parent else f"{packed}.{leaf}"
            siblings = [f"{parent}.{s}.{leaf}" if parent else f"{s}.{leaf}" for s in packed_modules[packed]]
            missing = [s for s in siblings[:index] if s not in hf_weights]
            if missing:
                raise LayoutMismatch(f"{hf_name}: the shards before it in {vllm_name} ({missing}) are not in the "
                                     "HF model, so its offset is unknown")
            start = sum(hf_weights[s][0] for s in siblings[:index])
        else:
            vllm_name, start = hf_name, 0
        if vllm_name not in vllm_params:
            raise LayoutMismatch(f"{hf_name}: vLLM has no parameter {vllm_name}")
        stop = start + shape[0]
        target = vllm_params[vllm_name]
        if tuple(target[1:]) != tuple(shape[1:]) or stop > target[0]:
            raise LayoutMismatch(f"{hf_name} {tuple(shape)} does not fit rows [{start}, {stop}) of {vllm_name} "
                                 f"{tuple(target)}")
        views.append(SharedView(hf_name, vllm_name, start, stop))
    return views


def view_of(tensor: torch.Tensor, view: SharedView) -> torch.Tensor:
    """The rows of a vLLM tensor that `view` names (a view: same storage, contiguous)."""
    return tensor.detach()[view.start : view.stop]
