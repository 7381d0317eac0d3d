"""`bench train --launch`: the synthetic rollouts a launched row trains on, through TRL's own `train()` on CPU, and
the child specs it hands to e2e's launcher."""

from __future__ import annotations

import argparse
import json

import pytest
import torch

from trl_turbo.bench import e2e, set_patched, train, train_launched
from trl_turbo.bench.synthetic import synthetic_rollouts


@pytest.fixture(autouse=True)
def _restore_patch_state():
    yield
    set_patched(True)


@pytest.mark.parametrize("variant", ["stock", "turbo"])
def test_synthetic_rollouts_train_whole_steps_through_trl(tmp_path, variant):
    """TRL's generation replaced by the synthetic batch: `train()` splits it into micro-batches, the loss sees its
    completions (every token counts: no padding) and two optimizer steps run, patched or not."""
    from trl_turbo.bench import cpu_step

    set_patched(variant == "turbo")
    trainer = cpu_step.build_trainer("tiny-llama", 64, str(tmp_path), steps=2, completion_len=4)
    completion_len = 12
    trainer._generate_and_score_completions = synthetic_rollouts(5, completion_len, 64, torch.device("cpu"), 1)
    seen = []
    compute_loss = trainer.compute_loss

    def recording(model, inputs, *args, **kwargs):
        seen.append({name: tuple(value.shape) for name, value in inputs.items() if torch.is_tensor(value)})
        return compute_loss(model, inputs, *args, **kwargs)

    trainer.compute_loss = recording
    weights = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    trainer.train()
    assert trainer.state.global_step == 2 and len(seen) == 2
    assert seen[0]["completion_ids"] == (8, completion_len) and seen[0]["prompt_ids"] == (8, 5)
    losses = [log["loss"] for log in trainer.state.log_history if "loss" in log]
    assert len(losses) == 2 and all(torch.isfinite(torch.tensor(loss)) for loss in losses)
    moved = [n for n, p in trainer.model.named_parameters() if p.requires_grad and not torch.equal(p, weights[n])]
    assert moved  # the optimizer stepped on the synthetic batch's gradients


def test_synthetic_rollouts_differ_per_call_and_normalize_over_every_process():
    make = synthetic_rollouts(3, 7, 50, torch.device("cpu"), processes=4, seed=0)
    first, second = make([None] * 6), make([None] * 6)
    assert first["completion_ids"].shape == (6, 7) and not torch.equal(first["completion_ids"],
                                                                       second["completion_ids"])
    assert int(first["num_items_in_batch"]) == 6 * 7 * 4
    assert int(first["completion_ids"].max()) < 50


def _args(**overrides) -> argparse.Namespace:
    defaults = dict(shape="qwen2.5-32b", launch="fsdp2", processes=2, micro_batch=8, prompt_len=256, steps=1,
                    warmup=1, checkpoint=None, variant_timeout=60.0, quantization="none", tis=False, out="unused",
                    side_by_side=False, profile_step=False)
    return argparse.Namespace(**{**defaults, **overrides})


def test_launched_specs_are_one_micro_batch_per_gpu_without_an_engine(tmp_path):
    configs = {"stock": {}, "turbo": train.variant_config("turbo")}
    specs = train_launched.specs(_args(), [8192, 32768], ["stock", "turbo"], configs, tmp_path / "ck", str(tmp_path))
    assert [(s["variant"], s["completion_len"]) for s in specs] == [
        ("stock", 8192), ("stock", 32768), ("turbo", 8192), ("turbo", 32768)]
    spec = {**specs[2], "output_dir": str(tmp_path / "out")}
    kwargs = e2e.grpo_kwargs(spec)
    assert kwargs["use_vllm"] is False  # no engine: the child replaces TRL's generation
    assert kwargs["per_device_train_batch_size"] == 8 and kwargs["gradient_accumulation_steps"] == 1
    assert kwargs["num_generations"] == 8 and kwargs["max_steps"] == 2  # warm-up + timed
    assert spec["variant_config"]["turbo"] == {"turbo_liger_layers": False}
    assert len({s["output_dir"] for s in specs}) == 4
    assert e2e.grpo_kwargs({**spec, "rollouts": None})["use_vllm"] is True  # e2e's own rows keep vLLM


