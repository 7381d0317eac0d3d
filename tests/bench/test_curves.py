"""`bench curves`' bookkeeping (job parsing, the stock noise band) and `gpu_children`, which spreads jobs over GPUs
and turns a failing or hanging child into a row that says so."""

from __future__ import annotations

import json

import pytest

from trl_turbo.bench import gpu_children
from trl_turbo.bench.curves import noise_band, parse_jobs, tail_mean


def test_parse_jobs() -> None:
    assert parse_jobs("stock:0, stock:1,turbo") == [("stock", 0), ("stock", 1), ("turbo", 0)]
    with pytest.raises(SystemExit, match="unknown variant"):
        parse_jobs("turbo-lora:0")
    with pytest.raises(SystemExit, match="twice"):
        parse_jobs("stock:0,stock")


def test_noise_band_is_the_spread_of_the_stock_seeds() -> None:
    rows = [{"ok": True, "variant": "stock", "final_accuracy": 0.4}, {"ok": True, "variant": "stock",
                                                                       "final_accuracy": 0.5},
            {"ok": True, "variant": "turbo", "final_accuracy": 0.9}, {"ok": False, "variant": "stock"}]
    assert noise_band(rows, "final_accuracy") == pytest.approx({"min": 0.4, "max": 0.5, "width": 0.1})
    assert noise_band(rows[:1], "final_accuracy") is None
    assert tail_mean([None, 1.0, 2.0, 3.0], 2) == 2.5
    assert tail_mean([None], 2) is None


CHILD = """
import json, os, sys, time
spec = json.load(open(sys.argv[1]))
if spec["name"] == "hang":
    time.sleep(60)
if spec["name"] == "crash":
    sys.exit(3)
json.dump({"ok": True, "gpu_seen": os.environ["CUDA_VISIBLE_DEVICES"], "port": os.environ["MASTER_PORT"],
           "value": spec["value"]}, open(spec["row_path"], "w"))
"""


def test_jobs_are_spread_over_gpus_and_failures_are_rows(tmp_path, monkeypatch) -> None:
    (tmp_path / "fake_child.py").write_text(CHILD)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    specs = [{"name": "a", "value": 1}, {"name": "b", "value": 2}, {"name": "crash", "value": 3},
             {"name": "hang", "value": 4}]
    rows = gpu_children.run_jobs("fake_child", specs, ["0", "1"], timeout_s=10)
    assert [row["name"] for row in rows] == ["a", "b", "crash", "hang"]
    assert {key: rows[0][key] for key in ("name", "gpu", "ok", "gpu_seen", "value")} == {
        "name": "a", "gpu": "0", "ok": True, "gpu_seen": "0", "value": 1}
    assert rows[1]["gpu_seen"] == "1" and rows[1]["value"] == 2
    assert rows[0]["port"] != rows[1]["port"]  # concurrent children: one rendezvous port each
    assert not rows[2]["ok"] and "exited with 3" in rows[2]["error"]
    assert not rows[3]["ok"] and "timed out after 10 s" in rows[3]["error"]
    json.dumps(rows)  # rows go into the results file as they are


def test_one_queue_per_gpu() -> None:
    with pytest.raises(SystemExit, match="each GPU once"):
        gpu_children.run_jobs("fake_child", [{"name": "a"}], ["0", "0"], timeout_s=10)


@pytest.mark.parametrize(("module", "variant", "patched"), [("curves", "stock", False), ("curves", "turbo", True),
                                                           ("is_gap", "stock", False), ("is_gap", "turbo-fp8", True)])
def test_a_job_runs_stock_unpatched(module, variant, patched, monkeypatch) -> None:
    """Importing the bench patches TRL (it imports trl_turbo); a stock job must switch the patches off first."""
    import importlib

    bench = importlib.import_module(f"trl_turbo.bench.{module}")
    calls = []

    class Stop(Exception):
        pass

    def record(enabled: bool) -> None:
        calls.append(enabled)
        raise Stop

    monkeypatch.setattr(bench, "set_patched", record)
    with pytest.raises(Stop):
        bench.run_job({"variant": variant})
    assert calls == [patched]


def test_the_plot_draws_every_completed_job(tmp_path) -> None:
    from trl_turbo.bench.curves import plot

    rows = [{"ok": True, "variant": variant, "seed": seed, "name": f"{variant}:{seed}",
             "log": [{"reward": 0.1 * step} for step in range(1, 6)], "accuracy": [(0, 0.3), (5, 0.5)]}
            for variant, seed in (("stock", 0), ("stock", 1), ("turbo", 0))] + [{"ok": False, "name": "turbo-fp8:0"}]
    plot(rows, "test", tmp_path / "curves.png")
    assert (tmp_path / "curves.png").stat().st_size > 0
