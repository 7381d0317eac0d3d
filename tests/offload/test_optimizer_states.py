"""The optimizer's states on the host between steps (`offload.optimizer_states`): the same parameters bit for bit,
chunk by chunk, with LR schedulers, `state_dict`/`load_state_dict`, closures and removal; through GRPOTrainer, a full
fine-tuning that saves and resumes with the states offloaded follows the run that never offloads; the config checks
refuse what cannot work. CPU (the host buffers are then not pinned)."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

from trl_turbo.offload.optimizer_states import OptimizerStateOffload, install, installed


def _model_and_optimizer(seed: int = 0, **adam):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 16), torch.nn.Linear(16, 4))
    params = list(model.parameters())
    optimizer = torch.optim.AdamW([{"params": params[:2]}, {"params": params[2:], "weight_decay": 0.1, "lr": 3e-3}],
                                  lr=1e-2, **adam)
    return model, optimizer


def _train(model, optimizer, scheduler, steps: int, seed: int = 1, closure: bool = False) -> None:
    generator = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(5, 8, generator=generator)

        def loss_fn():
            optimizer.zero_grad()
            loss = model(x).square().mean()
            loss.backward()
            return loss

        if closure:
            optimizer.step(loss_fn)
        else:
            loss_fn()
            optimizer.step()
        scheduler.step()


def _moving_states(optimizer):
    return [v for state in optimizer.state.values() for v in state.values() if v.numel() > 1]


@pytest.mark.parametrize("adam", [{}, {"foreach": False}, {"fused": True}], ids=["default", "for-loop", "fused"])
def test_offloaded_states_step_to_the_same_parameters_bit_for_bit(adam):
    reference, reference_optimizer = _model_and_optimizer(**adam)
    model, optimizer = _model_and_optimizer(**adam)
    reference_scheduler = torch.optim.lr_scheduler.LambdaLR(reference_optimizer, lambda s: 1 / (s + 1))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1 / (s + 1))
    # several chunks of the ~3.9 KiB of states; every state moves, into 64-byte host chunks
    offload = OptimizerStateOffload(optimizer, chunk_bytes=600, pin=False, min_state_bytes=0, host_chunk_bytes=64)
    calls = []
    inner = offload._step

    def counting_step(*args):
        calls.append(sum(s.untyped_storage().nbytes() for s in _moving_states(optimizer)))
        return inner(*args)

    offload._step = counting_step
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the LR scheduler still sees the optimizer's steps counted
        _train(reference, reference_optimizer, reference_scheduler, 4)
        _train(model, optimizer, scheduler, 4)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), reference.parameters(), strict=True))
    assert len(calls) >= 4 * 3  # each step in several chunks
    # at each chunk's call its own states and the next chunk's (already on its way) are on the device, no others:
    # never all 3872 bytes of them
    total = 2 * 4 * sum(p.numel() for p in model.parameters())
    chunks = [2 * 4 * sum(p.numel() for params in chunk for p in params)
              for chunk in offload._chunks([group["params"] for group in optimizer.param_groups])]
    assert len(chunks) >= 3 and sum(chunks) == total == 3872
    expected = [here + following for here, following in zip(chunks, [*chunks[1:], 0])]
    assert calls[-len(chunks):] == expected and max(expected) < total
    states = _moving_states(optimizer)
    assert len(states) == 12 and all(s.untyped_storage().nbytes() == 0 for s in states)  # all on the host
    # in whole 64-byte host chunks (the 4-element bias's moments take one each)
    assert offload.host_bytes == sum(2 * -(-p.numel() * 4 // 64) * 64 for p in model.parameters()) == 3968
    assert all(s["step"].numel() == 1 for s in optimizer.state.values())  # step counters stay
    # the saved state is the reference's; loading it back and stepping on keeps following the reference
    saved, expected = optimizer.state_dict(), reference_optimizer.state_dict()
    for key, state in expected["state"].items():
        assert all(torch.equal(saved["state"][key][name], value) for name, value in state.items())
    fresh_model, fresh = _model_and_optimizer(**adam)
    fresh_model.load_state_dict(model.state_dict())
    fresh_scheduler = torch.optim.lr_scheduler.LambdaLR(fresh, lambda s: 1 / (s + 1))
    fresh_offload = OptimizerStateOffload(fresh, chunk_bytes=600, pin=False, min_state_bytes=0, host_chunk_bytes=64)
    fresh.load_state_dict(copy.deepcopy(saved))
    fresh_scheduler.load_state_dict(scheduler.state_dict())
    _train(fresh_model, fresh, fresh_scheduler, 2, seed=2)
    _train(reference, reference_optimizer, reference_scheduler, 2, seed=2)
    assert all(torch.equal(a, b) for a, b in zip(fresh_model.parameters(), reference.parameters(), strict=True))
    assert fresh_offload.host_bytes == offload.host_bytes
    assert all(s.untyped_storage().nbytes() == 0 for s in _moving_states(fresh))


@pytest.mark.parametrize(("share", "moving"), [(0.25, 1), (0.85, 4)])
def test_a_share_moves_the_first_parameters_states_and_steps_alike(share, moving):
    """With a share, the states of the first parameters the step walks, up to that share of the parameters' bytes,
    go to the host; the rest stay on the device, untouched by the copies; the parameters still follow the optimizer
    that never offloads, bit for bit, through a save and a load."""
    reference, reference_optimizer = _model_and_optimizer()
    model, optimizer = _model_and_optimizer()
    offload = OptimizerStateOffload(optimizer, chunk_bytes=600, pin=False, min_state_bytes=0, host_chunk_bytes=64,
                                    share=share)
    constant = [torch.optim.lr_scheduler.LambdaLR(o, lambda s: 1) for o in (reference_optimizer, optimizer)]
    _train(reference, reference_optimizer, constant[0], 3)
    _train(model, optimizer, constant[1], 3)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), reference.parameters(), strict=True))
    params = list(model.parameters())  # 128, 16, 256, 16, 64, 4 elements: 484
    total = sum(p.numel() for p in params)
    on_host = [all(s.untyped_storage().nbytes() == 0 for name, s in optimizer.state[p].items() if s.numel() > 1)
               for p in params]
    on_device = [all(s.untyped_storage().nbytes() == s.numel() * 4 for name, s in optimizer.state[p].items()
                     if s.numel() > 1) for p in params]
    moved = sum(on_host)
    assert on_host == [True] * moved + [False] * (len(params) - moved) and on_device == [not h for h in on_host]
    # the fewest leading parameters that reach the share of the bytes
    assert sum(p.numel() for p in params[:moved]) >= share * total > sum(p.numel() for p in params[:moved - 1])
    assert moved == moving
    assert offload.host_bytes == sum(2 * -(-p.numel() * 4 // 64) * 64 for p in params[:moved])
    saved = optimizer.state_dict()
    for key, state in reference_optimizer.state_dict()["state"].items():
        assert all(torch.equal(saved["state"][key][name], value) for name, value in state.items())
    fresh_model, fresh = _model_and_optimizer()
    fresh_model.load_state_dict(model.state_dict())
    OptimizerStateOffload(fresh, chunk_bytes=600, pin=False, min_state_bytes=0, host_chunk_bytes=64, share=share)
    fresh.load_state_dict(copy.deepcopy(saved))
    loaded_away = [all(s.untyped_storage().nbytes() == 0 for s in fresh.state[p].values() if s.numel() > 1)
                   for p in fresh_model.parameters()]
    assert loaded_away == on_host  # loaded states go where the share puts them
    fresh_constant = torch.optim.lr_scheduler.LambdaLR(fresh, lambda s: 1)
    _train(fresh_model, fresh, fresh_constant, 2, seed=2)
    _train(reference, reference_optimizer, constant[0], 2, seed=2)
    assert all(torch.equal(a, b) for a, b in zip(fresh_model.parameters(), reference.parameters(), strict=True))
    with pytest.raises(ValueError, match="share must be in"):
        OptimizerStateOffload(_model_and_optimizer()[1], share=0.0)


def test_parameters_added_later_move_with_every_state_and_stay_with_a_share():
    """A parameter group added after the first step: with every state moving its states go to the host too; with a
    share they stay on the device (the share was chosen among the parameters there were). A share's choice is kept
    by position, so parameters handed to the optimizer again in their place (FSDP2's shards) keep it."""
    for share, added_away in ((1.0, True), (0.5, False)):
        model, optimizer = _model_and_optimizer()
        OptimizerStateOffload(optimizer, chunk_bytes=600, pin=False, min_state_bytes=0, host_chunk_bytes=64,
                              share=share)
        constant = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1)
        _train(model, optimizer, constant, 1)
        extra = torch.nn.Linear(8, 8)
        optimizer.add_param_group({"params": list(extra.parameters())})
        x = torch.randn(3, 8)
        optimizer.zero_grad()
        (model(x).square().mean() + extra(x).square().mean()).backward()
        optimizer.step()
        assert all((s.untyped_storage().nbytes() == 0) == added_away
                   for p in extra.parameters() for s in optimizer.state[p].values() if s.numel() > 1)
    # the first group's parameters replaced by new tensors in their place: the same positions move
    model, optimizer = _model_and_optimizer()
    OptimizerStateOffload(optimizer, pin=False, min_state_bytes=0, share=0.25)  # the first weight's states move
    first = optimizer.param_groups[0]["params"][0]
    optimizer.state_dict()  # chooses the positions before any step, as accelerate's wrapper calls it
    replacement = torch.nn.Parameter(first.detach().clone())
    optimizer.param_groups[0]["params"][0] = replacement
    replacement.grad = torch.ones_like(replacement)
    optimizer.step()
    assert all(s.untyped_storage().nbytes() == 0 for s in optimizer.state[replacement].values() if s.numel() > 1)


