"""One child process per benchmark job, spread over the GPUs given: one queue per GPU, the queues run side by side.

Design decision: the real-model benchmarks run many short, one-GPU trainings (a variant and a seed each) whose
vLLM engines live as long as their process, so each job is its own process pinned to one GPU with
``CUDA_VISIBLE_DEVICES``; the jobs of one GPU run one after the other (two colocated engines profiling memory on one
device at once misread each other's allocations, and vLLM asserts), and the GPUs run in parallel, each child with a
rendezvous port of its own (TRL's colocated engine opens a process group on ``MASTER_PORT``, the same default in every
child). A job that fails or runs past its time limit gives a row saying so; the others go on.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

from ..testing.multi_gpu import fresh_rendezvous_env


def run_jobs(module: str, specs: list[dict[str, Any]], gpus: list[str], timeout_s: float) -> list[dict[str, Any]]:
    """Run ``python -m <module> <spec.json>`` for each spec (job ``i`` on ``gpus[i % len(gpus)]``) and return their
    rows in the order of ``specs``. The child writes its row as JSON to ``spec["row_path"]``."""
    if len(set(gpus)) != len(gpus) or not gpus:
        raise SystemExit(f"--gpus names each GPU once (the jobs of one GPU run one after the other), got {gpus}")
    rows: list[dict[str, Any] | None] = [None] * len(specs)
    with tempfile.TemporaryDirectory() as scratch:
        def queue(gpu: str, indices: list[int]) -> None:
            for index in indices:
                rows[index] = _run_one(module, specs[index], gpu, Path(scratch) / f"job{index}", timeout_s)
                print(f"[{specs[index].get('name', index)} on GPU {gpu}] "
                      f"{'ok' if rows[index].get('ok') else rows[index].get('error')}", flush=True)

        threads = [threading.Thread(target=queue, args=(gpu, list(range(slot, len(specs), len(gpus)))))
                   for slot, gpu in enumerate(gpus)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    return [row or {"ok": False, "error": "not run"} for row in rows]


def _run_one(module: str, spec: dict[str, Any], gpu: str, scratch: Path, timeout_s: float) -> dict[str, Any]:
    scratch.mkdir(parents=True)
    row_path = scratch / "row.json"
    spec_path = scratch / "spec.json"
    spec_path.write_text(json.dumps({**spec, "row_path": str(row_path), "output_dir": str(scratch / "out")}))
    env = {**fresh_rendezvous_env(), "CUDA_VISIBLE_DEVICES": gpu, "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(free_port())}
    with open(scratch / "log.txt", "w") as log:
        try:
            process = subprocess.run([sys.executable, "-m", module, str(spec_path)], env=env, stdout=log,
                                     stderr=subprocess.STDOUT, timeout=timeout_s)
            failure = None if process.returncode == 0 else f"child exited with {process.returncode}"
        except subprocess.TimeoutExpired:
            failure = f"timed out after {timeout_s:.0f} s"
    row = json.loads(row_path.read_text()) if row_path.exists() else {"ok": False}
    if failure and not row.get("ok"):
        tail = (scratch / "log.txt").read_text()[-3000:]
        row["error"] = f"{failure}: {row.get('error') or tail}"
    return {"name": spec.get("name"), "gpu": gpu, **row}


def free_port() -> int:
    """A TCP port nothing listens on now (the OS's pick)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def write_row_and_exit(spec: dict[str, Any], row: dict[str, Any]) -> None:
    """Save the child's row and leave without interpreter teardown, where an in-process vLLM engine can hang."""
    Path(spec["row_path"]).write_text(json.dumps(row))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
