"""One child process per benchmark job, spread over the GPUs given: one queue per GPU, the queues run side by side.

Design decision: the real-model benchmarks run many short, one-GPU trainings (a variant and a seed each) whose
vLLM engines live as long as their process, so each job is its own process pinned to one GPU with
``CUDA_VISIBLE_DEVICES``; the jobs of one GPU run one after the other (two colocated engines profiling memory on one
device at once misread each other's allocations, and vLLM asserts), and the GPUs run in parallel, each child with a
rendezvous port of its own (TRL's colocated engine opens a process group on ``MASTER_PORT``, the same default in every
child). A child has a deadline (wall-clock time) to stop by and saves its row as it goes (`save_row`, atomically), so
a job stopped at its time limit keeps what it measured; the driver then kills the child's whole process group. A job
that fails gives a row saying so; the others go on. `launch_command` starts any benchmark's child: plain Python on one
GPU, or `accelerate launch` with one of TRL's shipped configs.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..testing.multi_gpu import fresh_rendezvous_env

SINGLE_GPU = "1gpu"


def launch_command(launch: str, processes: int, module: str = "trl_turbo.bench.e2e") -> list[str]:
    """The command that starts a benchmark's child `module`: plain Python on one GPU, else `accelerate launch` with
    TRL's shipped accelerate config named `launch` over `processes` GPUs."""
    if launch == SINGLE_GPU:
        return [sys.executable, "-m", module]
    import trl

    config = Path(trl.__file__).parent / "accelerate_configs" / f"{launch}.yaml"
    if not config.exists():
        raise SystemExit(f"unknown launch {launch!r}: TRL ships no accelerate config {config.name}")
    return [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config), "--num_processes",
            str(processes), "--main_process_port", str(free_port()), "-m", module]

# A child stops training this long before its time limit, to evaluate and save what it has.
STOP_MARGIN_S = 45.0


def run_jobs(module: str, specs: list[dict[str, Any]], gpus: list[str], timeout_s: float) -> list[dict[str, Any]]:
    """Run ``python -m <module> <spec.json>`` for each spec (job ``i`` on ``gpus[i % len(gpus)]``, an index among the
    GPUs this process sees) and return their rows in the order of ``specs``. The child saves its row with
    :func:`save_row` to ``spec["row_path"]`` and stops by ``spec["deadline"]`` (seconds since the epoch)."""
    if len(set(gpus)) != len(gpus) or not gpus:
        raise SystemExit(f"--gpus names each GPU once (the jobs of one GPU run one after the other), got {gpus}")
    names = visible_devices(max(int(gpu) for gpu in gpus) + 1)
    rows: list[dict[str, Any] | None] = [None] * len(specs)
    with tempfile.TemporaryDirectory() as scratch:
        def queue(gpu: str, indices: list[int]) -> None:
            device = names[int(gpu)]
            for index in indices:
                try:
                    rows[index] = _run_one(module, specs[index], device, Path(scratch) / f"job{index}", timeout_s)
                except Exception as exc:  # the queue goes on with its next job
                    rows[index] = {"name": specs[index].get("name"), "ok": False, "error": repr(exc)}
                print(f"[{specs[index].get('name', index)} on GPU {gpu}] "
                      f"{'ok' if rows[index].get('ok') else rows[index].get('error')}", flush=True)

        threads = [threading.Thread(target=queue, args=(gpu, list(range(slot, len(specs), len(gpus)))))
                   for slot, gpu in enumerate(gpus)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    return [row or {"ok": False, "error": "not run"} for row in rows]


def _run_one(module: str, spec: dict[str, Any], device: str, scratch: Path, timeout_s: float) -> dict[str, Any]:
    scratch.mkdir(parents=True)
    row_path = scratch / "row.json"
    spec_path = scratch / "spec.json"
    deadline = time.time() + timeout_s - STOP_MARGIN_S
    spec_path.write_text(json.dumps({**spec, "row_path": str(row_path), "output_dir": str(scratch / "out"),
                                     "deadline": deadline}))
    env = {**fresh_rendezvous_env(), "CUDA_VISIBLE_DEVICES": device, "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(free_port())}
    with open(scratch / "log.txt", "w") as log:
        process = subprocess.Popen([sys.executable, "-m", module, str(spec_path)], env=env, stdout=log,
                                   stderr=subprocess.STDOUT, start_new_session=True)
        try:
            failure = None if process.wait(timeout=timeout_s) == 0 else f"child exited with {process.returncode}"
        except subprocess.TimeoutExpired:
            failure = f"timed out after {timeout_s:.0f} s"
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)  # the child and whatever it started (vLLM's workers)
            process.wait()
    row = json.loads(row_path.read_text()) if row_path.exists() else {"ok": False}
    row["finished"] = failure is None
    if failure:  # what the child saved before (a partial row stays ok: its measurements are valid as far as they go)
        tail = (scratch / "log.txt").read_text()[-3000:]
        row["error"] = f"{failure}: {row.get('error') or tail}"
    return {"name": spec.get("name"), "gpu": device, **row}


def visible_devices(count: int) -> list[str]:
    """The first `count` GPUs this process sees, as ``CUDA_VISIBLE_DEVICES`` names them for a child (indices when it
    is unset)."""
    named = [device.strip() for device in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if device.strip()]
    return named[:count] if named else [str(index) for index in range(count)]


def free_port() -> int:
    """A TCP port nothing listens on now (the OS's pick)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def save_row(spec: dict[str, Any], row: dict[str, Any]) -> None:
    """Write the child's row so that a reader never sees half of it (a temporary file renamed over the old row)."""
    path = Path(spec["row_path"])
    temporary = path.with_suffix(".tmp")
    temporary.write_text(json.dumps(row))
    os.replace(temporary, path)


def child_main(job: Callable[[dict[str, Any], dict[str, Any]], Any]) -> None:
    """A child's whole life: read the spec named on the command line, run `job(spec, row)`, which fills `row` as it
    measures, and save the row, with what failed if the job raised (what it had measured stays). Then leave without
    interpreter teardown, where an in-process vLLM engine can hang."""
    import traceback

    spec = json.loads(Path(sys.argv[1]).read_text())
    row: dict[str, Any] = {key: spec[key] for key in ("variant", "seed") if key in spec}
    try:
        job(spec, row)
    except Exception:  # the driver goes on with the other jobs
        row.update(ok=False, error=traceback.format_exc()[-4000:])
    save_row(spec, row)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
