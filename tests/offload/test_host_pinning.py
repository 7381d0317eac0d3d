"""Page-locked host memory by registration (`trl_turbo.offload.host_pinning`) and the pool's use of it: a request's
new chunks are views of one allocation; a failed registration falls back to torch's pinned allocator; on CUDA the
chunks are pinned, copies through them round-trip, and the range is unregistered once the last view is gone."""

from __future__ import annotations

import gc
import types

import pytest
import torch

from trl_turbo.offload import host_pinning, pinned_pool
from trl_turbo.offload.pinned_pool import PinnedPool


def test_a_requests_new_chunks_are_views_of_one_registered_allocation(monkeypatch):
    slabs = []

    def registered(nbytes):
        slabs.append(torch.zeros(nbytes, dtype=torch.uint8))
        return slabs[-1]

    monkeypatch.setattr(pinned_pool, "registered_bytes", registered)
    pool = PinnedPool(budget_bytes=1 << 20, chunk_bytes=1 << 10, pin=True)
    blocks = pool.acquire(3000)  # 3 chunks, one allocation of 3 KiB
    assert [s.numel() for s in slabs] == [3 << 10]
    base = slabs[0].data_ptr()
    assert [c.tensor.data_ptr() - base for c in blocks.chunks] == [0, 1 << 10, 2 << 10]
    data = torch.arange(750, dtype=torch.int32).view(torch.uint8)
    blocks.store(data, non_blocking=False)
    out = torch.empty_like(data)
    blocks.load(out, non_blocking=False)
    assert torch.equal(out, data)
    pool.release(blocks)
    assert pool.acquire(2000) is not None and len(slabs) == 1  # served from the free chunks


def test_a_failed_registration_falls_back_to_torchs_pinned_allocator(monkeypatch):
    real_empty = torch.empty
    pinned = []

    def empty(*args, pin_memory=False, **kwargs):
        if pin_memory:
            pinned.append(1)
        return real_empty(*args, **kwargs)  # stands for pinned memory on this CPU-only test

    monkeypatch.setattr(pinned_pool, "registered_bytes", lambda nbytes: None)
    monkeypatch.setattr(pinned_pool.torch, "empty", empty)
    pool = PinnedPool(budget_bytes=1 << 20, chunk_bytes=1 << 10, pin=True)
    assert len(pool.acquire(3000).chunks) == 3 and len(pinned) == 3
    assert pool.allocated_bytes == 3 << 10


def test_without_cuda_nothing_is_registered(monkeypatch):
    monkeypatch.setattr(host_pinning.torch.cuda, "is_available", lambda: False)
    assert host_pinning.registered_bytes(4096) is None


def test_a_refused_mapping_is_a_pinning_failure_and_the_free_chunks_stay(monkeypatch):
    def refuse(*args, **kwargs):
        raise OSError(12, "Cannot allocate memory")

    monkeypatch.setattr(host_pinning.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(host_pinning.torch.cuda, "cudart", lambda: types.SimpleNamespace(cudaHostRegister=None))
    assert host_pinning.registered_bytes(4096) is None  # runtime bindings without it
    monkeypatch.setattr(host_pinning.torch.cuda, "cudart",
                        lambda: types.SimpleNamespace(cudaHostRegister=lambda *args: 0))
    monkeypatch.setattr(host_pinning.mmap, "mmap", refuse)
    assert host_pinning.registered_bytes(4096) is None
    pool = PinnedPool(budget_bytes=1 << 20, chunk_bytes=1 << 10, pin=False)
    pool.release(pool.acquire(2048))
    monkeypatch.setattr(pool, "_allocate", lambda count: (_ for _ in ()).throw(RuntimeError("no memory")))
    with pytest.raises(RuntimeError):
        pool.acquire(4096)  # 2 free chunks and 2 new ones, whose allocation fails
    assert pool.free_bytes == 2048 and pool.allocated_bytes == 2048


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_registered_chunks_are_pinned_round_trip_and_are_unregistered_when_dropped(monkeypatch):
    unregistered = []
    real_unregister = host_pinning._unregister

    def unregister(pointer, device):
        unregistered.append(pointer)
        real_unregister(pointer, device)

    monkeypatch.setattr(host_pinning, "_unregister", unregister)
    pool = PinnedPool(budget_bytes=1 << 30, chunk_bytes=4 << 20, pin=True)
    data = torch.randint(0, 256, (10 << 20,), dtype=torch.uint8, device="cuda")
    blocks = pool.acquire(data.numel())
    assert all(chunk.tensor.is_pinned() for chunk in blocks.chunks)
    pointer = blocks.chunks[0].tensor.data_ptr()
    blocks.store(data, non_blocking=True)
    out = torch.empty_like(data)
    torch.cuda.synchronize()
    blocks.load(out, non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(out, data)
    pool.release(blocks)
    del blocks
    pool.close()
    gc.collect()
    assert unregistered == [pointer]
    assert pool.allocated_bytes == 0


def test_clearing_the_runtimes_error_never_raises(monkeypatch):
    monkeypatch.setattr(host_pinning.torch.version, "cuda", "99.0")  # no such runtime loaded or installed
    host_pinning._clear_cuda_error()