def test_a_saved_state_is_a_copy_and_the_live_states_stay_on_the_host():
    """`state_dict` neither brings the states back to the device nor hands out the live tensors: what it returned
    keeps its values through later steps, which still follow the optimizer that never offloads."""
    reference, reference_optimizer = _model_and_optimizer()
    model, optimizer = _model_and_optimizer()
    OptimizerStateOffload(optimizer, chunk_bytes=600, pin=False, min_state_bytes=0, host_chunk_bytes=64)
    constant = [torch.optim.lr_scheduler.LambdaLR(o, lambda s: 1) for o in (reference_optimizer, optimizer)]
    _train(reference, reference_optimizer, constant[0], 2)
    _train(model, optimizer, constant[1], 2)
    saved, expected = optimizer.state_dict(), copy.deepcopy(reference_optimizer.state_dict())
    assert all(s.untyped_storage().nbytes() == 0 for s in _moving_states(optimizer))  # still on the host
    live = list(optimizer.state.values())
    assert all(saved["state"][key] is not state for key, state in enumerate(live))  # new dicts, live ones untouched
    _train(reference, reference_optimizer, constant[0], 2, seed=3)
    _train(model, optimizer, constant[1], 2, seed=3)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), reference.parameters(), strict=True))
    for key, state in expected["state"].items():  # the moments of two steps ago, not emptied by the later steps
        assert all(torch.equal(saved["state"][key][name], state[name]) for name in ("exp_avg", "exp_avg_sq"))
    assert saved["state"][0]["step"] is live[0]["step"]  # what never moved is the live tensor, as torch returns it


