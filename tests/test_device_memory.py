"""The device-memory reading shared by the memory planner and vLLM's KV budget honours a per-process cap, and the
cap a benchmark sets leaves the driver's own share out of torch's fraction (torch.cuda faked: CPU)."""

from __future__ import annotations

import pytest
import torch

from trl_turbo import device_memory

GIB = 2**30


@pytest.fixture
def fake_cuda(monkeypatch):
    state = {"free": 100 * GIB, "total": 140 * GIB, "allocated": 10 * GIB, "reserved": 12 * GIB, "fraction": 1.0,
             "initialized": True}
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (state["free"], state["total"]))
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: state["allocated"])
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: state["reserved"])
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: state["initialized"])
    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", lambda device=None: state["fraction"])
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction",
                        lambda fraction, device=None: state.update(fraction=fraction))
    monkeypatch.setattr(torch.cuda, "init", lambda: None)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch, "zeros", lambda *args, **kwargs: None)
    return state


def test_uncapped_budget_is_driver_free_plus_torch_cache(fake_cuda):
    assert device_memory.device_budget("cuda") == (100 * GIB + 2 * GIB, 10 * GIB, 140 * GIB)


def test_a_cap_bounds_the_budget_and_the_capacity(fake_cuda):
    fake_cuda["fraction"] = 20 * GIB / (140 * GIB)  # a 20 GiB process on a 140 GiB device with 100 GiB free
    free, allocated, capacity = device_memory.device_budget("cuda")
    assert free == (20 * GIB - 12 * GIB) + 2 * GIB and allocated == 10 * GIB
    assert capacity == 20 * GIB
    # a ceiling below the cap binds instead
    assert device_memory.device_budget("cuda", ceiling_bytes=45 * GIB)[0] == (45 * GIB - 40 * GIB) + 2 * GIB


def test_before_cuda_starts_there_is_no_fraction_to_read(fake_cuda):
    fake_cuda["initialized"] = False
    fake_cuda["fraction"] = 0.01  # would raise on a machine without CUDA; not consulted
    assert device_memory.device_budget("cuda")[2] == 140 * GIB


