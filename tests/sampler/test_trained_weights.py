"""Full fine-tuning with shared weights, one process: each parameter becomes a view of its vLLM region where the
dtypes match (the optimizer then writes what vLLM samples), else it is cast there at each sync."""

from __future__ import annotations

import pytest
import torch

from trl_turbo.vllm.trained_weights import share_trained_weights
from trl_turbo.vllm.weight_views import LayoutMismatch


def _params(dtype):
    torch.manual_seed(0)
    return [("q", torch.nn.Parameter(torch.randn(4, 3, dtype=dtype))),
            ("norm", torch.nn.Parameter(torch.randn(3, dtype=dtype)))]


def test_same_dtype_parameters_become_the_engine_regions():
    params = _params(torch.float32)
    engine = torch.zeros(6, 3)  # q is rows [2, 6) of a packed tensor, as vLLM's q|k|v
    norm = torch.zeros(3)
    engine[2:].copy_(params[0][1].detach())
    norm.copy_(params[1][1].detach())
    copies = share_trained_weights(params, {"q": engine[2:], "norm": norm})
    assert copies.casts == [] and copies.shared_bytes == (12 + 3) * 4
    with torch.no_grad():
        params[0][1].add_(1.0)  # the optimizer's in-place update
    assert torch.equal(engine[2:], params[0][1].detach()) and engine[:2].eq(0).all()
    assert copies.sync() >= 0  # nothing to copy


def test_fp32_masters_are_cast_into_a_bf16_engine_at_each_sync():
    params = _params(torch.float32)
    regions = {name: param.detach().to(torch.bfloat16).clone() for name, param in params}
    copies = share_trained_weights(params, regions)
    assert len(copies.casts) == 2 and copies.shared_bytes == 0 and copies.cast_bytes == (12 + 3) * 2
    with torch.no_grad():
        for _, param in params:
            param.mul_(3.0)
    copies.sync()
    for name, param in params:
        assert torch.equal(regions[name], param.detach().to(torch.bfloat16))


