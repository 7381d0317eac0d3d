"""Sampling from a per-step fp8 copy of the policy: vLLM's linear layers hold e4m3 weights (one scale per tensor,
vLLM's online fp8 layout), rewritten before each generation from the training model's base weights and the live
adapter, or under full fine-tuning from the trained weights themselves; the training model's weights are only read.

Design decisions:
- One pass over the model per generation, one fused sampler matrix at a time (`ops.merge_fp8`): W + scaling * B @ A
  in fp32, quantized once. No 16-bit merged copy of the model ever exists; a bitsandbytes 4-bit base is dequantized
  one fused matrix at a time (the only 16-bit scratch).
- Nothing the trainer reads changes value: an interrupted generation leaves at worst a stale fp8 copy, which the
  next generation overwrites before sampling.
- Full fine-tuning writes the same copy from the trained linear weights (no adapter), after each optimizer step:
  the 16-bit embeddings, norms and LM head are vLLM's own tensors (shared as `trained_weights` shares them), the
  linear weights stay the trainer's, and nothing is parked (they change every step: a host copy would be stale).
- While vLLM samples from the fp8 copy, the training model's 16-bit linear weights are idle. With `park_base` they
  leave the device as soon as their fp8 matrix is written (the device never holds both copies of much) and come back
  after the generation from a pinned host copy taken once (exact by construction: the base never changes; 2 bytes
  per linear weight of host memory per process, checked like merged sampling's host copy). A forward and a
  state-dict pre-hook bring them back should anything reach the model while they are parked.
- The plan (which HF matrix fills which rows of which fp8 tensor) comes from `weight_views.plan_shared_views`, the
  same derivation shared weights use, and is checked to cover every row of every fp8 tensor: a row left with vLLM's
  dummy values would sample garbage, so an incomplete plan is refused.
- Under FSDP2 with tensor-parallel vLLM each rank writes its own engine rank's fp8 tensors from its own shards,
  which are that rank's slices (`vllm.sharded`): a column-parallel shard with B's rows, a row-parallel one with A's
  columns (the small factors gathered, as merged sampling does), under a scale of the rank's own tensor, as vLLM's
  online quantization of that rank's slice has. Parking then frees the shard's storage itself (every view of it,
  FSDP2's padded shard included, goes with it) and refills it in place.
- fp8 changes what is sampled (the sampler's policy is the quantized one); the trainer corrects for it with TRL's
  importance sampling, which `config.py` requires with this mode, and the rollout check watches the log-prob gap.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..ops.merge_fp8 import FP8_DTYPE, MergedShard, write_merged_fp8
from ..sharding.dtensor import local_of
from .host_copy import HostCopy, guard_model
from .merge import LoraTarget, factors_of, lora_targets
from .weight_views import LayoutMismatch, SharedView, hf_weight_name

# With parking: 16-bit bytes freed between two returns of torch's cached blocks to the driver while the fp8 copy is
# mapped in (the most both copies hold at once beyond one copy)
RETURN_EVERY_BYTES = 1 << 30


@dataclass(frozen=True)
class Fp8Tensor:
    """One vLLM fp8 weight: its rows [N, K] (a view of vLLM's storage) and its one-element fp32 scale."""

    rows: torch.Tensor
    scale: torch.Tensor


@dataclass(eq=False)
class _Shard:
    module: torch.nn.Module  # the HF Linear holding the base weight (16-bit or bitsandbytes)
    lora: LoraTarget | None  # the adapted layer, or None
    start: int


@dataclass(eq=False)
class _Matrix:
    name: str
    target: Fp8Tensor
    shards: list[_Shard]


def hf_linear_modules(model: Any) -> dict[str, torch.nn.Module]:
    """The Linear modules an fp8 copy is written from, by the plain HF name of their weight: a PEFT model's frozen
    base layers, or every Linear of a model trained whole (no adapter)."""
    from peft.tuners.lora import LoraLayer

    adapted = hasattr(model, "peft_config")
    modules = {}
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and not isinstance(module, LoraLayer) and "lora_" not in name:
            if not adapted or not module.weight.requires_grad:
                modules[hf_weight_name(f"{name}.weight")] = module
    return modules


def quantized_linear_modules(model: Any) -> list[torch.nn.Module]:
    """The Linear modules whose matrices vLLM's fp8 engine holds quantized: all but the LM head (16-bit)."""
    head = model.get_output_embeddings()
    return [module for module in hf_linear_modules(model).values() if module is not head]


class Fp8Sampling:
    """Writes vLLM's fp8 linear weights from the training model's base weights and live adapter, or from its trained
    weights (`write`)."""

    def __init__(self, peft_model: Any, adapter: str | None, fp8_tensors: Mapping[str, Fp8Tensor],
                 views: Sequence[SharedView], compute_dtype: torch.dtype, *, park_base: bool = False,
                 pin: bool | None = None) -> None:
        """`adapter`: the live adapter's name (None: full fine-tuning, the model's own weights are the policy);
        `fp8_tensors`: vLLM's fp8 weights by name; `views`: the plan's views onto them (HF weight -> rows);
        `park_base`: move the 16-bit base weights to the host while vLLM samples (see the module docstring)."""
        if adapter is None and park_base:
            raise ValueError("trained weights change every step: only a frozen base is parked")
        modules = hf_linear_modules(peft_model)
        loras = ({} if adapter is None else
                 {hf_weight_name(f"{t.name}.weight"): t for t in lora_targets(peft_model, adapter)})
        by_tensor: dict[str, list[_Shard]] = {name: [] for name in fp8_tensors}
        for view in views:
            if view.vllm_name not in fp8_tensors:
                continue
            if view.hf_name not in modules:
                raise LayoutMismatch(f"{view.hf_name} maps to vLLM's fp8 {view.vllm_name} but is not a Linear weight "
                                     "the training model samples from")
            by_tensor[view.vllm_name].append(_Shard(modules[view.hf_name], loras.pop(view.hf_name, None), view.start))
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
        self._parking: _Parking | None = None
        if park_base:
            modules = [shard.module for m in self.matrices for shard in m.shards]
            self._parking = _Parking(modules, peft_model, torch.cuda.is_available() if pin is None else pin)

    @property
    def parked_host_bytes(self) -> int:
        return 0 if self._parking is None else self._parking.host_bytes

    @torch.no_grad()
    def write(self, map_rows: Callable[[torch.Tensor], None] | None = None) -> None:
        """Quantize W + scaling * B @ A of every fp8 matrix into vLLM's tensors (synchronised: `quantize_s` is what
        it took). `map_rows(rows)`: makes one fp8 tensor's memory available, called just before it is written; with
        parking, the 16-bit weights written so far go back to the driver every `RETURN_EVERY_BYTES` meanwhile, so the
        device never holds both copies whole."""
        start = time.perf_counter()
        parked = 0
        factors = factors_of([shard.lora for matrix in self.matrices for shard in matrix.shards])
        for matrix in self.matrices:
            if map_rows is not None:
                map_rows(matrix.target.rows)
            shards = [self._merged_shard(shard, next(factors)) for shard in matrix.shards]
            write_merged_fp8(shards, matrix.target.rows, matrix.target.scale)
            del shards
            if self._parking is not None:
                parked += self._parking.park(shard.module for shard in matrix.shards)
                if map_rows is not None and parked >= RETURN_EVERY_BYTES and matrix.target.rows.is_cuda:
                    torch.cuda.empty_cache()
                    parked = 0
        devices = {m.target.rows.device for m in self.matrices if m.target.rows.is_cuda}
        for device in devices:
            torch.cuda.synchronize(device)
        self.metrics["vllm/quantize_s"] = time.perf_counter() - start
        self.metrics["vllm/fp8_copy_gib"] = self.copy_bytes / 2**30

    def _merged_shard(self, shard: _Shard, factors: tuple[torch.Tensor, torch.Tensor, float] | None) -> MergedShard:
        """The shard's base matrix with its adapter's `factors` (None: not adapted)."""
        weight = _base_matrix(shard.module, self.compute_dtype)
        if factors is None:
            return MergedShard(weight, None, None, 1.0, shard.start)
        b, a, scaling = factors
        return MergedShard(weight, b.detach(), a.detach(), scaling, shard.start)

    def unpark(self) -> None:
        """Bring the parked 16-bit weights back (copies enqueued on the current stream: later kernels see them)."""
        if self._parking is not None:
            self._parking.unpark()

    def take_metrics(self) -> dict[str, float]:
        metrics, self.metrics = self.metrics, {}
        if self._parking is not None:
            metrics.update(self._parking.take_metrics())
        return metrics

    def close(self) -> None:
        if self._parking is not None:
            self._parking.close()


class _Parking:
    """16-bit weights moved off the device and back, from a host copy taken once. A plain weight's tensor is swapped
    for an empty one; an FSDP2 shard's storage is resized to nothing and back (FSDP2 keeps views of it)."""

    def __init__(self, modules: list[torch.nn.Module], peft_model: Any, pin: bool) -> None:
        weights = [local_of(m.weight) for m in modules]
        for weight in weights:
            if weight.dtype not in (torch.float16, torch.bfloat16, torch.float32) or not weight.is_contiguous():
                raise ValueError(f"only contiguous 16/32-bit weights are parked, not {weight.dtype} strides "
                                 f"{weight.stride()}")
        self._modules = modules
        self._sharded = [local_of(m.weight) is not m.weight for m in modules]
        self._homes = [(w.shape, w.dtype, w.device, w.untyped_storage().nbytes()) for w in weights]
        self._copy = HostCopy(weights, pin=pin, purpose="fp8 sampling's parked 16-bit weights",
                              remedy="Bringing them back then blocks the host for the copy.")
        self.host_bytes = self._copy.host_bytes
        self._index = {id(m): i for i, m in enumerate(modules)}
        self._parked: set[int] = set()
        self._hooks = guard_model(peft_model, self.unpark)

    def park(self, modules: Any) -> int:
        """Free the 16-bit weights of `modules`; returns the bytes that frees."""
        freed = 0
        for module in modules:
            i = self._index[id(module)]
            if i not in self._parked:
                self._parked.add(i)  # before the storage goes: an interruption after this line still unparks it
                freed += self._homes[i][3]
                if self._sharded[i]:
                    local_of(module.weight).untyped_storage().resize_(0)
                else:
                    shape, dtype, device, _ = self._homes[i]
                    module.weight.data = torch.empty(0, dtype=dtype, device=device)
        return freed

    def unpark(self) -> None:
        if not self._parked:
            return
        weights = {}
        for i in sorted(self._parked):
            shape, dtype, device, storage_bytes = self._homes[i]
            if self._sharded[i]:
                weights[i] = local_of(self._modules[i].weight)
                weights[i].untyped_storage().resize_(storage_bytes)
            else:
                weights[i] = torch.empty(shape, dtype=dtype, device=device)
        self._copy.load(weights.items())
        for i, weight in weights.items():
            if not self._sharded[i]:
                self._modules[i].weight.data = weight
        self._parked.clear()

    def take_metrics(self) -> dict[str, float]:
        metrics = {"vllm/parked_host_gib": self.host_bytes / 2**30}
        seconds = self._copy.take_copy_seconds()
        if seconds is not None:
            metrics["vllm/unpark_s"] = seconds
        return metrics

    def close(self) -> None:
        self.unpark()
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
        self._copy.close()


def _base_matrix(module: torch.nn.Module, dtype: torch.dtype) -> torch.Tensor:
    """The module's [out, in] base weight as this rank holds it (FSDP2's shard): as stored when 16-bit, dequantized
    (one matrix) when bitsandbytes."""
    weight = local_of(module.weight)
    if weight.dtype in (torch.float16, torch.bfloat16, torch.float32):
        return weight.detach()
    from .dequantized import dequantized_weight

    return dequantized_weight(module, dtype)


def _check_coverage(name: str, rows: torch.Tensor, shards: Sequence[_Shard]) -> None:
    if rows.dtype != FP8_DTYPE or not rows.is_contiguous():
        raise LayoutMismatch(f"vLLM's {name} is not a contiguous {FP8_DTYPE} [out, in] tensor")
    expected = 0
    for shard in shards:
        weight = local_of(shard.module.weight)
        out_features = weight.shape[0] if weight.is_floating_point() else shard.module.out_features
        if shard.start != expected:
            break
        expected += out_features
    if expected != rows.shape[0]:
        raise LayoutMismatch(f"the training model's matrices fill rows [0, {expected}) of vLLM's fp8 {name} "
                             f"({rows.shape[0]} rows): the rest would sample vLLM's placeholder weights")