def test_loaded_states_go_to_the_host_at_once_and_the_callers_tensors_are_never_emptied():
    """torch's `load_state_dict` keeps the caller's tensors where no move is needed: they are read into host storage
    when loaded, the optimizer holding empty tensors of its own, so later steps empty nothing the caller holds."""
    reference, reference_optimizer = _model_and_optimizer()
    model, optimizer = _model_and_optimizer()
    OptimizerStateOffload(optimizer, chunk_bytes=600, pin=False, min_state_bytes=0, host_chunk_bytes=64)
    _train(reference, reference_optimizer, torch.optim.lr_scheduler.LambdaLR(reference_optimizer, lambda s: 1), 2)
    model.load_state_dict(reference.state_dict())
    mine = copy.deepcopy(reference_optimizer.state_dict())
    kept = copy.deepcopy(mine)
    optimizer.load_state_dict(mine)
    assert all(s.untyped_storage().nbytes() == 0 for s in _moving_states(optimizer))  # on the host already
    assert optimizer.state_dict()["state"][0]["exp_avg"].equal(kept["state"][0]["exp_avg"])  # read back from it
    _train(reference, reference_optimizer, torch.optim.lr_scheduler.LambdaLR(reference_optimizer, lambda s: 1), 2,
           seed=4)
    _train(model, optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1), 2, seed=4)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), reference.parameters(), strict=True))
    for key, state in kept["state"].items():  # the caller's dict still holds what it loaded
        assert all(torch.equal(mine["state"][key][name], value) for name, value in state.items() if name != "step")


def test_an_optimizer_without_parameters_still_counts_its_steps():
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(3))], lr=0.1)
    optimizer.param_groups[0]["params"] = []
    OptimizerStateOffload(optimizer, pin=False)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1 / (s + 1))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "lr_scheduler.step() before optimizer.step()" if the real step never ran
        optimizer.step()
        scheduler.step()


