"""Page-locked host buffers for checkpoint offload, recycled across steps and capped by a byte budget.

Design: PyTorch's caching host allocator never returns pinned memory to the OS, and it serves a request only from a
cached block of a matching size. Checkpoints change size with every new completion length, so its cache grows step
after step, past host RAM. This pool owns its buffers instead. Each buffer is an ordinary (pageable) CPU tensor
page-locked with `cudaHostRegister`, so copies from and to it are asynchronous DMA transfers. A buffer is reused for
any request between half its size and its size. The registered total never exceeds the budget: unused buffers are
unregistered and freed to make room. When nothing fits, the caller keeps the checkpoint on the device.

A buffer handed back after a host-to-device copy comes with that copy's CUDA event. The next device-to-host copy
into it waits for the event on its own stream, so reuse never blocks the host.
"""

from __future__ import annotations

import mmap
import warnings
from dataclasses import dataclass

import torch

_PAGE = mmap.PAGESIZE


def _page_aligned_bytes(nbytes: int) -> torch.Tensor:
    """A uint8 CPU tensor of `nbytes` rounded up to whole pages, starting on a page boundary. cudaHostRegister locks
    whole pages, so two small heap allocations sharing a page could not both be registered; a range of whole pages
    inside one allocation never overlaps another buffer's."""
    rounded = -(-nbytes // _PAGE) * _PAGE
    raw = torch.empty(rounded + _PAGE, dtype=torch.uint8)
    offset = -raw.data_ptr() % _PAGE
    return raw[offset : offset + rounded]


@dataclass
class _Buffer:
    tensor: torch.Tensor  # uint8, page-locked unless registration failed
    registered: bool
    ready: torch.cuda.Event | None = None  # the last copy reading it


class PinnedPool:
    """Registered host buffers: `acquire(nbytes)` → buffer or None (over budget); `release(buffer, ready_event)`."""

    def __init__(self, budget_bytes: int, *, register: bool = True) -> None:
        self.budget_bytes = budget_bytes
        self.register = register
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
        while self._free and self.allocated_bytes + nbytes > self.budget_bytes:
            self._evict(max(self._free, key=lambda b: b.tensor.numel()))
        if self.allocated_bytes + nbytes > self.budget_bytes:
            return None
        buffer = _Buffer(_page_aligned_bytes(nbytes), registered=False)
        if self.register:
            buffer.registered = self._register(buffer.tensor)
        self.allocated_bytes += buffer.tensor.numel()
        self.peak_allocated_bytes = max(self.peak_allocated_bytes, self.allocated_bytes)
        return buffer

    def release(self, buffer: _Buffer, ready: torch.cuda.Event | None = None) -> None:
        buffer.ready = ready
        self._free.append(buffer)

    def close(self) -> None:
        while self._free:
            self._evict(self._free[-1])

    def _evict(self, buffer: _Buffer) -> None:
        self._free.remove(buffer)
        if buffer.ready is not None:
            buffer.ready.synchronize()
        if buffer.registered:
            torch.cuda.cudart().cudaHostUnregister(buffer.tensor.data_ptr())
        self.allocated_bytes -= buffer.tensor.numel()

    def _register(self, tensor: torch.Tensor) -> bool:
        error = torch.cuda.cudart().cudaHostRegister(tensor.data_ptr(), tensor.numel(), 0)
        if int(error) == 0:
            return True
        if not self._warned:
            warnings.warn(
                f"trl_turbo: could not page-lock {tensor.numel() / 2**30:.2f} GiB of host memory for checkpoint "
                f"offload (cudaHostRegister error {int(error)}); using pageable memory, whose copies do not overlap "
                "compute. Lower `turbo_offload_host_budget_gib` to keep more checkpoints on the GPU instead.",
                RuntimeWarning,
                stacklevel=3,
            )
            self._warned = True
        return False

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # interpreter shutdown: CUDA may already be gone
            pass
