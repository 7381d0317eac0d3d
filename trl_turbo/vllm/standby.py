"""KV standby: vLLM's KV cache (and the weight allocations released with it) unmapped between generations.

Design decision: with `enable_sleep_mode=True` vLLM allocates its weights and its KV cache from tagged CuMem pools.
vLLM's `sleep()` unmaps both (the weights are then copied out or discarded), so standby unmaps only the `kv_cache`
allocations, and the weight-pool allocations that hold nothing but tensors their owner rewrites before each
generation, and maps them back at the same addresses before the next generation, then redoes what vLLM's own wake-up
does for the KV cache (the runner's `post_kv_cache_wake_up` where it exists, prefix-cache reset). Under a per-process
memory cap, torch may allocate what is unmapped meanwhile (a loan, computed in one place: `KVStandby._lend`).
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from typing import Any

import torch

from ..device_memory import lend_unmapped, recall_unmapped
from .engine import driver_worker, vllm_api


def _give_back(loan: list[float | None]) -> None:
    if loan[0] is not None:
        recall_unmapped(loan[0])


def _unmap(allocations: Iterable[Any]) -> None:
    """Unmap CuMem allocations (their contents are discarded) and record it where vLLM tracks that."""
    from vllm.device_allocator.cumem import unmap_and_release

    for data in allocations:
        unmap_and_release(data.handle)
        vllm_api().mark_mapped(data, False)


def _may_hold(allocation: Any, pointers: Iterable[int]) -> bool:
    """Whether a CuMem allocation (vLLM's handle: device, size, address, ...) holds one of the addresses `pointers`;
    True where the handle gives no address."""
    handle = allocation.handle
    if len(handle) < 3 or handle[2] is None:
        return True
    start = int(handle[2])
    return any(start <= pointer < start + handle[1] for pointer in pointers)


class KVStandby:
    """Unmaps vLLM's KV-cache pool between generations (weights stay mapped); `bytes` is what that frees.

    With `also_release` (the fp8 sampling copy's tensors; later, `release_also`: full fine-tuning's 16-bit copies)
    the weight-pool allocations that hold nothing but those tensors are unmapped and mapped back with the KV cache;
    their contents are lost, so the owner rewrites them after each `restore_weights`. An allocation that also holds
    anything else stays mapped (`resident_bytes` of the tensors)."""

    def __init__(self, llm: Any, also_release: Iterable[torch.Tensor] = ()) -> None:
        from vllm.device_allocator.cumem import CuMemAllocator

        self._llm = llm
        self._allocator = CuMemAllocator.get_instance()
        self.released = False
        self.kv_bytes = sum(d.handle[1] for d in self._kv_allocations())
        if self.kv_bytes == 0:
            raise RuntimeError("trl_turbo: vLLM allocated no KV cache from its sleep-mode pool; the engine must be "
                               "built with `enable_sleep_mode=True`.")
        self._weight_allocations: list[Any] = []
        self._unmapped: set[int] = set()  # ids of the weight allocations unmapped now
        self._handed: set[int] = set()  # addresses of the storages handed to `release_also`
        self.weight_releases = 0  # times the weight allocations were unmapped (their contents lost each time)
        self.resident_bytes = 0
        self.bytes = self.kv_bytes
        self._weights_mapped = True
        # Device memory in use (all processes' view of this device) when the last generation ended, before the
        # release: what a training phase may grow back to without raising the step's peak (the memory plan's ceiling)
        self.generation_in_use_bytes: int | None = None
        # torch's fraction before a release lent it the unmapped bytes; given back if the engine goes while released
        self._loan: list[float | None] = [None]
        weakref.finalize(self, _give_back, self._loan).atexit = False
        self.release_also(also_release)

    def release_also(self, tensors: Iterable[torch.Tensor]) -> int:
        """Release the weight-pool allocations that hold nothing but `tensors` with the KV cache from now on (at once
        while it is released); returns the bytes that adds."""
        storages = {t.untyped_storage().data_ptr(): t for t in tensors}
        tensors = [t for ptr, t in storages.items() if ptr not in self._handed]
        self._handed.update(storages)
        known = {id(data) for data in self._weight_allocations}
        new = [data for data in self._allocations_holding_only(tensors) if id(data) not in known]
        added = sum(data.handle[1] for data in new)
        self.resident_bytes += max(0, sum(t.untyped_storage().nbytes() for t in tensors) - added)
        if new and self.released and not self._weights_mapped:
            torch.cuda.synchronize()
            _unmap(new)
            self._unmapped.update(id(data) for data in new)
            self.weight_releases += 1
        self._weight_allocations += new
        self.bytes += added
        if new and self.released and not self._weights_mapped:
            self._lend()  # the new allocations were unmapped above
        return added

    def _kv_allocations(self) -> list[Any]:
        return [d for d in self._allocator.pointer_to_data.values() if d.tag == "kv_cache"]

    def _allocations_holding_only(self, tensors: list[torch.Tensor]) -> list[Any]:
        """The weight-pool allocations whose live blocks all start a storage of `tensors` (from the pool's own
        snapshot, so nothing else vLLM allocated there is ever unmapped)."""
        pool = self._allocator.allocator_and_pools.get("weights")
        if not tensors or pool is None:
            return []
        owned = {t.untyped_storage().data_ptr() for t in tensors}
        allocations = []
        for segment in pool[0].snapshot():
            live = [b for b in segment["blocks"] if b["state"] != "inactive"]
            data = self._allocator.pointer_to_data.get(segment["address"])
            if live and data is not None and all(b["address"] in owned for b in live):
                allocations.append(data)
        return allocations

    def release(self) -> int:
        """Unmap the KV cache (its contents are discarded) and the weight allocations released with it; returns the
        bytes freed. Released already: unmaps again the weight allocations mapped back since (a write that stopped
        before the KV cache was mapped) and returns 0."""
        mapped_weights = [data for data in self._weight_allocations if id(data) not in self._unmapped]
        if self.released:
            if mapped_weights:
                torch.cuda.synchronize()
                _unmap(mapped_weights)
                self.weight_releases += 1
                self._unmapped = {id(data) for data in self._weight_allocations}
                self._weights_mapped = False
                self._lend()
            return 0
        self._llm.reset_prefix_cache()
        torch.cuda.synchronize()
        free, total = torch.cuda.mem_get_info()
        self.generation_in_use_bytes = total - free
        if mapped_weights:
            self.weight_releases += 1
        released = self._kv_allocations() + mapped_weights
        _unmap(released)
        self._unmapped = {id(data) for data in self._weight_allocations}
        self._weights_mapped = False
        self.released = True
        self._lend()
        return self.bytes

    def restore_weights(self, tensors: Iterable[torch.Tensor] | None = None) -> None:
        """Map released weight allocations back alone (contents undefined: the owner writes them next), so they can be
        written while the device does not hold the KV cache yet: all of them, or those holding `tensors` (a writer
        that frees device memory as it goes maps each one just before writing it)."""
        if not self.released or self._weights_mapped:
            return
        pending = [data for data in self._weight_allocations if id(data) in self._unmapped]
        if tensors is not None:
            pointers = [t.untyped_storage().data_ptr() for t in tensors]
            pending = [data for data in pending if _may_hold(data, pointers)]
        if not pending:
            return
        self._recall()
        self._map(pending)
        self._lend()  # the KV cache and what is still unmapped

    def _map(self, allocations: Iterable[Any]) -> None:
        from vllm.device_allocator.cumem import create_and_map

        for data in allocations:
            create_and_map(data.handle)
            vllm_api().mark_mapped(data, True)
            self._unmapped.discard(id(data))
        self._weights_mapped = not self._unmapped

    def _unmapped_bytes(self) -> int:
        return sum(data.handle[1] for data in self._weight_allocations if id(data) in self._unmapped)

    def _recall(self) -> None:
        """Before mapping lent memory back: the per-process cap as it was before the loan."""
        recall_unmapped(self._loan[0])
        self._loan[0] = None

    def _lend(self) -> None:
        """Under a per-process cap, let torch allocate what is unmapped now: the KV cache while released and the
        weight allocations unmapped with it (the one place the loan is computed)."""
        recall_unmapped(self._loan[0])
        unmapped = (self.kv_bytes if self.released else 0) + self._unmapped_bytes()
        self._loan[0] = lend_unmapped(unmapped)

    def restore(self) -> int:
        """Map the KV cache (and the weight allocations released with it) back at their addresses and reinitialise
        what lives in the KV cache; returns the bytes mapped."""

        if not self.released:
            return 0
        self._recall()
        self._allocator.wake_up(tags=["kv_cache"])
        self._map([data for data in self._weight_allocations if id(data) in self._unmapped])
        self._weights_mapped = True
        vllm_api().after_kv_wake_up(driver_worker(self._llm).model_runner)
        self._llm.reset_prefix_cache()
        self.released = False
        return self.bytes
