"""A pinned host copy of device tensors, taken once and copied back on demand: what merged sampling restores the
shared base weights from and what fp8 sampling brings its parked 16-bit weights back from.

Design decision: the base weights never change, so one copy taken when the engine starts is exact for the whole
run; copies back are enqueued on the current stream (later kernels that read the tensors are ordered after them) and
timed with CUDA events, which `take_copy_seconds` waits on only when the metric is read. The copy's owner also
guards the model (`guard_model`): anything that reaches it before the tensors are back brings them back first.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from ..offload.pinned_pool import HostBlocks, PinnedPool, flat_bytes


class HostCopy:
    """The bytes of `tensors`, in host memory (pinned where it can be; `purpose` and `remedy` name the user and the
    way out in the pool's one warning when it cannot)."""

    def __init__(self, tensors: Iterable[torch.Tensor], *, pin: bool, purpose: str, remedy: str) -> None:
        self._pool = PinnedPool(budget_bytes=2**62, pin=pin, purpose=purpose, remedy=remedy)
        self._blocks: list[HostBlocks] = []
        for tensor in tensors:
            flat = flat_bytes(tensor)
            blocks = self._pool.acquire(flat.numel())
            blocks.store(flat, non_blocking=False)
            self._blocks.append(blocks)
        self.host_bytes = self._pool.allocated_bytes
        self._events: tuple[torch.cuda.Event, torch.cuda.Event] | None = None

    def load(self, targets: Iterable[tuple[int, torch.Tensor]]) -> None:
        """Copy tensor `i`'s bytes into each `(i, target)` (a tensor of the same size), non-blocking, timed."""
        targets = list(targets)
        timed = any(target.is_cuda for _, target in targets)
        events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) if timed else None
        if events:
            events[0].record()
        for index, target in targets:
            self._blocks[index].load(flat_bytes(target), non_blocking=True)
        if events:
            events[1].record()
        self._events = events

    def take_copy_seconds(self) -> float | None:
        """Seconds the last `load` took on the device (waits for it; None: nothing timed since the last call)."""
        events, self._events = self._events, None
        if events is None:
            return None
        events[1].synchronize()
        return events[0].elapsed_time(events[1]) / 1000

    def close(self) -> None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()  # the host copy must outlive the copies reading it
        for blocks in self._blocks:
            self._pool.release(blocks)
        self._blocks.clear()
        self._pool.close()


def guard_model(peft_model: Any, callback: Callable[[], None]) -> list[Any]:
    """Hooks that run `callback` before any forward of the (PEFT-wrapped) model and before its state dict is read."""
    base = peft_model.get_base_model() if hasattr(peft_model, "get_base_model") else peft_model
    return [base.register_forward_pre_hook(lambda *_: callback()),
            base.register_state_dict_pre_hook(lambda *_, **__: callback())]
