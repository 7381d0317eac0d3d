"""CPU tests of `bench soak`: the flatness verdict on synthetic traces (flat ones pass; each kind of leak or slowdown
trips its own check), the per-step recorder on a real tiny trainer, and the result file's x axis."""

from __future__ import annotations

import json

import pytest

import trl_turbo  # noqa: F401  (turbo_* fields)
from trl_turbo.bench import results, soak
from trl_turbo.testing import parity

MIB = 2**20


def flat_trace(steps: int = 200) -> list[dict]:
    """Warm-up growth in the first steps, then flat within noise; completion-length-like pool steps twice."""
    trace = []
    for step in range(1, steps + 1):
        warm = min(step, 10)
        trace.append({"step": step, "step_s": 0.5 + 0.01 * (step % 3), "device_allocated": (100 + warm) * MIB,
                      "device_used": (2000 + 10 * warm + step % 7) * MIB, "host_rss": (900 + 5 * warm) * MIB + step % 5,
                      "offload_pool": (64 if step < 60 else 96 if step < 150 else 128) * MIB})
    return trace


def test_flat_trace_is_flat():
    verdict = soak.flatness(flat_trace())
    assert verdict["flat"], verdict["checks"]
    assert set(verdict["checks"]) == {"device_allocated_range", "device_used_range", "host_rss_growth",
                                      "host_rss_slope", "pool_growth_steps", "step_time_drift"}


@pytest.mark.parametrize("leak, check", [
    (lambda row: row.update(device_allocated=row["device_allocated"] + row["step"] * MIB // 4),
     "device_allocated_range"),
    (lambda row: row.update(device_used=row["device_used"] + row["step"] * 2 * MIB), "device_used_range"),
    (lambda row: row.update(host_rss=row["host_rss"] + row["step"] * MIB), "host_rss_slope"),
    (lambda row: row.update(offload_pool=row["offload_pool"] + row["step"] * MIB), "pool_growth_steps"),
    (lambda row: row.update(step_s=row["step_s"] * (1 + row["step"] / 200)), "step_time_drift"),
])
def test_each_leak_trips_its_check(leak, check):
    trace = flat_trace()
    for row in trace:
        leak(row)
    verdict = soak.flatness(trace)
    assert not verdict["flat"]
    assert not verdict["checks"][check]["ok"], verdict["checks"][check]


def test_rss_jump_after_warmup_trips_growth_but_warmup_does_not():
    trace = flat_trace()
    for row in trace[:20]:
        row["host_rss"] -= 500 * MIB  # warm-up growth is left out
    assert soak.flatness(trace)["flat"]
    for row in trace[150:]:
        row["host_rss"] += 300 * MIB
    assert not soak.flatness(trace)["checks"]["host_rss_growth"]["ok"]


def test_too_short_a_soak_is_refused():
    with pytest.raises(ValueError, match="needs more than"):
        soak.flatness(flat_trace(steps=soak.FLATNESS_BOUNDS.warmup))


def test_recorder_samples_every_step_of_a_real_trainer(tmp_path):
    config = parity.base_config_kwargs(str(tmp_path), max_steps=3, gradient_checkpointing=True,
                                       turbo_memory_plan="min")
    trainer = parity.build_trainer(config, peft=True)
    trace = soak.record_steps(trainer)
    assert [row["step"] for row in trace] == [1, 2, 3]
    assert all(row["step_s"] > 0 and row["host_rss"] > 0 and row["reward"] is not None and row["loss"] is not None
               for row in trace)
    assert all("device_used" not in row for row in trace)  # no CUDA: no device series, and the verdict skips them
    assert all(row["generation_s"] is None for row in trace)  # no vLLM engine: no generation metric to split by
    assert set(soak.step_time_trend(trace, warmup=0)) == {"step_s"}


def test_step_time_trend_places_a_slowdown_in_the_part_that_grows():
    trace = flat_trace()
    for row in trace:  # generation grows by 0.1 s every 100 steps, faster late (not symmetric: mean != median);
        late = max(0, row["step"] - 150) ** 2 / 1000  # the rest of the step stays at 0.2 s
        row["generation_s"] = 0.3 + 0.001 * row["step"] + late
        row["step_s"] = row["generation_s"] + 0.2
    after = trace[soak.FLATNESS_BOUNDS.warmup:]
    steps = [row["step"] for row in after]
    expected = 100 * _least_squares_slope(steps, [row["generation_s"] for row in after])
    mean_step = sum(row["step_s"] for row in after) / len(after)
    trend = soak.step_time_trend(trace)
    assert trend["generation_s"]["slope_s_per_100_steps"] == pytest.approx(expected)
    assert trend["step_s"]["slope_s_per_100_steps"] == pytest.approx(expected)
    assert trend["step_s"]["relative_slope_per_100_steps"] == pytest.approx(expected / mean_step)
    assert trend["step_s"]["mean_s"] == pytest.approx(mean_step)
    assert trend["rest_s"] == {"mean_s": pytest.approx(0.2), "slope_s_per_100_steps": pytest.approx(0.0, abs=1e-9),
                               "relative_slope_per_100_steps": pytest.approx(0.0, abs=1e-8)}


def _least_squares_slope(xs: list[float], ys: list[float]) -> float:
    mean_x, mean_y = sum(xs) / len(xs), sum(ys) / len(ys)
    return (sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys))
            / sum((x - mean_x) ** 2 for x in xs))


def test_step_time_trend_splits_only_where_every_step_has_its_generation_time():
    trace = flat_trace()
    for row in trace[::2]:  # fitting the steps that have it by list position would halve the step spacing
        row["generation_s"] = 0.3
    assert set(soak.step_time_trend(trace)) == {"step_s"}


def test_soak_rows_plot_against_the_step(tmp_path):
    rows = [{**row, "variant": "turbo", "ok": True, "host_rss_gib": row["host_rss"] / 2**30} for row in flat_trace(30)]
    meta = {"benchmark": "soak", "gpu": "cpu", "config": {}}
    path = results.write(meta, rows, "tiny-llama", tmp_path, series=lambda row: row["variant"],
                         panels=[("host_rss_gib", "host RSS")], x=("step", "step"))
    assert json.loads(path.read_text())["rows"][0]["step"] == 1
    assert path.with_suffix(".png").stat().st_size > 0


def test_a_launched_soak_is_flat_only_when_every_rank_is():
    leaking = flat_trace()
    for row in leaking:
        row["device_used"] += row["step"] * 2 * MIB
    verdict = soak.verdicts([flat_trace(), leaking])
    assert not verdict["flat"] and len(verdict["ranks"]) == 2
    assert verdict["ranks"][0]["flatness"]["flat"] and not verdict["ranks"][1]["flatness"]["flat"]
    assert soak.verdicts([flat_trace(), flat_trace()])["flat"]
    assert set(verdict["ranks"][1]) == {"flatness", "step_time_trend"}


def test_a_launched_soak_refuses_what_cannot_run(monkeypatch):
    import argparse

    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    args = dict(steps=200, completion_len=128, launch="1gpu", processes=2, vllm_tp=2, out="unused")
    with pytest.raises(SystemExit, match="add --launch fsdp2"):
        soak.run(argparse.Namespace(**args))
    with pytest.raises(SystemExit, match="must divide --processes 3"):
        soak.run(argparse.Namespace(**{**args, "launch": "fsdp2", "processes": 3}))
    with pytest.raises(SystemExit, match="unknown launch"):
        soak.run(argparse.Namespace(**{**args, "launch": "nope"}))
