"""Sampling from a per-step fp8 copy of the merged policy: vLLM's linear layers hold e4m3 weights (one scale per
tensor, vLLM's online fp8 layout), rewritten before each generation from the training model's base weights and the
live adapter; the training model's weights are only read.

Design decisions:
- One pass over the model per generation, one fused sampler matrix at a time (`ops.merge_fp8`): W + scaling * B @ A
  in fp32, quantized once. No 16-bit merged copy of the model ever exists; a bitsandbytes 4-bit base is dequantized
  one fused matrix at a time (the only 16-bit scratch).
- Nothing the trainer reads changes, so there is nothing to restore: an interrupted generation leaves at worst a
  stale fp8 copy, which the next generation overwrites before sampling.
- The plan (which HF matrix fills which rows of which fp8 tensor) comes from `weight_views.plan_shared_views`, the
  same derivation shared weights use, and is checked to cover every row of every fp8 tensor: a row left with vLLM's
  dummy values would sample garbage, so an incomplete plan is refused.
- fp8 changes what is sampled (the sampler's policy is the quantized one); the trainer corrects for it with TRL's
  importance sampling, which `config.py` requires with this mode, and the rollout check watches the log-prob gap.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..ops.merge_fp8 import FP8_DTYPE, MergedShard, write_merged_fp8
from .merge import lora_targets
from .weight_views import LayoutMismatch, SharedView, hf_weight_name

FP8 = "fp8"


@dataclass(frozen=True)
class Fp8Tensor:
    """One vLLM fp8 weight: its rows [N, K] (a view of vLLM's storage) and its one-element fp32 scale."""

    rows: torch.Tensor
    scale: torch.Tensor


@dataclass(eq=False)
class _Shard:
    module: torch.nn.Module  # the HF Linear holding the base weight (16-bit or bitsandbytes)
    lora: Any  # the PEFT LoRA layer adapting it, or None
    adapter: str
    start: int


@dataclass(eq=False)
class _Matrix:
    name: str
    target: Fp8Tensor
    shards: list[_Shard]


def hf_linear_modules(peft_model: Any) -> dict[str, torch.nn.Module]:
    """The frozen base Linear modules of a (PEFT-wrapped) HF model, by the plain HF name of their weight."""
    from peft.tuners.lora import LoraLayer

    modules = {}
    for name, module in peft_model.named_modules():
        if isinstance(module, torch.nn.Linear) and not isinstance(module, LoraLayer) and "lora_" not in name:
            if not module.weight.requires_grad:
                modules[hf_weight_name(f"{name}.weight")] = module
    return modules


class Fp8Sampling:
    """Writes vLLM's fp8 linear weights from the training model's base weights and live adapter (`write`)."""

    def __init__(self, peft_model: Any, adapter: str, fp8_tensors: Mapping[str, Fp8Tensor],
                 views: Sequence[SharedView], compute_dtype: torch.dtype) -> None:
        """`fp8_tensors`: vLLM's fp8 weights by name; `views`: the plan's views onto them (HF weight -> rows)."""
        modules = hf_linear_modules(peft_model)
        loras = {hf_weight_name(f"{t.name}.weight"): t.layer for t in lora_targets(peft_model, adapter)}
        by_tensor: dict[str, list[_Shard]] = {name: [] for name in fp8_tensors}
        for view in views:
            if view.vllm_name not in fp8_tensors:
                continue
            if view.hf_name not in modules:
                raise LayoutMismatch(f"{view.hf_name} maps to vLLM's fp8 {view.vllm_name} but is not a frozen Linear "
                                     "weight of the training model")
            by_tensor[view.vllm_name].append(_Shard(modules[view.hf_name], loras.pop(view.hf_name, None), adapter,
                                                    view.start))
        if loras:
            raise LayoutMismatch(f"the adapter adapts {sorted(loras)[:3]}, which vLLM does not hold in fp8; "
                                 "`turbo_vllm_sampling='fp8'` can apply adapters on linear layers vLLM quantizes only")
        self.matrices = []
        for name, shards in by_tensor.items():
            shards.sort(key=lambda shard: shard.start)
            _check_coverage(name, fp8_tensors[name].rows, shards)
            self.matrices.append(_Matrix(name, fp8_tensors[name], shards))
        self.compute_dtype = compute_dtype
        self.copy_bytes = sum(m.target.rows.numel() for m in self.matrices)
        self.metrics: dict[str, float] = {}

    @torch.no_grad()
    def write(self) -> None:
        """Quantize W + scaling * B @ A of every fp8 matrix into vLLM's tensors (synchronised: `quantize_s` is what
        it took)."""
        start = time.perf_counter()
        for matrix in self.matrices:
            shards = [self._merged_shard(shard) for shard in matrix.shards]
            write_merged_fp8(shards, matrix.target.rows, matrix.target.scale)
        devices = {m.target.rows.device for m in self.matrices if m.target.rows.is_cuda}
        for device in devices:
            torch.cuda.synchronize(device)
        self.metrics["vllm/quantize_s"] = time.perf_counter() - start
        self.metrics["vllm/fp8_copy_gib"] = self.copy_bytes / 2**30

    def _merged_shard(self, shard: _Shard) -> MergedShard:
        weight = _base_matrix(shard.module, self.compute_dtype)
        if shard.lora is None:
            return MergedShard(weight, None, None, 1.0, shard.start)
        layer, adapter = shard.lora, shard.adapter
        return MergedShard(weight, layer.lora_B[adapter].weight.detach(), layer.lora_A[adapter].weight.detach(),
                           float(layer.scaling[adapter]), shard.start)

    def take_metrics(self) -> dict[str, float]:
        metrics, self.metrics = self.metrics, {}
        return metrics


def _base_matrix(module: torch.nn.Module, dtype: torch.dtype) -> torch.Tensor:
    """The module's [out, in] base weight: as stored when 16-bit, dequantized (one matrix) when bitsandbytes."""
    weight = module.weight
    if weight.dtype in (torch.float16, torch.bfloat16, torch.float32):
        return weight.detach()
    from .dequantized import dequantized_weight

    return dequantized_weight(module, dtype)


def _check_coverage(name: str, rows: torch.Tensor, shards: Sequence[_Shard]) -> None:
    if rows.dtype != FP8_DTYPE or not rows.is_contiguous():
        raise LayoutMismatch(f"vLLM's {name} is not a contiguous {FP8_DTYPE} [out, in] tensor")
    expected = 0
    for shard in shards:
        out_features = shard.module.out_features
        if shard.start != expected:
            break
        expected += out_features
    if expected != rows.shape[0]:
        raise LayoutMismatch(f"the training model's matrices fill rows [0, {expected}) of vLLM's fp8 {name} "
                             f"({rows.shape[0]} rows): the rest would sample vLLM's placeholder weights")
