"""Page-locked host buffers for checkpoint offload, recycled across steps and capped by a byte budget.

Design: the buffers come from PyTorch's pinned allocator (`pin_memory=True`), which records the copies that use a
block and frees nothing a copy still reads. Left to itself, though, that allocator caches every freed block forever,
and it serves a request only from a cached block of a matching size. Checkpoints change size with every new
completion length, so pinned memory would grow past host RAM. This pool therefore keeps its own buffers. A buffer is
reused for any request between half its size and its size, and the pool's total never exceeds the budget. To make
room, unused buffers are dropped and the allocator's free cached blocks are handed back to the OS
(`torch._C._host_emptyCache`). When nothing fits, the caller keeps the checkpoint on the device.

A buffer handed back after a host-to-device copy comes with that copy's CUDA event. The next device-to-host copy
into it waits for the event on its own stream, so reuse never blocks the host.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch


@dataclass(eq=False)  # identity, not tensor equality: buffers are found and removed by `is`
class _Buffer:
    tensor: torch.Tensor  # uint8, page-locked unless pinning failed (or `pin=False`)
    ready: torch.cuda.Event | None = None  # the last copy reading it


class PinnedPool:
    """Pinned host buffers: `acquire(nbytes)` → buffer or None (over budget); `release(buffer, ready_event)`."""

    def __init__(self, budget_bytes: int, *, pin: bool = True) -> None:
        self.budget_bytes = budget_bytes
        self.pin = pin
        self.allocated_bytes = 0
        self.peak_allocated_bytes = 0
        self._free: list[_Buffer] = []
        self._warned = False

    def acquire(self, nbytes: int) -> _Buffer | None:
        fitting = [b for b in self._free if nbytes <= b.tensor.numel() <= 2 * nbytes]
        if fitting:
            buffer = min(fitting, key=lambda b: b.tensor.numel())
            self._free.remove(buffer)
            return buffer
        evicted = False
        while self._free and self.allocated_bytes + nbytes > self.budget_bytes:
            self._evict(max(self._free, key=lambda b: b.tensor.numel()))
            evicted = True
        if evicted:
            _release_cached_pinned_memory()
        if self.allocated_bytes + nbytes > self.budget_bytes:
            return None
        buffer = _Buffer(self._allocate(nbytes))
        self.allocated_bytes += buffer.tensor.numel()
        self.peak_allocated_bytes = max(self.peak_allocated_bytes, self.allocated_bytes)
        return buffer

    def release(self, buffer: _Buffer, ready: torch.cuda.Event | None = None) -> None:
        buffer.ready = ready
        self._free.append(buffer)

    def close(self) -> None:
        """Drop every unused buffer and return the allocator's free cached pinned blocks to the OS."""
        while self._free:
            self._evict(self._free[-1])
        _release_cached_pinned_memory()

    def _evict(self, buffer: _Buffer) -> None:
        self._free.remove(buffer)  # the allocator itself waits for copies still using the block before reusing it
        self.allocated_bytes -= buffer.tensor.numel()

    def _allocate(self, nbytes: int) -> torch.Tensor:
        if self.pin:
            try:
                return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
            except RuntimeError as error:  # out of page-lockable memory: pageable still works, with blocking copies
                if not self._warned:
                    warnings.warn(
                        f"trl_turbo: could not pin {nbytes / 2**30:.2f} GiB of host memory for checkpoint offload "
                        f"({error}); using pageable memory, whose copies do not overlap compute. Lower "
                        "`turbo_offload_host_budget_gib` to keep more checkpoints on the GPU instead.",
                        RuntimeWarning,
                        stacklevel=3,
                    )
                    self._warned = True
        return torch.empty(nbytes, dtype=torch.uint8)


def _release_cached_pinned_memory() -> None:
    empty_host_cache = getattr(torch._C, "_host_emptyCache", None)
    if empty_host_cache is not None and torch.cuda.is_available():
        empty_host_cache()
