"""Sampling at merged-weight speed from the one shared copy: the live adapter is merged into the shared base weights
for one generation, and the base weights are restored bit-exactly before anything else reads them.

Design decisions:
- Merge: W <- round(W + scaling * B @ A), the sum accumulated in fp32 and rounded once to W's dtype, a block of
  output rows at a time (bounded fp32 scratch). Each HF weight is a view of its rows in vLLM's tensor, so merging
  through the HF module lands on the right slice of vLLM's fused q/k/v and gate/up tensors by construction.
- Restore: from a host copy of the adapted base matrices taken once (the base never changes), copied back with
  non-blocking copies on the current stream. Restoring by subtraction, W' - scaling * B @ A rounded again, is not an
  inverse in 16-bit floats: when W and W' sit in different binades the subtraction lands one ulp off (a few percent
  of elements per merge, compounding every step). An exact device-side correction needs a per-element record of at
  least a byte, which is the device memory the shared copy exists to save. The host copy costs no device memory,
  is exact by construction, and its copy (PCIe, tens of GB/s) is a few percent of a generation; being enqueued on
  the current stream, it orders before every later kernel that reads the weights (the training forward, a save's
  device-to-host copy), while the host goes on with decoding and reward scoring. Host memory is 2 bytes per adapted
  base parameter per process; `host_copy_problem` refuses the mode (the engine falls back to LoRA sampling) when
  the host cannot hold one per process next to the checkpoint offload.
- Safety: `merged` is set before the first byte changes and cleared only after every restore copy is enqueued; a
  forward pre-hook and a state-dict pre-hook on the training model restore the weights should anything ever reach
  the model while merged (an interrupted restore, a caller outside the engine's own `try/finally`).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..sharding.dtensor import byte_runs, local_of, whole_of, wholes_of
from ..sharding.tp_layout import fsdp2_chunk
from .host_copy import HostCopy, guard_model

# LoRA factors gathered whole at once under FSDP2 (one all-gather per batch)
FACTOR_BATCH_BYTES = 64 << 20
# fp32 scratch of one merge block: rows * in_features * 4 bytes stays under this
_MERGE_BLOCK_BYTES = 64 << 20


@dataclass(eq=False)
class LoraTarget:
    """One adapted Linear layer: its frozen base weight (a view of the engine's tensor) and its live LoRA factors."""

    name: str
    layer: Any  # a PEFT LoRA Linear
    adapter: str

    @property
    def weight(self) -> torch.Tensor:
        """The base weight this rank holds: the whole matrix, or FSDP2's shard (a slice of vLLM's TP tensor)."""
        return local_of(self.layer.get_base_layer().weight)

    def factors(self) -> tuple[torch.Tensor, torch.Tensor, float]:
        """(B [out, r], A [r, in], scaling), cut to this rank's shard of the base weight: under FSDP2 the small
        factors are gathered whole (collective: every rank merges the same layers in turn), then a column-parallel
        shard (rows of W) takes B's rows and a row-parallel one (columns of W) A's columns."""
        layer = self.layer
        b, a = layer.lora_B[self.adapter].weight, layer.lora_A[self.adapter].weight
        scaling = float(layer.scaling[self.adapter])
        base = layer.get_base_layer().weight
        if getattr(base, "placements", None) is None:
            return b, a, scaling
        return self.cut(whole_of(b), whole_of(a))

    def sharded_factors(self) -> list[torch.Tensor]:
        """The factors `factors()` gathers whole (none for a layer FSDP2 does not shard)."""
        layer = self.layer
        if getattr(layer.get_base_layer().weight, "placements", None) is None:
            return []
        return [layer.lora_B[self.adapter].weight, layer.lora_A[self.adapter].weight]

    def cut(self, b: torch.Tensor, a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, float]:
        """`factors()` from the whole factors B and A of a sharded layer."""
        base = self.layer.get_base_layer().weight
        scaling = float(self.layer.scaling[self.adapter])
        dim = base.placements[-1].dim
        shards = base.device_mesh.size(base.device_mesh.ndim - 1)
        index = base.device_mesh.get_local_rank(base.device_mesh.ndim - 1)
        start, stop, _ = fsdp2_chunk(base.shape[dim], shards, index)
        return (b[start:stop], a, scaling) if dim == 0 else (b, a[:, start:stop], scaling)


def factors_of(targets: Sequence[LoraTarget | None],
               batch_bytes: int = FACTOR_BATCH_BYTES) -> Iterator[tuple[torch.Tensor, torch.Tensor, float] | None]:
    """Each target's `factors()` in order (None for None), the sharded layers' factors gathered whole in batches of
    about `batch_bytes` with one all-gather each, instead of two per layer (no autograd history). Collective: every
    rank walks the same targets in the same order."""
    listed = [(target, target.sharded_factors() if target is not None else []) for target in targets]
    for batch in byte_runs(listed, lambda item: sum(f.numel() * f.element_size() for f in item[1]), batch_bytes):
        wholes = iter(wholes_of([factor for _, factors in batch for factor in factors]))
        for target, factors in batch:
            if target is None:
                yield None
            elif factors:
                yield target.cut(next(wholes), next(wholes))
            else:
                yield target.factors()


def lora_targets(peft_model: Any, adapter: str) -> list[LoraTarget]:
    """The adapted layers of `peft_model` for `adapter`, each once."""
    from peft.tuners.lora import LoraLayer

    targets = []
    for name, module in peft_model.named_modules():
        adapted = adapter in getattr(module, "lora_A", {}) or adapter in getattr(module, "lora_embedding_A", {})
        if isinstance(module, LoraLayer) and adapted:
            targets.append(LoraTarget(name, module, adapter))
    return targets


def merge_problems(peft_model: Any, adapter: str) -> list[str]:
    """Why the adapter cannot be merged into shared weights for sampling (empty: it can)."""
    from peft.tuners.lora import LoraLayer

    problems = []
    targets = lora_targets(peft_model, adapter)
    holders: dict[tuple[int, int], list[str]] = {}  # (storage, byte offset) -> modules whose weight starts there
    for name, module in peft_model.named_modules():
        weight = module.__dict__.get("_parameters", {}).get("weight")
        if isinstance(weight, torch.Tensor) and not isinstance(module, LoraLayer):
            holders.setdefault(_address(weight), []).append(name)
    for target in targets:
        if adapter in getattr(target.layer, "lora_embedding_A", {}):
            problems.append(f"{target.name} is an adapted embedding; only linear layers are merged")
            continue
        if not isinstance(target.layer.get_base_layer(), torch.nn.Linear):
            problems.append(f"{target.name} is a {type(target.layer.get_base_layer()).__name__}, not a Linear layer")
            continue
        if getattr(target.layer, "merged_adapters", None):
            problems.append(f"{target.name} already has adapters merged by PEFT ({target.layer.merged_adapters})")
        weight = target.weight
        if weight.dtype not in (torch.float16, torch.bfloat16, torch.float32):
            problems.append(f"{target.name}'s base weight is {weight.dtype}, not a floating-point matrix")
        sharing = holders.get(_address(weight), [])
        if len(sharing) > 1:  # the same weight serves another module (tied embeddings)
            problems.append(f"{target.name}'s weight is tied to {', '.join(sharing)}; merging would change all of "
                            "them")
    return problems


def _address(tensor: torch.Tensor) -> tuple[int, int]:
    tensor = local_of(tensor)
    if tensor.is_meta:  # no storage to compare (a forecast's model): tied modules hold the same parameter object
        return id(tensor), 0
    return tensor.untyped_storage().data_ptr(), tensor.storage_offset() * tensor.element_size()


@torch.no_grad()
def merge_into(weight: torch.Tensor, b: torch.Tensor, a: torch.Tensor, scaling: float) -> None:
    """weight <- round(weight + scaling * b @ a), accumulated in fp32 and rounded once (in place)."""
    rows = max(1, _MERGE_BLOCK_BYTES // (4 * max(1, weight.shape[1])))
    a32 = a.to(device=weight.device, dtype=torch.float32)
    for start in range(0, weight.shape[0], rows):
        block = weight[start : start + rows]
        delta = b[start : start + rows].to(device=weight.device, dtype=torch.float32) @ a32
        block.copy_(torch.add(block.float(), delta, alpha=scaling))


class MergedSampling:
    """The adapter merged into the shared base weights for the length of a `sampling()` block, restored bit-exactly
    from a host copy however the block ends."""

    def __init__(self, peft_model: Any, adapter: str, *, pin: bool | None = None) -> None:
        problems = merge_problems(peft_model, adapter)
        if problems:
            raise ValueError(f"trl_turbo: the adapter cannot be merged for sampling: {'; '.join(problems)}")
        self.targets = lora_targets(peft_model, adapter)
        for target in self.targets:
            if not target.weight.is_contiguous():
                raise ValueError(f"trl_turbo: {target.name}'s base weight is not contiguous; it cannot be merged in "
                                 "place")
        self._copy = HostCopy((t.weight for t in self.targets), pin=torch.cuda.is_available() if pin is None else pin,
                              purpose="merged sampling's copy of the base weights",
                              remedy="Each restore then blocks the host for its copy; `turbo_vllm_sampling='lora'` "
                              "needs no host copy.")
        self.host_bytes = self._copy.host_bytes
        self.weight_bytes = sum(t.weight.numel() * t.weight.element_size() for t in self.targets)
        self.merged = False
        self.metrics: dict[str, float] = {}
        self._hooks = guard_model(peft_model, self.ensure_restored)

    def merge(self) -> None:
        """Merge the live adapter into every adapted base weight (synchronised, so `merge_s` is what it took)."""
        if self.merged:
            raise RuntimeError("trl_turbo: the adapter is already merged into the shared weights")
        start = time.perf_counter()
        self.merged = True  # from here on a restore is owed, even if the merge stops half-way
        for target, (b, a, scaling) in zip(self.targets, factors_of(self.targets), strict=True):
            merge_into(target.weight, b, a, scaling)
        _synchronize(self.targets)
        self.metrics["vllm/merge_s"] = time.perf_counter() - start

    def restore(self) -> None:
        """Copy the base weights back from the host copy (enqueued on the current stream; later kernels see them)."""
        if not self.merged:
            return
        self._copy.load(enumerate(target.weight for target in self.targets))
        self.merged = False
        self.metrics["vllm/restore_gib"] = self.weight_bytes / 2**30

    def take_metrics(self) -> dict[str, float]:
        """Merge time, restore copy time (from CUDA events; waits for the copy) and bytes since the last call."""
        metrics, self.metrics = self.metrics, {}
        seconds = self._copy.take_copy_seconds()
        if seconds is not None:
            metrics["vllm/restore_s"] = seconds
        return metrics

    def ensure_restored(self) -> None:
        if self.merged:
            self.restore()

    @contextlib.contextmanager
    def sampling(self) -> Iterator[None]:
        """Merged inside the block; restored on every way out (return, exception, KeyboardInterrupt)."""
        try:
            self.merge()
            yield
        finally:
            self.restore()

    def close(self) -> None:
        """Restore if needed, remove the hooks and free the host copy."""
        self.ensure_restored()
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
        self._copy.close()


def _synchronize(targets: list[LoraTarget]) -> None:
    devices = {t.weight.device for t in targets if t.weight.device.type == "cuda"}
    for device in devices:
        torch.cuda.synchronize(device)




def host_copy_problem(weight_bytes: int, processes_on_host: int, available_bytes: int) -> str | None:
    """Why a host copy of `weight_bytes` per process does not fit the host (None: it fits). The copies may take at
    most half of the memory available now, leaving the rest to checkpoint offload and the data pipeline."""
    needed = weight_bytes * processes_on_host
    if needed > available_bytes // 2:
        return (f"restoring the base weights bit-exactly after each merged generation needs a host copy of the "
                f"adapted matrices, {weight_bytes / 2**30:.1f} GiB per process x {processes_on_host} processes = "
                f"{needed / 2**30:.1f} GiB, over half of the {available_bytes / 2**30:.1f} GiB of host memory "
                "available")
    return None


def adapted_weight_bytes(peft_model: Any, adapter: str) -> int:
    return sum(t.weight.numel() * t.weight.element_size() for t in lora_targets(peft_model, adapter))
