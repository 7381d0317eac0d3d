"""The pinned host pool (`trl_turbo.offload.pinned_pool`) under host-memory pressure, on CPU with a faked allocator:
when page-locking fails the pool goes on with pageable memory and says so once, naming its user; data still
round-trips; the budget is never exceeded."""

from __future__ import annotations

import warnings

import pytest
import torch

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
    before = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    with pytest.warns(RuntimeWarning, match="merged sampling's copy of the base weights"):
        sampling = MergedSampling(model, "default", pin=True)
    with sampling.sampling():
        pass
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
