"""Page-locked host storage for checkpoint offload: fixed-size chunks, recycled across steps, capped by a budget.

Design: a saved tensor lives in host memory as a list of equal chunks (16 MiB by default), copied chunk by chunk.
PyTorch's pinned allocator (`pin_memory=True`) rounds every request up to a power of two, so a 2.002 GiB checkpoint
(8 × 32K tokens of an 8B model) would take 4 GiB of page-locked RAM and exhaust the host at half the budget; a
power-of-two chunk is allocated exactly. Equal chunks also make the pool a plain free list: any checkpoint fits any
free chunks, sizes changing with every completion length never fragment it, and the pool's byte count is what the
host really holds. When the budget is reached, `acquire` returns None and the caller keeps that checkpoint on the
device. If page-locking fails, pageable chunks are used with one warning (their copies do not overlap compute). A
pool with a host floor also stops growing, with one warning, when the host's available memory would fall below the
floor (other ranks, data workers or anything else on the host took it since the budget was set): that checkpoint
stays on the device rather than the process risking the kernel's out-of-memory killer.

A request's missing chunks are views of one allocation: registered with CUDA (`host_pinning`, several times
faster to page-lock than torch's pinned allocator), or pageable with `pin=False`; torch's pinned allocator, a chunk
at a time, only where registering fails.

A chunk handed back after a host-to-device copy carries that copy's CUDA event. The next device-to-host copy into
it waits for the event on its own stream, so reuse never blocks the host.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

import torch

from ..host_memory import available_host_bytes
from .host_pinning import registered_bytes

DEFAULT_CHUNK_BYTES = 16 << 20


def flat_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor`'s bytes as a flat uint8 view (what `HostBlocks` stores and loads)."""
    return tensor.detach().reshape(-1).view(torch.uint8)


@dataclass(eq=False)  # found and removed by identity, never by comparing tensors
class _Chunk:
    tensor: torch.Tensor  # uint8 [chunk_bytes], page-locked unless pinning failed (or `pin=False`)
    ready: torch.cuda.Event | None = None  # the last copy reading it


@dataclass(eq=False)
class HostBlocks:
    """Host storage of one saved tensor: `nbytes` spread over equal chunks."""

    chunks: list[_Chunk]
    nbytes: int

    def pieces(self) -> list[tuple[int, torch.Tensor]]:
        """(byte offset, host view) per chunk, covering exactly `nbytes`."""
        size = self.chunks[0].tensor.numel()
        return [(i * size, c.tensor[: min(size, self.nbytes - i * size)]) for i, c in enumerate(self.chunks)]

    def store(self, flat: torch.Tensor, *, non_blocking: bool) -> None:
        """Copy `flat` (uint8, `nbytes`) into the chunks, on the current stream."""
        for offset, piece in self.pieces():
            piece.copy_(flat[offset : offset + piece.numel()], non_blocking=non_blocking)

    def load(self, flat: torch.Tensor, *, non_blocking: bool) -> None:
        """Copy the chunks into `flat` (uint8, `nbytes`), on the current stream."""
        for offset, piece in self.pieces():
            flat[offset : offset + piece.numel()].copy_(piece, non_blocking=non_blocking)

    def pending_reads(self) -> list[torch.cuda.Event]:
        """Distinct events of copies that last read these chunks; a write into them must wait for each."""
        events: list[torch.cuda.Event] = []
        for chunk in self.chunks:
            if chunk.ready is not None and all(chunk.ready is not e for e in events):
                events.append(chunk.ready)
        return events


OFFLOAD_REMEDY = "Lower `turbo_offload_host_budget_gib` to keep more checkpoints on the GPU instead."


