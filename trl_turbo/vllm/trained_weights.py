"""Full fine-tuning with shared weights: vLLM samples the weights the optimizer trains, with no push per step.

Design: every parameter of the training model is planned against vLLM's tensors by the same name and row rules as a
LoRA run's frozen base (`weight_views`), after vLLM's own `load_weights` filled them once. Where the training
parameter has the engine's dtype it becomes a view of vLLM's tensor: the optimizer's in-place update is then what the
next generation samples from, and a step's sync is nothing but a prefix-cache reset. Where it does not (fp32 master
parameters next to a 16-bit engine), vLLM keeps its own 16-bit tensors and each sync casts every parameter into its
slice in place (`WeightCopies`): device-to-device copies, no gather, no `load_weights`. Under FSDP2 each rank does
the same with its shards (`trl_turbo.sharding.adopt`): a shard that is its vLLM slice is adopted or cast into it, and
what vLLM lays out otherwise (norms, a padded vocabulary) is gathered and loaded through vLLM's own loader each sync.
With standby, the 16-bit copies that casts rewrite whole are released with the KV cache while training
(`release_with_kv`): they are rewritten before the next generation anyway, so they need not hold device memory in
between. A released copy is refreshed before vLLM reads it even when TRL skips a sync (`refresh`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ..device_memory import indexed
from ..sharding.dtensor import byte_runs, local_of, wholes_of

# Whole tensors gathered before one call of vLLM's loader: a batch is handed over once it reaches this size
RELOAD_BATCH_BYTES = 256 << 20


@dataclass
class WeightCopies:
    """What a sync refreshes in vLLM from the trained parameters: `casts`, (parameter, vLLM region) pairs copied
    (with a cast) in place; `reloads`, (HF name, parameter) pairs gathered whole (FSDP2) and handed to `load`, vLLM's
    loader, in batches of up to `RELOAD_BATCH_BYTES` (one call walks every vLLM parameter, so not one per tensor).
    Every rank runs the same reloads in the same order (they may be collective)."""

    casts: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    reloads: list[tuple[str, torch.Tensor]] = field(default_factory=list)
    load: Callable[[list[tuple[str, torch.Tensor]]], None] | None = None
    shared_bytes: int = 0  # training parameters that are vLLM's memory (nothing to copy)
    released_bytes: int = 0  # vLLM's copies released with the KV cache between generations
    written_at: int = 0  # the standby's `weight_releases` when the released copies were last written
    split: dict[str, float] = field(default_factory=dict)  # the last refresh's seconds by part, as metrics

    @property
    def cast_bytes(self) -> int:
        return sum(target.numel() * target.element_size() for _, target in self.casts)

    @torch.no_grad()
    def sync(self, casts_only: bool = False) -> float:
        """Refresh vLLM's copies (`casts_only`: the rank-local casts, without the collective reloads); returns the
        seconds it took (device synchronised)."""
        start = time.perf_counter()
        if self.casts:  # one multi-tensor launch, not one copy per parameter
            torch._foreach_copy_([target for _, target in self.casts], [local_of(source) for source, _ in self.casts])
        _synchronize()
        cast_done = time.perf_counter()
        reloads = [] if casts_only else self.reloads
        if reloads and self.load is None:
            raise RuntimeError("trl_turbo: no loader for the weights vLLM lays out itself")
        # in batches of whole tensors' bytes (a DTensor's numel is the whole tensor's)
        for batch in byte_runs(reloads, lambda reload: reload[1].numel() * reload[1].element_size(),
                               RELOAD_BATCH_BYTES):
            wholes = wholes_of([param.detach() for _, param in batch])  # one gather for the batch's shards
            self.load([(name, whole) for (name, _), whole in zip(batch, wholes, strict=True)])
        _synchronize()
        end = time.perf_counter()
        self.split.update({"vllm/weight_cast_s": cast_done - start, "vllm/weight_reload_s": end - cast_done})
        return end - start


def _synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def share_trained_weights(params: Sequence[tuple[str, torch.nn.Parameter]], regions: dict[str, torch.Tensor],
                          *, device: torch.device | None = None) -> WeightCopies:
    """One process, whole weights: each (HF name, parameter) whose vLLM region (`regions`, already loaded with the
    same values) has the parameter's dtype becomes a view of it; the others are cast into it at each sync. Raises
    ValueError when a region does not hold the parameter's values (a layout that does not match)."""
    from .weight_views import LayoutMismatch

    copies = WeightCopies()
    views = []
    for name, param in params:
        region = regions[name]
        if region.shape != param.shape:
            raise LayoutMismatch(f"{name}: vLLM's region {tuple(region.shape)} is not the parameter's "
                                 f"{tuple(param.shape)}")
        expected = param.detach().to(device=region.device, dtype=region.dtype)
        if not torch.equal(region, expected):
            raise LayoutMismatch(f"{name}: vLLM's region differs from the training parameter after loading; "
                                 "refusing to share a layout that does not match.")
        if region.dtype == param.dtype and region.device == indexed(device or param.device):
            views.append((param, region))
        else:
            copies.casts.append((param, region))
    for param, region in views:
        param.data = region
        copies.shared_bytes += region.numel() * region.element_size()
    return copies