def test_cap_leaves_the_driver_share_out_of_torch_fraction(fake_cuda):
    fake_cuda.update(free=139 * GIB, reserved=2 * 2**20, allocated=512)  # context ~1 GiB, one tiny tensor
    cap = device_memory.cap_process_memory(5 * GIB, "cuda")
    driver_share = 1 * GIB - 2 * 2**20
    lazy = device_memory.LAZY_KERNEL_BYTES
    assert cap["driver_share_gib"] == pytest.approx(driver_share / GIB) and cap["lazy_reserve_gib"] == lazy / GIB
    assert fake_cuda["fraction"] == pytest.approx((5 * GIB - driver_share - lazy) / (140 * GIB))
    # torch may then hold the cap less the context and the kernels loaded later: the driver counts at most the cap
    assert int(fake_cuda["fraction"] * 140 * GIB) + driver_share + lazy == pytest.approx(5 * GIB, abs=1)
    # another process (the benchmark's driver) holding 0.6 GiB of the device is not this process's share
    fake_cuda["free"] = 139 * GIB - int(0.6 * GIB)
    assert device_memory.cap_process_memory(5 * GIB, "cuda", others_bytes=int(0.6 * GIB))["driver_share_gib"] == \
        pytest.approx(driver_share / GIB)
    fake_cuda["free"] = 139 * GIB
    with pytest.raises(ValueError, match="leaves nothing"):
        device_memory.cap_process_memory(GIB // 2, "cuda")


def test_unmapped_memory_is_lent_to_a_cap_and_recalled_exactly(fake_cuda):
    cleared = []
    torch.cuda.empty_cache, saved = (lambda: cleared.append(True)), torch.cuda.empty_cache
    try:
        assert device_memory.lend_unmapped(4 * GIB) is None  # no cap: nothing to lend
        fake_cuda["fraction"] = 15 * GIB / (140 * GIB)
        for _ in range(500):  # every standby cycle of a long run returns to the same cap, without drift
            lent = device_memory.lend_unmapped(4 * GIB)
            assert fake_cuda["fraction"] == pytest.approx(19 * GIB / (140 * GIB))
            device_memory.recall_unmapped(lent)
        assert fake_cuda["fraction"] == 15 * GIB / (140 * GIB) and len(cleared) == 500
    finally:
        torch.cuda.empty_cache = saved


class _Allocation:
    """A CuMem allocation as vLLM records it: its tag and handle (device, size, address)."""

    def __init__(self, tag, size, address=None):
        self.tag, self.handle, self.mapped = tag, (None, size, address), True


def _fake_cumem_engine(monkeypatch, fake_cuda, allocations):
    """vLLM's CuMem allocator over `allocations` (id -> _Allocation) and an LLM around it, for `KVStandby`."""
    import sys
    import types

    class Allocator:
        pointer_to_data, allocator_and_pools = allocations, {}

        @staticmethod
        def get_instance():
            return Allocator

        @staticmethod
        def wake_up(tags):
            for data in allocations.values():
                if data.tag in tags:
                    assert fake_cuda["fraction"] == 15 * GIB / (140 * GIB), "mapped back before the cap was restored"
                    data.mapped = True

    def unmap(handle):
        next(d for d in allocations.values() if d.handle is handle).mapped = False

    def remap(handle):
        next(d for d in allocations.values() if d.handle is handle).mapped = True

    cumem = types.ModuleType("vllm.device_allocator.cumem")
    cumem.CuMemAllocator, cumem.unmap_and_release, cumem.create_and_map = Allocator, unmap, remap
    for name in ("vllm", "vllm.device_allocator"):
        monkeypatch.setitem(sys.modules, name, sys.modules.get(name) or types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "vllm.device_allocator.cumem", cumem)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    runner = types.SimpleNamespace(post_kv_cache_wake_up=lambda: None)
    worker = types.SimpleNamespace(model_runner=runner)
    return types.SimpleNamespace(reset_prefix_cache=lambda: None, llm_engine=types.SimpleNamespace(
        model_executor=types.SimpleNamespace(driver_worker=worker)))


def test_standby_lends_its_unmapped_kv_cache_to_a_capped_process(fake_cuda, monkeypatch):
    from trl_turbo.vllm import standby as standby_module

    allocations = {1: _Allocation("kv_cache", 4 * GIB), 2: _Allocation("weights", 3 * GIB)}
    llm = _fake_cumem_engine(monkeypatch, fake_cuda, allocations)
    base = fake_cuda["fraction"] = 15 * GIB / (140 * GIB)
    standby = standby_module.KVStandby(llm)
    assert standby.release() == 4 * GIB and not allocations[1].mapped and allocations[2].mapped
    assert fake_cuda["fraction"] == pytest.approx(19 * GIB / (140 * GIB))  # training may use what the KV held
    assert standby.restore() == 4 * GIB and allocations[1].mapped
    assert fake_cuda["fraction"] == base
    # weight allocations handed over while the KV cache is released (full fine-tuning's copies once FSDP2 has
    # sharded; here the 3 GiB one) go at once, and are lent too
    standby.release()
    copy = torch.empty(2)
    holding = {copy.untyped_storage().data_ptr(): [allocations[2]]}

    def holding_only(self, tensors):
        return [a for t in tensors for a in holding.get(t.untyped_storage().data_ptr(), [])]

    # patched on the class: the instance stays collectable
    monkeypatch.setattr(standby_module.KVStandby, "_allocations_holding_only", holding_only)
    assert standby.release_also([copy]) == 3 * GIB and standby.bytes == 7 * GIB
    assert fake_cuda["fraction"] == pytest.approx(22 * GIB / (140 * GIB)) and not allocations[2].mapped
    assert standby.release_also([copy]) == 0  # known already
    assert standby.weight_releases == 1  # their contents were lost once
    # mapping them back first keeps only the KV cache's bytes lent until the KV cache itself is mapped
    standby.restore_weights()
    assert fake_cuda["fraction"] == pytest.approx(19 * GIB / (140 * GIB))
    standby.restore()
    assert fake_cuda["fraction"] == base
    # an engine dropped while released gives the loan back
    standby.release()
    assert standby.weight_releases == 2
    del standby
    import gc

    gc.collect()
    assert fake_cuda["fraction"] == base


def test_released_weights_map_back_one_allocation_at_a_time(fake_cuda, monkeypatch):
    """A writer that frees memory as it goes (fp8 sampling) maps each released allocation just before writing it:
    only the allocation holding the tensor it names is mapped, and only what is still unmapped stays lent."""
    import types

    from trl_turbo.vllm import standby as standby_module

    def tensor_at(address, nbytes):  # a tensor whose storage starts at `address` of the device's address space
        storage = types.SimpleNamespace(data_ptr=lambda: address, nbytes=lambda: nbytes)
        return types.SimpleNamespace(untyped_storage=lambda: storage)

    first, second = tensor_at(1 << 40, 3 * GIB), tensor_at(2 << 40, 2 * GIB)
    allocations = {1: _Allocation("kv_cache", 4 * GIB), 2: _Allocation("weights", 3 * GIB, 1 << 40),
                   3: _Allocation("weights", 2 * GIB, 2 << 40)}
    llm = _fake_cumem_engine(monkeypatch, fake_cuda, allocations)
    monkeypatch.setattr(standby_module.KVStandby, "_allocations_holding_only", lambda self, tensors: [
        data for data in (allocations[2], allocations[3])
        if data.handle[2] in {t.untyped_storage().data_ptr() for t in tensors}])
    base = fake_cuda["fraction"] = 15 * GIB / (140 * GIB)
    standby = standby_module.KVStandby(llm, also_release=[first, second])
    assert standby.release() == 9 * GIB and not any(data.mapped for data in allocations.values())
    standby.restore_weights([first])
    assert allocations[2].mapped and not allocations[3].mapped and not allocations[1].mapped
    assert fake_cuda["fraction"] == pytest.approx(21 * GIB / (140 * GIB))  # the KV cache and `second` stay lent
    standby.restore_weights([first])  # mapped already: nothing changes
    assert fake_cuda["fraction"] == pytest.approx(21 * GIB / (140 * GIB))
    standby.restore_weights([second])
    assert allocations[3].mapped and fake_cuda["fraction"] == pytest.approx(19 * GIB / (140 * GIB))
    assert standby.restore() == 9 * GIB and allocations[1].mapped and fake_cuda["fraction"] == base
    # a write that stopped after mapping part back, before the KV cache: releasing again unmaps that part (its
    # contents are lost once more), and lends it again
    standby.release()
    releases = standby.weight_releases
    standby.restore_weights([first])
    assert standby.release() == 0 and not allocations[2].mapped and standby.weight_releases == releases + 1
    assert fake_cuda["fraction"] == pytest.approx(24 * GIB / (140 * GIB))
    assert standby.release() == 0 and standby.weight_releases == releases + 1  # nothing mapped: nothing lost
    # a weight handed over while part of the released weights is mapped back lends only what is unmapped now: the KV
    # cache, `second` and the new allocation (not the mapped `first`)
    standby.restore_weights([first])
    third = tensor_at(3 << 40, 1 * GIB)
    allocations[4] = _Allocation("weights", 1 * GIB, 3 << 40)
    monkeypatch.setattr(standby_module.KVStandby, "_allocations_holding_only", lambda self, tensors: [
        data for data in (allocations[2], allocations[3], allocations[4])
        if data.handle[2] in {t.untyped_storage().data_ptr() for t in tensors}])
    assert standby.release_also([third]) == 1 * GIB and not allocations[4].mapped and allocations[2].mapped
    assert fake_cuda["fraction"] == pytest.approx(22 * GIB / (140 * GIB))
    assert standby.restore() == 10 * GIB and fake_cuda["fraction"] == base