class PinnedPool:
    """Pinned host chunks: `acquire(nbytes)` → HostBlocks or None (over budget); `release(blocks, ready_event)`."""

    def __init__(self, budget_bytes: int, *, chunk_bytes: int = DEFAULT_CHUNK_BYTES, pin: bool = True,
                 purpose: str = "checkpoint offload", remedy: str = OFFLOAD_REMEDY,
                 host_floor_bytes: int | None = None) -> None:
        """`purpose` and `remedy` name the user of the pool and what to do in the one warning a pinning failure
        gives; `host_floor_bytes`: the host memory growth must leave available (None: no check)."""
        if chunk_bytes <= 0 or chunk_bytes & (chunk_bytes - 1):
            raise ValueError(f"chunk_bytes must be a power of two, got {chunk_bytes}")
        self.budget_bytes = budget_bytes
        self.chunk_bytes = chunk_bytes
        self.pin = pin
        self.purpose, self.remedy = purpose, remedy
        self.allocated_bytes = 0
        self.host_floor_bytes = host_floor_bytes
        self._free: list[_Chunk] = []
        self._warned = False
        self._warned_low = False

    def acquire(self, nbytes: int) -> HostBlocks | None:
        needed = max(1, math.ceil(nbytes / self.chunk_bytes))
        missing = max(0, needed - len(self._free))
        if self.allocated_bytes + missing * self.chunk_bytes > self.budget_bytes:
            return None
        if missing and self._host_too_low(missing * self.chunk_bytes):
            return None
        new = [_Chunk(tensor) for tensor in self._allocate(missing)] if missing else []
        chunks = [self._free.pop() for _ in range(needed - missing)] + new
        self.allocated_bytes += missing * self.chunk_bytes
        return HostBlocks(chunks, nbytes)

    def _host_too_low(self, growth: int) -> bool:
        if self.host_floor_bytes is None:
            return False
        available = available_host_bytes()
        if available - growth >= self.host_floor_bytes:
            return False
        if not self._warned_low:
            warnings.warn(
                f"trl_turbo: the host has {available / 2**30:.2f} GiB available, under the "
                f"{self.host_floor_bytes / 2**30:.2f} GiB {self.purpose} leaves free; the pool stops growing at "
                f"{self.allocated_bytes / 2**30:.2f} GiB and further checkpoints stay on the GPU. {self.remedy}",
                RuntimeWarning,
                stacklevel=4,
            )
            self._warned_low = True
        return True

    def release(self, blocks: HostBlocks, ready: torch.cuda.Event | None = None) -> None:
        for chunk in blocks.chunks:
            chunk.ready = ready
        self._free.extend(blocks.chunks)
        blocks.chunks = []

    @property
    def free_bytes(self) -> int:
        return len(self._free) * self.chunk_bytes

    def close(self) -> None:
        """Drop every unused chunk and return the allocator's free cached pinned blocks to the OS. A chunk shares its
        allocation with the others of its request: the memory goes once all of them are dropped, so the callers close
        a pool only with every chunk released."""
        self.allocated_bytes -= self.free_bytes
        self._free.clear()  # what frees a chunk's memory first waits for copies still using it
        empty_host_cache = getattr(torch._C, "_host_emptyCache", None)
        if empty_host_cache is not None and torch.cuda.is_available():
            empty_host_cache()

    def _allocate(self, count: int) -> list[torch.Tensor]:
        """`count` new chunks, views of one allocation where it can be."""
        if not self.pin:
            return list(torch.empty(count * self.chunk_bytes, dtype=torch.uint8).split(self.chunk_bytes))
        slab = registered_bytes(count * self.chunk_bytes)
        if slab is not None:
            return list(slab.split(self.chunk_bytes))
        return [self._torch_pinned() for _ in range(count)]

    def _torch_pinned(self) -> torch.Tensor:
        try:
            return torch.empty(self.chunk_bytes, dtype=torch.uint8, pin_memory=True)
        except RuntimeError as error:  # out of page-lockable memory: pageable still works, with blocking copies
            if not self._warned:
                warnings.warn(
                    f"trl_turbo: could not pin host memory for {self.purpose} after "
                    f"{self.allocated_bytes / 2**30:.2f} GiB ({error}); using pageable memory, whose copies do "
                    f"not overlap compute. {self.remedy}",
                    RuntimeWarning,
                    stacklevel=5,
                )
                self._warned = True
        return torch.empty(self.chunk_bytes, dtype=torch.uint8)