def test_small_states_stay_on_the_device():
    model, optimizer = _model_and_optimizer()
    offload = OptimizerStateOffload(optimizer, pin=False, min_state_bytes=1024, host_chunk_bytes=1024)
    _train(model, optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1), 2)
    moved = {tuple(v.shape) for v in _moving_states(optimizer) if v.untyped_storage().nbytes() == 0}
    assert moved == {(16, 16)}  # the one 1 KiB weight's two moments; the rest is under 1 KiB
    assert offload.host_bytes == 2 * 1024


def test_a_closure_steps_once_and_removal_puts_everything_back():
    reference, reference_optimizer = _model_and_optimizer()
    model, optimizer = _model_and_optimizer()
    offload = OptimizerStateOffload(optimizer, chunk_bytes=600, pin=False, min_state_bytes=0, host_chunk_bytes=64)
    _train(reference, reference_optimizer, torch.optim.lr_scheduler.LambdaLR(reference_optimizer, lambda s: 1), 3,
           closure=True)
    _train(model, optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1), 3, closure=True)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), reference.parameters(), strict=True))
    assert installed(optimizer) is offload
    offload.close()
    assert installed(optimizer) is None and "step" not in optimizer.__dict__
    states = _moving_states(optimizer)
    assert all(torch.equal(s, r) for s, r in zip(states, _moving_states(reference_optimizer), strict=True))


def test_install_finds_the_torch_optimizer_once_and_refuses_what_the_host_cannot_hold(monkeypatch):
    from trl_turbo import host_memory

    _, optimizer = _model_and_optimizer()

    class Wrapper:  # accelerate's AcceleratedOptimizer holds the torch optimizer as `.optimizer`
        def __init__(self, inner):
            self.optimizer = inner

    offload = install(Wrapper(optimizer), torch.device("cpu"))
    assert installed(optimizer) is offload and install(optimizer, torch.device("cpu")) is offload
    offload.close()
    monkeypatch.setattr(host_memory, "available_host_bytes", lambda: 1024)
    with pytest.raises(ValueError, match=r"turbo_offload_optimizer_states=1. needs about .* Set it lower"):
        install(optimizer, torch.device("cpu"))


@pytest.mark.parametrize("share", [True, 0.5], ids=["all", "half"])
def test_a_full_fine_tuning_saves_and_resumes_with_its_states_offloaded(tmp_path, monkeypatch, share):
    """GRPOTrainer (CPU, full fine-tuning, AdamW): 3 steps with a checkpoint after the second, and a run resumed from
    it, both offloading all or half of the states, end on the parameters of a run that never offloads."""
    from trl_turbo.offload import optimizer_states
    from trl_turbo.testing import parity

    # the tiny model's states are all under the 4 MiB a real run leaves on the device
    monkeypatch.setattr(optimizer_states, "MIN_STATE_BYTES", 0)
    monkeypatch.setattr(optimizer_states, "HOST_CHUNK_BYTES", 1024)

    def trainer(output_dir, offload):
        kwargs = parity.base_config_kwargs(str(output_dir), max_steps=3, optim="adamw_torch", learning_rate=5e-3,
                                           save_strategy="steps", save_steps=2,
                                           turbo_offload_optimizer_states=offload)
        torch.manual_seed(0)
        return parity.build_trainer(kwargs)

    plain = trainer(tmp_path / "plain", False)
    plain.train()
    offloaded = trainer(tmp_path / "offloaded", share)
    offloaded.train()
    offload = installed(offloaded.optimizer)
    assert offload is not None and offload.host_bytes > 0 and offload.share == float(share)
    params = [p for p in offloaded.model.parameters() if p in offloaded.optimizer.state]
    away = [all(s.untyped_storage().nbytes() == 0 for s in offloaded.optimizer.state[p].values() if s.numel() > 1)
            for p in params]
    assert any(away) and all(away) == (share is True)  # with half of them, some stayed on the device
    assert installed(plain.optimizer) is None
    # logged with the step metrics: the states' host memory, and the last optimizer step's time once there was one
    logs = [log for log in offloaded.state.log_history if "loss" in log]
    assert all(log["offload/optimizer_states_host_gib"] >= 0 for log in logs)
    assert logs[-1]["offload/optimizer_states_host_gib"] == offload.host_bytes / 2**30
    assert "offload/optimizer_step_s" in logs[-1] and "offload/optimizer_step_s" not in logs[0]
    assert not any("offload/optimizer" in key for log in plain.state.log_history for key in log)
    resumed = trainer(tmp_path / "offloaded", share)
    resumed.train(resume_from_checkpoint=str(tmp_path / "offloaded" / "checkpoint-2"))
    for run in (offloaded, resumed):
        assert all(torch.equal(a, b) for a, b in zip(run.model.parameters(), plain.model.parameters(), strict=True))