def test_the_training_device_without_an_index_is_the_current_one(monkeypatch):
    """accelerate names a single process's device "cuda", tensors name theirs "cuda:0": the same device, so the
    parameters become views rather than copies cast at every sync."""
    from trl_turbo.device_memory import indexed

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    assert indexed("cuda") == torch.device("cuda", 1) and indexed(torch.device("cuda", 0)) == torch.device("cuda", 0)
    assert indexed("cpu") == torch.device("cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_parameters_on_the_unindexed_training_device_become_views():
    params = [(name, torch.nn.Parameter(param.detach().cuda())) for name, param in _params(torch.bfloat16)]
    regions = {name: param.detach().clone() for name, param in params}
    copies = share_trained_weights(params, regions, device=torch.device("cuda"))
    assert copies.casts == [] and all(param.data_ptr() == regions[name].data_ptr() for name, param in params)


def test_a_region_that_does_not_hold_the_parameter_is_refused():
    params = _params(torch.float32)
    regions = {name: param.detach().clone() for name, param in params}
    regions["q"][0, 0] += 1
    with pytest.raises(LayoutMismatch, match="q: vLLM's region differs"):
        share_trained_weights(params, regions)
    with pytest.raises(LayoutMismatch, match="not the parameter's"):
        share_trained_weights(params, {"q": torch.zeros(3, 4), "norm": regions["norm"]})


def _train_step(model):
    ids = torch.randint(3, 20, (2, 12), generator=torch.Generator().manual_seed(0))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    model(ids, labels=ids).loss.backward()
    optimizer.step()


def test_a_full_finetuning_engine_holds_the_trained_parameters(monkeypatch):
    """Through the engine glue, on vLLM's layout (stand-in): a bf16 model's parameters become views of vLLM's
    tensors (the optimizer step lands there); fp32 masters next to a bf16 engine are cast in at each sync."""
    import copy

    from helpers import StandInVllmModel

    from trl_turbo.testing.models import tiny_model
    from trl_turbo.testing.tokenizer import VOCAB
    from trl_turbo.vllm import engine as vllm_engine

    model = tiny_model("llama", vocab_size=len(VOCAB), dtype=torch.bfloat16)
    stand_in = StandInVllmModel(model)
    monkeypatch.setattr(vllm_engine, "driver_model", lambda llm: stand_in)
    copies = vllm_engine.share_trained_parameters(object(), model)
    storages = {p.untyped_storage().data_ptr() for _, p in stand_in.named_parameters()}
    assert copies.casts == [] and all(p.untyped_storage().data_ptr() in storages for p in model.parameters())
    _train_step(model)
    qkv = stand_in.param("model.layers.0.self_attn.qkv_proj.base_layer.weight")
    q = model.model.layers[0].self_attn.q_proj.weight
    assert torch.equal(qkv[: q.shape[0]], q.detach())  # the update is vLLM's weight now

    masters = tiny_model("llama", vocab_size=len(VOCAB), dtype=torch.float32)
    stand_in = StandInVllmModel(copy.deepcopy(masters).to(torch.bfloat16))
    monkeypatch.setattr(vllm_engine, "driver_model", lambda llm: stand_in)
    copies = vllm_engine.share_trained_parameters(object(), masters)
    assert copies.shared_bytes == 0 and len(copies.casts) == len(list(masters.parameters()))
    _train_step(masters)
    copies.sync()
    qkv = stand_in.param("model.layers.0.self_attn.qkv_proj.base_layer.weight")
    q = masters.model.layers[0].self_attn.q_proj.weight
    assert torch.equal(qkv[: q.shape[0]], q.detach().to(torch.bfloat16))


class _Standby:
    """The KV standby's side of the contract: `release_also` (unmapping at once while released, which loses the
    contents), `release` (the same for every handed allocation) and `restore_weights` (mapping them back empty)."""

    def __init__(self, released: bool, grant: int = 96) -> None:
        self.released, self.grant, self.handed, self.restored, self.weight_releases = released, grant, [], 0, 0
        self.mapped_back = False

    def release_also(self, tensors):
        self.handed = list(tensors)
        if self.handed and self.released:
            self.weight_releases += 1
        return self.grant if self.handed else 0

    def release(self):
        if self.released and not self.mapped_back:  # nothing mapped since the last release
            return 0
        self.weight_releases += 1
        self.released, self.mapped_back = True, False
        return 0

    def restore_weights(self):
        self.restored += 1
        self.mapped_back = True


def test_only_copies_that_casts_rewrite_whole_are_released():
    from trl_turbo.vllm.trained_weights import fully_rewritten

    packed = torch.zeros(6, 4, dtype=torch.bfloat16)  # q | k | v rows, every row cast
    padded = torch.zeros(5, 4, dtype=torch.bfloat16)  # an embedding with a padding row no cast writes
    columns = torch.zeros(4, 4, dtype=torch.bfloat16)  # a region that is not contiguous
    source = torch.zeros(1)
    casts = [(source, packed[4:]), (source, packed[:2]), (source, packed[2:4]), (source, padded[:4]),
             (source, columns[:, :2]), (source, columns[:, 2:])]
    whole = fully_rewritten(casts)
    assert [t.untyped_storage().data_ptr() for t in whole] == [packed.untyped_storage().data_ptr()]
    gap = [(source, packed[:2]), (source, packed[3:])]  # row 2 is nobody's
    assert fully_rewritten(gap) == []


def test_released_copies_are_rewritten_before_vllm_reads_them():
    from trl_turbo.vllm.trained_weights import WeightCopies, refresh, release_with_kv, stale

    master = torch.nn.Parameter(torch.randn(4, 3))
    engine = master.detach().to(torch.bfloat16).clone()
    copies = WeightCopies(casts=[(master, engine)])
    standby = _Standby(released=True)
    assert release_with_kv(copies, standby) == 96
    assert [t.data_ptr() for t in standby.handed] == [engine.data_ptr()]
    assert copies.released_bytes == 96 and stale(copies, standby)  # released at once: contents gone
    assert release_with_kv(copies, standby) == 0  # once
    engine.fill_(float("nan"))  # what an unmapped-and-remapped allocation may hold
    with torch.no_grad():
        master.mul_(2.0)
    refresh(copies, standby)
    assert standby.restored == 1 and not stale(copies, standby)
    assert torch.equal(engine, master.detach().to(torch.bfloat16))
    standby.release()  # however the standby is released (a generation, or a check outside one), they are stale
    assert stale(copies, standby)


def test_nothing_is_released_without_standby_or_casts():
    from trl_turbo.vllm.trained_weights import WeightCopies, refresh, release_with_kv, stale

    assert release_with_kv(WeightCopies(), _Standby(released=True)) == 0
    master = torch.nn.Parameter(torch.randn(2, 2))
    copies = WeightCopies(casts=[(master, torch.zeros(2, 2, dtype=torch.bfloat16))])
    assert release_with_kv(copies, None) == 0 and not stale(copies, None)
    standby = _Standby(released=False)
    assert release_with_kv(copies, standby) == 96 and not stale(copies, standby)  # mapped until the next release
    refresh(copies, None)
    assert standby.restored == 0


def test_a_generation_refreshes_copies_released_since_the_last_sync(monkeypatch):
    """TRL syncs only when the step changed; a second generation in the same step must still find the copies
    written, and they are written before the KV cache is mapped."""
    from trl_turbo.vllm import session
    from trl_turbo.vllm.engine_plan import EngineState
    from trl_turbo.vllm.trained_weights import WeightCopies

    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (1, 2))
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: None)
    order = []

    class Standby(_Standby):
        def restore_weights(self):
            order.append("restore_weights")

        def restore(self):
            order.append("restore_kv")
            self.released = False
            return 0

        def release(self):
            if not self.released or self.mapped_back:
                order.append("release")
            return super().release()

    master = torch.nn.Parameter(torch.randn(4, 3))
    engine = torch.zeros(4, 3, dtype=torch.bfloat16)
    state = EngineState()
    state.full_finetuning = True
    state.standby = Standby(released=True)
    state.standby.weight_releases = 1
    loaded = []
    norm = torch.nn.Parameter(torch.ones(3))
    state.weight_copies = WeightCopies(casts=[(master, engine)], reloads=[("norm", norm)],
                                       load=lambda tensors: loaded.extend(name for name, _ in tensors),
                                       released_bytes=96, written_at=0)
    llm = object()
    for _ in range(2):  # two generations without a sync between them: each finds its copies written
        engine.zero_()
        with session.generating(llm, state, torch.device("cpu")):
            order.append("generate")
            assert torch.equal(engine, master.detach().to(torch.bfloat16))
    assert order == ["restore_weights", "restore_kv", "generate", "release"] * 2
    split = {key: state.metrics[key] for key in ("vllm/weight_map_s", "vllm/weight_cast_s", "vllm/weight_reload_s")}
    assert all(seconds >= 0 for seconds in split.values())
    assert state.metrics["vllm/weight_copy_s"] == pytest.approx(sum(split.values()), abs=1e-3)
    # a rank decides that refresh alone: the reloads (collective under FSDP2, and never released) are left to syncs
    assert loaded == []
    order.clear()
    session.sync_trained_weights(state)  # a step's sync writes them, so the generation after it does not again
    assert loaded == ["norm"]
    with session.generating(llm, state, torch.device("cpu")):
        order.append("generate")
    assert order == ["restore_weights", "restore_kv", "generate", "release"]


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("released", [True, False])
def test_a_full_finetuning_sync_resets_the_prefix_cache_once(monkeypatch, released, fp8):
    """The sync writes the trained parameters without TRL's push, and drops blocks cached with the old weights: itself
    when the KV cache is mapped, and through the standby's restore (which resets it) when it is released. With fp8
    sampling too (its copy is written at the generation; the 16-bit copies still at the sync)."""
    import types

    from trl_turbo.patches import trl_vllm
    from trl_turbo.vllm.engine_plan import EngineState
    from trl_turbo.vllm.trained_weights import WeightCopies

    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    master = torch.nn.Parameter(torch.randn(4, 3))
    engine = torch.zeros(4, 3, dtype=torch.bfloat16)
    state = EngineState()
    state.full_finetuning = True
    state.standby = _Standby(released=released)
    state.weight_copies = WeightCopies(casts=[(master, engine)])
    state.fp8 = object() if fp8 else None
    resets = []
    generation = types.SimpleNamespace(_trl_turbo_engine=state, llm=types.SimpleNamespace(
        reset_prefix_cache=lambda: resets.append(1)))
    sync = trl_vllm._wrap_sync_weights(lambda self: pytest.fail("TRL's full-weight push must not run"))
    assert sync(generation) is None
    assert torch.equal(engine, master.detach().to(torch.bfloat16))
    assert len(resets) == (0 if released else 1)
    assert state.metrics["vllm/weight_sync_s"] >= 0
