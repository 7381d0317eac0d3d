"""The pinned host pool (`trl_turbo.offload.pinned_pool`) under host-memory pressure, on CPU with a faked allocator:
when page-locking fails the pool goes on with pageable memory and says so once, naming its user; data still
round-trips; the budget is never exceeded."""

from __future__ import annotations

import warnings

import pytest
import torch
from helpers import randomize_adapter

from trl_turbo.offload import pinned_pool
from trl_turbo.offload.pinned_pool import PinnedPool


@pytest.fixture
def pinning_fails(monkeypatch):
    real_empty = torch.empty
    attempts = []

    def empty(*args, pin_memory=False, **kwargs):
        if pin_memory:
            attempts.append(1)
            raise RuntimeError("CUDA error: out of memory (cudaHostAlloc)")
        return real_empty(*args, **kwargs)

    monkeypatch.setattr(pinned_pool.torch, "empty", empty)
    return attempts


def test_a_failed_pin_falls_back_to_pageable_memory_with_one_warning(pinning_fails):
    pool = PinnedPool(budget_bytes=1 << 20, chunk_bytes=1 << 10, pin=True, purpose="the test's copies",
                      remedy="Do nothing.")
    data = torch.arange(3000, dtype=torch.int32).view(torch.uint8)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first = pool.acquire(data.numel())
        second = pool.acquire(data.numel())
    messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(messages) == 1 and "the test's copies" in messages[0] and "pageable" in messages[0]
    assert len(pinning_fails) > 1  # every chunk still tried pinning first
    first.store(data, non_blocking=False)
    out = torch.empty_like(data)
    first.load(out, non_blocking=False)
    assert torch.equal(out, data)
    assert second is not None and pool.allocated_bytes <= pool.budget_bytes
    assert pool.acquire(1 << 20) is None  # over budget: the caller keeps the data on the device


def test_merged_sampling_keeps_working_without_pinned_memory(pinning_fails):
    from peft import LoraConfig, get_peft_model

    from trl_turbo.testing.models import tiny_model
    from trl_turbo.vllm.merge import MergedSampling

    model = get_peft_model(tiny_model("llama", vocab_size=64, hidden_size=32, layers=1, dtype=torch.bfloat16),
                           LoraConfig(r=4, target_modules="all-linear"))
    randomize_adapter(model, seed=0)  # PEFT starts B at zero, whose merge would change nothing
    before = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    with pytest.warns(RuntimeWarning, match="merged sampling's copy of the base weights"):
        sampling = MergedSampling(model, "default", pin=True)
    with sampling.sampling():
        merged = [n for n, p in model.named_parameters() if n in before and not torch.equal(p, before[n])]
        assert merged  # the merge wrote the base weights, so the restore from the pageable copy has work to do
    for name, parameter in model.named_parameters():
        if name in before:
            assert torch.equal(parameter, before[name]), name
    sampling.close()


def test_processes_of_one_host_share_the_default_offload_budget(monkeypatch):
    from trl_turbo import host_memory

    monkeypatch.setattr(host_memory, "available_host_bytes", lambda: 100 << 30)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    alone = host_memory.offload_budget_bytes(None)
    assert alone == int(0.8 * (100 << 30))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")  # torchrun / accelerate launch: eight ranks on this host
    each = host_memory.offload_budget_bytes(None)
    assert each * 8 <= alone and each == alone // 8
    assert host_memory.offload_budget_bytes(2.5) == int(2.5 * (1 << 30))  # an explicit budget is per process


def test_the_pool_stops_growing_above_the_host_floor_with_one_warning(monkeypatch):
    chunk = 1 << 20
    available = {"bytes": 64 * chunk}
    monkeypatch.setattr(pinned_pool, "available_host_bytes", lambda: available["bytes"])
    pool = PinnedPool(budget_bytes=1 << 40, chunk_bytes=chunk, pin=False, host_floor_bytes=32 * chunk)
    first = pool.acquire(8 * chunk)
    assert first is not None and pool.allocated_bytes == 8 * chunk
    available["bytes"] = 36 * chunk  # something else took the host's memory since
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert pool.acquire(8 * chunk) is None  # 36 - 8 would leave less than the 32-chunk floor
        assert pool.acquire(2 * chunk) is not None  # 36 - 2 still leaves it
        assert pool.acquire(8 * chunk) is None
    low = [w for w in caught if "under the" in str(w.message)]
    assert len(low) == 1 and "stay on the GPU" in str(low[0].message)
    pool.release(first)
    assert pool.acquire(8 * chunk) is not None  # reusing chunks it holds needs no new host memory


def test_checkpoint_offload_keeps_the_hosts_floor(monkeypatch):
    from trl_turbo import host_memory
    from trl_turbo.offload import CheckpointOffloader

    monkeypatch.setattr(host_memory, "total_host_bytes", lambda: 200 << 30)
    offloader = CheckpointOffloader(1 << 30)
    assert offloader.pool.host_floor_bytes == int(0.05 * (200 << 30))
