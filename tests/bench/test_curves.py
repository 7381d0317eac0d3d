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
import json, os, subprocess, sys, time
from trl_turbo.bench.gpu_children import save_row
spec = json.load(open(sys.argv[1]))
if spec["name"] == "hang":
    save_row(spec, {"ok": True, "steps": 1, "deadline_ahead": spec["deadline"] > time.time()})
    grandchild = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    with open(spec["pid_file"], "w") as handle:
        handle.write(str(grandchild.pid))
    time.sleep(60)
if spec["name"] == "crash":
    sys.exit(3)
save_row(spec, {"ok": True, "gpu_seen": os.environ["CUDA_VISIBLE_DEVICES"], "port": os.environ["MASTER_PORT"],
                "value": spec["value"]})
"""


def test_jobs_are_spread_over_gpus_and_failures_are_rows(tmp_path, monkeypatch) -> None:
    import os
    import time

    (tmp_path / "fake_child.py").write_text(CHILD)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,6")  # --gpus index the GPUs the driver sees
    monkeypatch.setattr(gpu_children, "STOP_MARGIN_S", 5.0)
    specs = [{"name": "a", "value": 1}, {"name": "b", "value": 2}, {"name": "crash", "value": 3},
             {"name": "hang", "value": 4, "pid_file": str(tmp_path / "grandchild.pid")}]
    rows = gpu_children.run_jobs("fake_child", specs, ["0", "1"], timeout_s=15)
    assert [row["name"] for row in rows] == ["a", "b", "crash", "hang"]
    assert {key: rows[0][key] for key in ("name", "gpu", "ok", "finished", "gpu_seen", "value")} == {
        "name": "a", "gpu": "4", "ok": True, "finished": True, "gpu_seen": "4", "value": 1}
    assert rows[1]["gpu_seen"] == "6" and rows[1]["value"] == 2
    assert rows[0]["port"] != rows[1]["port"]  # concurrent children: one rendezvous port each
    assert not rows[2]["ok"] and "exited with 3" in rows[2]["error"]
    # the hanging job keeps the row it saved, says it was stopped, and its process group is gone
    hang = rows[3]
    assert hang["ok"] and not hang["finished"] and hang["steps"] == 1 and hang["deadline_ahead"]
    assert "timed out after 15 s" in hang["error"]
    json.dumps(rows)  # rows go into the results file as they are
    time.sleep(0.5)
    assert not _running(int((tmp_path / "grandchild.pid").read_text()))  # what the child started went with it


def _running(pid: int) -> bool:
    """Whether process `pid` exists and is not a zombie waiting to be reaped."""
    from pathlib import Path

    status = Path(f"/proc/{pid}/status")
    if not status.exists():
        return False
    state = next((line for line in status.read_text().splitlines() if line.startswith("State:")), "")
    return "zombie" not in state and "Z" not in state.split()[1:2]


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