def test_the_config_refuses_deepspeed_and_fsdp_parameter_offload(monkeypatch):
    import types

    from trl_turbo import checks, distributed
    from trl_turbo.config import Settings

    args = types.SimpleNamespace(turbo_offload_optimizer_states=True, world_size=2, deepspeed=None,
                                 deepspeed_plugin=None, fsdp=None, fsdp_config=None)
    for name in ("ACCELERATE_USE_DEEPSPEED", "ACCELERATE_USE_FSDP", "FSDP_VERSION", "ACCELERATE_DEEPSPEED_ZERO_STAGE"):
        monkeypatch.delenv(name, raising=False)
    checks._check_optimizer_states(args, Settings.of(args))  # DDP: fine
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_ZERO_STAGE", "2")
    with pytest.raises(ValueError, match="DeepSpeed steps its own.*offload_optimizer"):
        checks._check_optimizer_states(args, Settings.of(args))
    monkeypatch.delenv("ACCELERATE_USE_DEEPSPEED")
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    monkeypatch.setenv("FSDP_VERSION", "2")
    monkeypatch.setattr(checks, "fsdp_offloads_params", lambda: True)
    with pytest.raises(ValueError, match="fsdp_offload_params: true"):
        checks._check_optimizer_states(args, Settings.of(args))
    monkeypatch.setattr(checks, "fsdp_offloads_params", lambda: False)
    checks._check_optimizer_states(args, Settings.of(args))
    assert distributed.detect_strategy(args) is distributed.Strategy.FSDP2


FSDP2_SCRIPT = """
import json, sys, warnings
warnings.simplefilter("ignore")
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions, get_optimizer_state_dict, set_optimizer_state_dict)
from torch.distributed.fsdp import fully_shard
from trl_turbo.offload.optimizer_states import OptimizerStateOffload
from trl_turbo.testing.models import tiny_model
from trl_turbo.testing.multi_gpu import leave_finished_process

dist.init_process_group("gloo")
rank = dist.get_rank()

FULL = StateDictOptions(full_state_dict=True)

def sharded(offload, share=1.0):
    model = tiny_model("llama", vocab_size=64, hidden_size=32, layers=2, intermediate_size=64, seed=0)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    if offload:
        OptimizerStateOffload(optimizer, chunk_bytes=4096, pin=False, min_state_bytes=0, host_chunk_bytes=64,
                              share=share)
    return model, optimizer

def away(optimizer):
    return [v.to_local().untyped_storage().nbytes() == 0 for s in optimizer.state.values() for v in s.values()
            if v.numel() > 1]

def moved_away(optimizer):
    return all(away(optimizer))

def moments_of(saved):
    return [v for s in saved["state"].values() for k, v in sorted(s.items()) if k != "step"]

def run(offload, share=1.0):
    model, optimizer = sharded(offload, share)
    torch.manual_seed(1 + rank)
    for _ in range(3):
        ids = torch.randint(4, 64, (2, 12))
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    params = [p.to_local().clone() for p in model.parameters()]
    # the distributed checkpoint's whole-state gather reads the DTensor copies `state_dict` hands out
    saved = get_optimizer_state_dict(model, optimizer, options=FULL)
    return params, moments_of(saved), away(optimizer), saved

reference, reference_moments, _, _ = run(False)
params, moments, empty, saved = run(True)
empty = all(empty)
# a share: the first parameters' local shards move, the rest stay on the device; the same steps and checkpoint
half_params, half_moments, half_away, half_saved = run(True, 0.5)
model, optimizer = sharded(True, 0.5)
set_optimizer_state_dict(model, optimizer, half_saved, options=FULL)
half = (all(torch.equal(a, b) for a, b in zip(half_params, reference))
        and all(torch.equal(a, b) for a, b in zip(half_moments, reference_moments))
        and any(half_away) and not all(half_away) and away(optimizer) == half_away
        and all(torch.equal(a, b) for a, b in zip(moments_of(get_optimizer_state_dict(model, optimizer, options=FULL)),
                                                   half_moments)))
# a whole checkpoint loaded into an offloaded optimizer: its shards go to the host as they load, and read back equal
model, optimizer = sharded(True)
set_optimizer_state_dict(model, optimizer, saved, options=FULL)
loaded = moved_away(optimizer) and all(
    torch.equal(a, b) for a, b in zip(moments_of(get_optimizer_state_dict(model, optimizer, options=FULL)), moments))
report = {"equal": all(torch.equal(a, b) for a, b in zip(params, reference)), "empty": empty,
          "saved": len(moments) == len(reference_moments) > 0
                   and all(torch.equal(a, b) for a, b in zip(moments, reference_moments)), "loaded": loaded,
          "half": half}
with open(sys.argv[1] + f".{rank}", "w") as handle:
    json.dump(report, handle)
leave_finished_process()
"""