def test_launched_train_refuses_what_it_does_not_measure(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="runs on GPUs"):
        train_launched.run(_args(), [8192], ["stock"], {"stock": {}})
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(SystemExit, match="leave out --quantization and --tis"):
        train_launched.run(_args(tis=True), [8192], ["stock"], {"stock": {}})
    with pytest.raises(SystemExit, match="unknown launch"):
        train_launched.run(_args(launch="nope"), [8192], ["stock"], {"stock": {}})


@pytest.mark.parametrize("side_by_side", [False, True])
def test_launched_variants_run_one_after_the_other_or_side_by_side(tmp_path, monkeypatch, side_by_side):
    """Side by side, each variant gets GPUs of its own and runs its lengths in turn; a failed length ends its
    variant. The rows come out in variant then length order, each file rewritten after every row."""
    calls = []

    def fake_child(spec, timeout_s, devices=None):
        calls.append((spec["variant"], spec["completion_len"], devices))
        ok = not (spec["variant"] == "stock" and spec["completion_len"] == 8192)  # stock runs out at 8192
        return {"variant": spec["variant"], "ok": ok, "error": None if ok else "OOM", "peak_gib": 1.0,
                "step_s": 2.0, "launch": spec["launch"], "processes": spec["processes"]}

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "fake GPU")
    monkeypatch.setattr(e2e, "prepare_checkpoint", lambda *args, **kwargs: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(e2e, "run_child", fake_child)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    args = _args(side_by_side=side_by_side, out=str(tmp_path))
    configs = {"stock": {}, "turbo": {}}
    path = train_launched.run(args, [4096, 8192, 16384], ["stock", "turbo"], configs)
    rows = json.loads(path.read_text())["rows"]
    assert [(r["variant"], r["completion_len"], r["ok"]) for r in rows] == [
        ("stock", 4096, True), ("stock", 8192, False), ("turbo", 4096, True), ("turbo", 8192, True),
        ("turbo", 16384, True)]
    devices = {variant: {d and tuple(d) for v, _, d in calls if v == variant} for variant in configs}
    if side_by_side:
        assert devices == {"stock": {("0", "1")}, "turbo": {("2", "3")}} and rows[0]["devices"] == ["0", "1"]
    else:
        assert devices == {"stock": {None}, "turbo": {None}} and [c[0] for c in calls] == ["stock"] * 2 + ["turbo"] * 3


def test_side_by_side_needs_a_launch(monkeypatch):
    with pytest.raises(SystemExit, match="add --launch fsdp2"):
        train.run(_args(launch="1gpu", side_by_side=True, lengths="8192", variants="stock,turbo", device=None,
                        forward_token_budget=None, turbo_set=[]))


def test_a_profiled_step_runs_after_the_timed_ones_and_needs_a_launch(tmp_path):
    configs = {"turbo": train.variant_config("turbo")}
    (spec,) = train_launched.specs(_args(profile_step=True, steps=2), [8192], ["turbo"], configs, tmp_path, "out")
    assert spec["steps"] == 4 and spec["profile_step"] == 3  # one warm-up, two timed, then the profiled one
    (plain,) = train_launched.specs(_args(), [8192], ["turbo"], configs, tmp_path, "out")
    assert plain["steps"] == 2 and plain["profile_step"] is None
    with pytest.raises(SystemExit, match="--profile-step profiles a launched row"):
        train.run(_args(launch="1gpu", profile_step=True, lengths="8192", variants="stock,turbo", device=None,
                        forward_token_budget=None, turbo_set=[]))


def test_the_step_of_the_profiled_index_and_only_it_runs_under_the_profiler(monkeypatch):
    import contextlib
    import types

    from trl_turbo.bench import step_profile
    from trl_turbo.bench.step_profile import Kernel

    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    opened = []

    @contextlib.contextmanager
    def fake_profiled():
        kernels = []
        opened.append(kernels)
        yield kernels
        kernels.append(Kernel("gemm", 7, 0.0, 10.0))

    monkeypatch.setattr(step_profile, "profiled", fake_profiled)
    callbacks, steps = [], []
    trainer = types.SimpleNamespace(add_callback=callbacks.append)
    sampler = types.SimpleNamespace(phase=None, take_peaks=lambda: {"train": 2**30})
    with e2e._instrument(trainer, sampler, steps, lambda: None, profile_step=1):
        (recorder,) = callbacks
        for _ in range(3):
            recorder.on_step_begin(None, None, None)
            recorder.on_step_end(None, None, None)
    assert len(opened) == 1 and ["profile" in step for step in steps] == [False, True, False]
    assert steps[1]["profile"]["compute_busy_ms"] == pytest.approx(0.01)
