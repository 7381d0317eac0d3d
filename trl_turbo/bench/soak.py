"""``python -m trl_turbo.bench soak``: hundreds of GRPO steps with every trl_turbo feature on, what could leak
recorded at every step, and a verdict on whether anything grows.

Design decision: one real GRPOTrainer in one process (leaks are per process) over a small random Llama saved locally:
colocated vLLM sharing the base weights, KV standby, merged sampling, every layer checkpointed and offloaded ("min"
memory plan), tiled MLP, sequence groups, the fused loss and TRL's truncated importance-sampling correction. A
callback samples at each step end torch's allocated and reserved device bytes, the driver's used bytes, the process's
resident host memory, torch's pinned-host allocator and the step's wall time; the offload pool's size and the step's
generation seconds (merge and restore included; each also on its own) come from the step's own metrics, so a
slowdown can be placed (`step_time_trend`). Under a launch (``--launch fsdp2 --processes N --vllm-tp T``) each rank
runs the same trainer, its FSDP2 shards shared with its tensor-parallel engine rank, and records its own trace; the
run is flat only when every rank is. The verdict (`flatness`) is a pure function of that trace with its bounds
stated in `FLATNESS_BOUNDS`, so it is tested on synthetic traces; the benchmark measures and reports it, it never
asserts.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ..host_memory import process_rss_bytes
from ..testing.multi_gpu import fresh_rendezvous_env, run_launch
from .gpu_children import SINGLE_GPU, launch_command
from .results import DEFAULT_RESULTS_DIR, GIB, metadata, write

MIB = 2**20


@dataclass(frozen=True)
class FlatnessBounds:
    """What "flat after warm-up" means here: the first `warmup` steps are left out; after them each series may move
    at most this much (ranges are max - min over the steps after warm-up)."""
    warmup: int = 20
    device_allocated_range: int = 16 * MIB  # torch's live tensors at step end
    device_used_range: int = 256 * MIB  # the driver's view: torch's cache, vLLM's pools, CUDA graphs
    host_rss_growth: int = 256 * MIB  # last step's resident memory over the first step after warm-up
    host_rss_slope: int = 128 * 1024  # bytes per step, least-squares over the steps after warm-up
    pool_growth_steps: int = 5  # steps whose pinned offload pool is larger than the step before (a leak grows it
    # step after step; a step needing more than any before it grows it once)
    step_time_drift: float = 1.10  # median of the last 100 steps over the median of the first 100 after warm-up


FLATNESS_BOUNDS = FlatnessBounds()


def _slope(values: list[float]) -> float:
    n = len(values)
    if n < 2:
        return 0.0
    mean_x, mean_y = (n - 1) / 2, sum(values) / n
    numerator = sum((i - mean_x) * (v - mean_y) for i, v in enumerate(values))
    return numerator / sum((i - mean_x) ** 2 for i in range(n))


def flatness(trace: list[dict[str, Any]], bounds: FlatnessBounds = FLATNESS_BOUNDS) -> dict[str, Any]:
    """Each series' movement after warm-up, and whether it is within `bounds` (``flat`` is all of them)."""
    after = trace[bounds.warmup:]
    if len(after) < 2:
        raise ValueError(f"a soak needs more than {bounds.warmup + 1} steps to judge, got {len(trace)}")

    def series(key: str) -> list[float]:
        return [row[key] for row in after if row.get(key) is not None]

    checks: dict[str, dict[str, Any]] = {}

    def check(name: str, value: float, bound: float) -> None:
        checks[name] = {"value": value, "bound": bound, "ok": value <= bound}

    for key, bound in (("device_allocated", bounds.device_allocated_range), ("device_used", bounds.device_used_range)):
        values = series(key)
        if values:
            check(f"{key}_range", max(values) - min(values), bound)
    rss = series("host_rss")
    check("host_rss_growth", rss[-1] - rss[0], bounds.host_rss_growth)
    check("host_rss_slope", _slope(rss), bounds.host_rss_slope)
    pool = series("offload_pool")
    if pool:
        check("pool_growth_steps", sum(later > earlier for earlier, later in zip(pool, pool[1:])),
              bounds.pool_growth_steps)
    times = series("step_s")
    window = min(100, len(times) // 2) or 1
    check("step_time_drift", statistics.median(times[-window:]) / statistics.median(times[:window]),
          bounds.step_time_drift)
    return {"flat": all(c["ok"] for c in checks.values()), "checks": checks, "bounds": asdict(bounds)}


def step_time_trend(trace: list[dict[str, Any]], warmup: int = FLATNESS_BOUNDS.warmup) -> dict[str, dict[str, float]]:
    """For the whole step (`step_s`) and, where every step after warm-up has its generation time, its two parts: the
    engine's whole generation phase (`generation_s`, trl_turbo's `vllm/generation_s`: sampling plus the merge, restore
    and KV-cache mapping around it) and the rest (`rest_s`: scoring, the old/ref log-prob passes, training). Each gets
    its mean, least-squares slope in seconds per 100 steps, and that slope as a fraction of the mean, so a slowdown
    can be placed. Reported beside the verdict, not judged: the verdict's `step_time_drift` is the stated bound."""
    after = trace[warmup:]
    parts = {"step_s": [row["step_s"] for row in after]}
    if after and all(row.get("generation_s") is not None for row in after):
        parts["generation_s"] = [row["generation_s"] for row in after]
        parts["rest_s"] = [row["step_s"] - row["generation_s"] for row in after]
    trend = {}
    for name, values in parts.items():
        if len(values) < 2:
            continue
        mean, slope = statistics.fmean(values), _slope(values) * 100
        trend[name] = {"mean_s": mean, "slope_s_per_100_steps": slope, "relative_slope_per_100_steps": slope / mean}
    return trend


def _pinned_host_bytes() -> int | None:
    import torch

    stats = getattr(torch.cuda, "host_memory_stats", None)
    if stats is None or not torch.cuda.is_available():
        return None
    return int(stats().get("allocated_bytes.current", 0))


def sample_memory() -> dict[str, Any]:
    """What could leak, now: device bytes (torch allocated and reserved, the driver's used), host RSS, pinned host."""
    import torch

    row: dict[str, Any] = {"host_rss": process_rss_bytes(), "pinned_host": _pinned_host_bytes()}
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        free, total = torch.cuda.mem_get_info()
        row.update(device_allocated=torch.cuda.memory_allocated(), device_reserved=torch.cuda.memory_reserved(),
                   device_used=total - free)
    return row


def record_steps(trainer: Any) -> list[dict[str, Any]]:
    """Train, sampling `sample_memory` and the wall time of every step; each row also takes the step's logged
    offload pool size, reward and loss."""
    from transformers import TrainerCallback

    trace: list[dict[str, Any]] = []

    class Recorder(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            self.start = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            trace.append({"step": state.global_step, "step_s": time.perf_counter() - self.start, **sample_memory()})

    trainer.add_callback(Recorder())
    trainer.train()
    logs: dict[int, dict[str, Any]] = {}
    for log in trainer.state.log_history:  # a step may log twice (the run's summary shares the last step)
        logs.setdefault(log.get("step"), {}).update(log)
    for row in trace:
        log = logs.get(row["step"], {})
        pool = log.get("offload/host_pool_gib")
        row.update(offload_pool=None if pool is None else pool * GIB, reward=log.get("reward"), loss=log.get("loss"),
                   kv_released_gib=log.get("vllm/kv_released_gib"), generation_s=log.get("vllm/generation_s"),
                   merge_s=log.get("vllm/merge_s"), restore_s=log.get("vllm/restore_s"))
    return trace


SOAK_MODEL = {"hidden_size": 1024, "layers": 8, "head_dim": 64, "num_attention_heads": 16, "num_key_value_heads": 8,
              "intermediate_size": 2816}


def build_soak_trainer(path: Path, steps: int, completion_len: int, vllm_tp: int = 1) -> Any:
    """The trainer of the soak: `SOAK_MODEL`, every feature on (see the module docstring); `vllm_tp` > 1 under FSDP2:
    each rank's shards shared with its tensor-parallel engine rank."""
    from ..testing import vllm_checks

    return vllm_checks.build_trainer(
        "llama", path, steps=steps, completion_cap=completion_len, model_shape=SOAK_MODEL,
        gradient_checkpointing=True, turbo_memory_plan="min", turbo_tiled_mlp_tokens=256,
        turbo_forward_token_budget=1024, logging_steps=1,
        **({"vllm_tensor_parallel_size": vllm_tp} if vllm_tp > 1 else {}))


def verdicts(traces: list[list[dict[str, Any]]]) -> dict[str, Any]:
    """Each rank's `flatness` and `step_time_trend`; flat only when every rank is."""
    per_rank = [{"flatness": flatness(trace), "step_time_trend": step_time_trend(trace)} for trace in traces]
    return {"flat": all(rank["flatness"]["flat"] for rank in per_rank), "ranks": per_rank}


def report_rank(label: str, verdict: dict[str, Any]) -> None:
    """Print one rank's checks against their bounds and its step-time trend, each line led by `label`."""
    for name, item in verdict["flatness"]["checks"].items():
        print(f"{label}{name}: {item['value']:.4g} (bound {item['bound']:.4g}) {'ok' if item['ok'] else 'EXCEEDED'}")
    for name, item in verdict["step_time_trend"].items():
        print(f"{label}{name}: mean {item['mean_s']:.4g} s, {item['slope_s_per_100_steps'] * 1000:+.3g} ms per 100 "
              f"steps ({item['relative_slope_per_100_steps']:+.2%})")


def run(args: argparse.Namespace) -> None:
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("bench soak needs a CUDA device and vLLM (it runs the colocated engine)")
    if args.launch == SINGLE_GPU and args.vllm_tp > 1:
        raise SystemExit("--vllm-tp > 1 shares FSDP2's shards with the engine: add --launch fsdp2")
    if args.launch != SINGLE_GPU and args.processes % args.vllm_tp:
        raise SystemExit(f"--vllm-tp {args.vllm_tp} must divide --processes {args.processes}")
    with tempfile.TemporaryDirectory() as tmp:
        if args.launch == SINGLE_GPU:
            traces = [record_steps(build_soak_trainer(Path(tmp), args.steps, args.completion_len))]
        else:  # each rank writes its trace (`child_main`)
            command = [*launch_command(args.launch, args.processes, module="trl_turbo.bench.soak"), tmp,
                       str(args.steps), str(args.completion_len), str(args.vllm_tp)]
            try:
                process = run_launch(command, timeout=args.timeout, env=fresh_rendezvous_env(), capture=False)
            except subprocess.TimeoutExpired:
                raise SystemExit(f"the soak's ranks did not finish within {args.timeout:.0f} s") from None
            paths = [Path(tmp, f"trace{rank}.json") for rank in range(args.processes)]
            if process.returncode or not all(path.exists() for path in paths):
                raise SystemExit(f"the soak's ranks exited with {process.returncode}; "
                                 f"{sum(path.exists() for path in paths)} of {args.processes} wrote a trace")
            traces = [json.loads(path.read_text()) for path in paths]
    verdict = verdicts(traces)
    for rank, rank_verdict in enumerate(verdict["ranks"]):
        report_rank(f"rank {rank} " if len(traces) > 1 else "", rank_verdict)
    print("flat" if verdict["flat"] else "NOT flat")
    rows = [{**row, "variant": "turbo" if len(traces) == 1 else f"turbo rank {rank}", "ok": True,
             **{f"{key}_gib": row[key] / GIB for key in ("device_used", "host_rss", "offload_pool")
                if row.get(key) is not None}} for rank, trace in enumerate(traces) for row in trace]
    config = {"steps": args.steps, "completion_len": args.completion_len, "model": SOAK_MODEL,
              "launch": args.launch, "processes": len(traces), "vllm_tp": args.vllm_tp}
    meta = metadata("soak", torch.device("cuda"), config)
    meta["verdict"] = verdict["ranks"][0]["flatness"] if len(traces) == 1 else verdict
    if len(traces) == 1:
        meta["step_time_trend"] = verdict["ranks"][0]["step_time_trend"]
    several = "" if len(traces) == 1 else f"-{len(traces)}gpu-{args.launch}"
    path = write(meta, rows, f"tiny-llama{several}", Path(args.out), series=lambda row: row["variant"],
                 panels=[("device_used_gib", "device used (GiB, driver)"), ("host_rss_gib", "host RSS (GiB)"),
                         ("offload_pool_gib", "pinned offload pool (GiB)"), ("step_s", "step time (s)")],
                 x=("step", "step"))
    print(f"wrote {path}")


def child_main(workdir: str, steps: str, completion_len: str, vllm_tp: str) -> None:
    """A rank of a launched soak: its own copy of the model, its trace saved where the driver reads it."""
    rank = int(os.environ.get("RANK", 0))
    trainer = build_soak_trainer(Path(workdir, f"rank{rank}"), int(steps), int(completion_len), int(vllm_tp))
    Path(workdir, f"trace{rank}.json").write_text(json.dumps(record_steps(trainer)))
    sys.stdout.flush()
    os._exit(0)  # skip interpreter teardown, where an in-process vLLM engine can hang on exit


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("soak", help="hundreds of GRPO steps with every feature on; is memory flat?")
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--completion-len", type=int, default=128)
    parser.add_argument("--launch", default=SINGLE_GPU,
                        help="1gpu, or one of TRL's accelerate configs (fsdp2): one trace per rank")
    parser.add_argument("--processes", type=int, default=2, help="GPUs of a --launch other than 1gpu")
    parser.add_argument("--vllm-tp", type=int, default=1, help="vLLM's tensor-parallel size (under FSDP2)")
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds before a launched soak is stopped")
    parser.add_argument("--out", default=str(DEFAULT_RESULTS_DIR), help="results folder")
    parser.set_defaults(func=run)


if __name__ == "__main__":
    child_main(*sys.argv[1:5])