def fully_rewritten(casts: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> list[torch.Tensor]:
    """One tensor per vLLM storage that the casts' targets cover entirely (contiguous regions whose byte ranges
    together span the storage): the storages a sync rewrites whole, whose contents may be discarded in between. A
    storage with a byte no cast writes (padding rows, a region loaded some other way) is left out."""
    by_storage: dict[int, list[torch.Tensor]] = {}
    for _, target in casts:
        by_storage.setdefault(target.untyped_storage().data_ptr(), []).append(target)
    whole = []
    for targets in by_storage.values():
        if not all(target.is_contiguous() for target in targets):
            continue
        size = targets[0].element_size()
        spans = sorted((t.storage_offset() * size, (t.storage_offset() + t.numel()) * size) for t in targets)
        covered = 0
        for start, end in spans:
            if start > covered:
                break
            covered = max(covered, end)
        if covered >= targets[0].untyped_storage().nbytes():
            whole.append(targets[0])
    return whole


def release_with_kv(copies: WeightCopies | None, standby: Any) -> int:
    """Hand the KV standby the vLLM copies that every sync rewrites whole, to release with the KV cache; returns the
    bytes that adds (0: nothing to release, or done already). Called where the copies or the standby come into being,
    whichever is later."""
    if copies is None or standby is None or copies.released_bytes or not copies.casts:
        return 0
    copies.written_at = standby.weight_releases  # their values are current until the standby next unmaps them
    copies.released_bytes = standby.release_also(fully_rewritten(copies.casts))
    return copies.released_bytes


def stale(copies: WeightCopies, standby: Any) -> bool:
    """The standby unmapped vLLM's released copies after they were last written: their contents are undefined."""
    return bool(copies.released_bytes) and standby is not None and copies.written_at != standby.weight_releases


def refresh(copies: WeightCopies, standby: Any, casts_only: bool = False) -> float:
    """Write the trained parameters into vLLM's copies, mapping released ones back first (after torch's cached blocks
    went back to the driver: training may have grown into the released bytes); returns the seconds, split by part in
    `copies.split`. `casts_only`: a decision one rank makes alone (the released copies are cast targets only; the
    reloads are collective)."""
    start = time.perf_counter()
    if copies.released_bytes and standby is not None:
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        standby.restore_weights()
    mapped = time.perf_counter()
    seconds = copies.sync(casts_only=casts_only)
    copies.split["vllm/weight_map_s"] = mapped - start
    if standby is not None:
        copies.written_at = standby.weight_releases
    return seconds + mapped - start