def test_fsdp2_shards_states_go_to_the_host_and_step_the_same(tmp_path):
    """Two CPU processes (gloo), FSDP2: the states are DTensors; their local shards move, the sharded parameters
    after three steps equal the run that never offloads, and so do the gathered states a checkpoint saves, while the
    live ones stay on the host; loaded back into an offloaded optimizer, they go to the host and read back equal. With
    half of them moving, the same, and the states that stay are on the device."""
    from trl_turbo.testing.multi_gpu import per_rank_reports

    for report in per_rank_reports(FSDP2_SCRIPT, tmp_path):
        assert report == {"equal": True, "empty": True, "saved": True, "loaded": True, "half": True}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize(("adam", "share"), [({}, 1.0), ({"fused": True}, 1.0), ({}, 0.5)],
                         ids=["default", "fused", "half"])
def test_overlapped_copies_on_side_streams_step_to_the_same_parameters_bit_for_bit(adam, share):
    """On CUDA the copies run on two side streams beside the update (pinned host chunks): after several steps the
    parameters and states equal a never-offloaded optimizer's, every moving state is off the device (with half of
    them moving, the first four layers'; the last four's stay), and the step time counts until the last copy."""
    torch.manual_seed(0)
    reference = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(8)]).cuda()
    model = copy.deepcopy(reference)
    reference_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-3, **adam)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, **adam)
    offload = OptimizerStateOffload(optimizer, chunk_bytes=3 << 20, pin=True, min_state_bytes=1 << 20, share=share)
    generator = torch.Generator(device="cuda").manual_seed(1)
    for _ in range(4):
        x = torch.randn(64, 1024, device="cuda", generator=generator)
        for net, opt in ((reference, reference_optimizer), (model, optimizer)):
            opt.zero_grad()
            net(x).square().mean().backward()
            opt.step()
        assert offload.take_metrics()["offload/optimizer_step_s"] > 0
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), reference.parameters(), strict=True))
    weights = [p for p in model.parameters() if p.dim() == 2]
    staying = weights[round(len(weights) * share):]
    weights = weights[:round(len(weights) * share)]
    assert all(optimizer.state[p][name].untyped_storage().nbytes() == 0 for p in weights for name in ("exp_avg",
                                                                                                     "exp_avg_sq"))
    assert all(optimizer.state[p]["exp_avg"].untyped_storage().nbytes() == p.numel() * 4 for p in staying)
    saved, expected = optimizer.state_dict(), reference_optimizer.state_dict()  # waits for the last sends
    for key, state in expected["state"].items():  # the moving states' copies are on the device, as stock's are
        assert all(torch.equal(saved["state"][key][name], value) for name, value in state.items())
    assert saved["state"][0]["exp_avg"].device.type == "cuda"
    assert all(optimizer.state[p]["exp_avg"].untyped_storage().nbytes() == 0 for p in weights)  # still away


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_overlapped_copies_keep_a_few_chunks_of_states_on_the_device():
    """The host queues a step's copies far ahead of the device; each prefetch reuses the memory of a chunk already
    sent (the host waits for that send), so a step holds a few chunks of states, never all of them."""
    model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024, bias=False) for _ in range(32)]).cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    OptimizerStateOffload(optimizer, chunk_bytes=8 << 20, pin=True, min_state_bytes=1 << 20)  # a weight a chunk
    states = 32 * 2 * 4 * 1024 * 1024  # 256 MiB of moments, 32 chunks of 8 MiB
    for _ in range(3):
        optimizer.zero_grad()
        model(torch.randn(16, 1024, device="cuda")).square().mean().backward()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        optimizer.step()
        torch.cuda.synchronize()
        held = torch.cuda.max_memory_allocated() - before
        assert held <= 6 * (8 << 20) < states, held / 2**20  # arriving, updated, leaving, and Adam's temporaries
