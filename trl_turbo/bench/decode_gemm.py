"""``python -m trl_turbo.bench decode-gemm``: the sampling engine's linear layers at decode-sized batches, each
product against its byte floor. The candidates: cuBLAS in bf16 (merged sampling), W8A8 (every activation row
quantized to e4m3, then `torch._scaled_mm`: the arithmetic of vLLM's fp8 layers, `ops.fp8_linear`'s large-batch
path), and trl_turbo's weight-only fp8 kernel (`kernels.fp8_rows_matmul`) under its own tiling and under each
tiling of a sweep.

Design decision: one decode-step GEMM reads its weight once in a few microseconds, less than a Python launch takes,
so each candidate is timed as the engine runs it: many calls captured in one CUDA graph and replayed. The calls
cycle over enough copies of the weight that none is still in L2 when it is read again, as in a decode step where
every weight is read once. A product's floor is its bytes (the weight, the activations in and the result out) at the
read bandwidth measured in the same command, so a candidate's `read_fraction` is floor / time. The best tiling per
(layer, rows) is what `launch_config` should choose; the sum over a model's layers is the GEMM time of one decode
step, which `bench engine-options` then measures inside vLLM.
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..kernels.fp8_rows_matmul import LaunchConfig
from .results import DEFAULT_RESULTS_DIR

L2_DEFEAT_BYTES = 512 << 20  # the weight copies one graph cycles over: ten times an H200's L2
GRAPH_REPEATS = 5
SWEEP_BLOCK_N = (64, 128)
SWEEP_BLOCK_K = (128, 256)
SWEEP_WARPS = (4, 8)
SWEEP_STAGES = (3, 4)
SWEEP_SPLITS = (1, 2, 4, 8, 16)


def linear_shapes(spec: Any) -> dict[str, tuple[int, int]]:
    """(N, K) of each linear layer of one decoder layer, as vLLM fuses them: qkv, o, gate_up, down."""
    return {
        "qkv": (spec.query_width + 2 * spec.key_value_width, spec.hidden_size),
        "o": (spec.hidden_size, spec.query_width),
        "gate_up": (2 * spec.intermediate_size, spec.hidden_size),
        "down": (spec.hidden_size, spec.intermediate_size),
    }


def product_bytes(rows: int, n: int, k: int, weight_bytes: int) -> int:
    """What one product must move: the weight once, 16-bit activations in and results out."""
    return n * k * weight_bytes + 2 * rows * k + 2 * rows * n


def sweep_configs(n: int, k: int, most_programs: int) -> list[LaunchConfig]:
    """The tilings tried: each tile shape, warps and stages, both operand orders, and K splits that keep every run at
    least two tiles long and the programs under `most_programs`; in a fixed shuffled order, so that a sweep its
    budget cuts short has still sampled every dimension."""
    configs = []
    for block_n, block_k, warps, stages, weight_first, split in itertools.product(
            SWEEP_BLOCK_N, SWEEP_BLOCK_K, SWEEP_WARPS, SWEEP_STAGES, (False, True), SWEEP_SPLITS):
        programs = -(-n // block_n) * split
        if split > 1 and (k // split < 2 * block_k or programs > most_programs):
            continue
        configs.append(LaunchConfig(block_n, block_k, warps, stages, split, weight_first))
    random.Random(0).shuffle(configs)
    return configs


def graph_seconds_per_call(calls: list[Callable[[], Any]]) -> float:
    """The GPU time of one call of `calls`, each run once per graph replay: captured once, replayed
    `GRAPH_REPEATS` times after a warm replay."""
    import torch

    for call in calls:
        call()  # compile and allocate outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(GRAPH_REPEATS):
        graph.replay()
    end.record()
    end.synchronize()
    del graph
    return start.elapsed_time(end) / 1e3 / (GRAPH_REPEATS * len(calls))


def _copies(n: int, k: int, element_bytes: int) -> int:
    return max(2, -(-L2_DEFEAT_BYTES // (n * k * element_bytes)))


def measure_layer(n: int, k: int, rows: int, device: Any, budget_s: float) -> dict[str, Any]:
    """Every candidate on one (N, K) at `rows` activation rows: seconds per call, and the sweep's tilings sorted
    fastest first (as many as `budget_s` allows)."""
    import torch

    from ..kernels.fp8_rows_matmul import fp8_rows_matmul, launch_config
    from ..ops.fp8_linear import _rowwise_fp8
    from ..ops.merge_fp8 import FP8_DTYPE

    generator = torch.Generator(device=device).manual_seed(rows * 7919 + n)
    x = torch.randn(rows, k, device=device, dtype=torch.bfloat16, generator=generator)
    fp8 = [(torch.randn(n, k, device=device, generator=generator) * 0.05).to(FP8_DTYPE)
           for _ in range(_copies(n, k, 1))]
    scale = torch.tensor([0.01], device=device)
    seconds: dict[str, float] = {}
    bf16 = [w.to(torch.bfloat16) for w in fp8[:_copies(n, k, 2)]]
    seconds["bf16 cuBLAS"] = graph_seconds_per_call([lambda w=w: x @ w.T for w in bf16])
    del bf16
    seconds["W8A8 torch._scaled_mm"] = graph_seconds_per_call(
        [lambda w=w: _rowwise_fp8(x, w, scale, None) for w in fp8])
    default = launch_config(n, k)
    most_programs = 16 * torch.cuda.get_device_properties(device).multi_processor_count
    seconds["turbo weight-only, default tiling"] = graph_seconds_per_call(
        [lambda w=w: fp8_rows_matmul(x, w, scale, config=default) for w in fp8])
    reference = x.float() @ (fp8[0].float() * scale).T

    def time_one(config: LaunchConfig) -> tuple[float, float]:
        error = (fp8_rows_matmul(x, fp8[0], scale, config=config).float() - reference).abs().max().item()
        return graph_seconds_per_call([lambda w=w: fp8_rows_matmul(x, w, scale, config=config) for w in fp8]), error

    swept = timed_sweep(sweep_configs(n, k, most_programs), time_one, budget_s)
    if swept["sweep"]:
        seconds["turbo weight-only, best tiling"] = swept["sweep"][0]["seconds"]
    return {"seconds": seconds, "default_config": default._asdict(), **swept}


def failure_line(failure: BaseException) -> str:
    """The first line of what a failed candidate raised (its type where it says nothing), for the results."""
    return (str(failure) or repr(failure)).splitlines()[0][:200]


def timed_sweep(configs: list[Any], time_one: Callable[[Any], tuple[float, float]],
                budget_s: float) -> dict[str, Any]:
    """Each of `configs` (NamedTuples) through `time_one` (its seconds per call and largest error), in order until
    `budget_s` has passed: the timed ones fastest first (`sweep`), those that raised with their first line (a tiling
    Triton cannot build here: the sweep goes on), and whether every one was tried."""
    started, sweep = time.monotonic(), []
    for config in configs:
        if time.monotonic() - started > budget_s:
            break
        try:
            per_call, error = time_one(config)
        except Exception as failure:
            sweep.append({"config": config._asdict(), "error": failure_line(failure)})
            continue
        sweep.append({"config": config._asdict(), "seconds": per_call, "max_abs_error": error})
    return {"sweep": sorted((entry for entry in sweep if "seconds" in entry), key=lambda entry: entry["seconds"]),
            "sweep_failed": [entry for entry in sweep if "error" in entry],
            "sweep_complete": len(sweep) == len(configs)}


def summarize(rows: list[dict[str, Any]], layers: int) -> dict[str, dict[str, float]]:
    """Per activation-row count and candidate: the GEMM milliseconds of one decode step's decoder layers (each
    linear once per layer), where every linear was measured."""
    totals: dict[int, dict[str, float]] = {}
    counts: dict[int, int] = {}
    for row in rows:
        counts[row["rows"]] = counts.get(row["rows"], 0) + 1
        for name, seconds in row["seconds"].items():
            per_rows = totals.setdefault(row["rows"], {})
            per_rows[name] = per_rows.get(name, 0.0) + seconds * layers * 1e3
    linears = len({row["linear"] for row in rows})
    return {str(rows_): per for rows_, per in totals.items() if counts[rows_] == linears}


def run(args: argparse.Namespace) -> Path:
    import torch

    from .hardware import measure_apart
    from .results import finish_figure, metadata
    from .roofline import shape_spec

    if not torch.cuda.is_available():
        raise SystemExit("the decode-gemm benchmark times CUDA kernels: it needs a CUDA GPU")
    device = torch.device("cuda", 0)
    spec = shape_spec(args.shape, None)
    shapes = linear_shapes(spec)
    wanted = [name.strip() for name in args.linears.split(",") if name.strip()] if args.linears else list(shapes)
    unknown = sorted(set(wanted) - set(shapes))
    if unknown:
        raise SystemExit(f"unknown linears {unknown}; choose from {sorted(shapes)}")
    row_counts = [int(r) for r in args.rows.split(",")]
    hardware = measure_apart(device)
    bandwidth = hardware["read_bytes_per_s"]
    config = {"shape": args.shape, "linears": {name: shapes[name] for name in wanted}, "rows": row_counts,
              "sweep_budget_s": args.sweep_budget_s, "l2_defeat_bytes": L2_DEFEAT_BYTES,
              "graph_repeats": GRAPH_REPEATS}
    meta = {**metadata("decode-gemm", device, config), "hardware": hardware}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"decode-gemm-{args.shape}-{time.strftime('%Y%m%d-%H%M%S')}"
    results: list[dict[str, Any]] = []
    for name, rows in itertools.product(wanted, row_counts):
        n, k = shapes[name]
        measured = measure_layer(n, k, rows, device, args.sweep_budget_s)
        floors = {candidate: product_bytes(rows, n, k, 2 if candidate.startswith("bf16") else 1) / bandwidth
                  for candidate in measured["seconds"]}
        measured["read_fraction"] = {candidate: floors[candidate] / seconds
                                     for candidate, seconds in measured["seconds"].items()}
        results.append({"linear": name, "n": n, "k": k, "rows": rows, **measured})
        print(format_row(results[-1]), flush=True)
        torch.cuda.empty_cache()
        (out / f"{stem}.json").write_text(json.dumps(
            {**meta, "per_decode_step_ms": summarize(results, spec.layers), "rows": results}, indent=2) + "\n")
    _plot(results, f"decode-gemm {args.shape} on {meta['gpu']}", out / f"{stem}.png", finish_figure)
    for rows, per in summarize(results, spec.layers).items():
        print(f"{rows} rows, one decode step's decoder-layer GEMMs: "
              + "; ".join(f"{name} {ms:.2f} ms" for name, ms in per.items()))
    print(f"wrote {out / stem}.json")
    return out / f"{stem}.json"


def format_row(row: dict[str, Any]) -> str:
    parts = [f"{name} {1e6 * seconds:.1f} us ({row['read_fraction'][name]:.0%})"
             for name, seconds in row["seconds"].items()]
    best = row["sweep"][0]["config"] if row["sweep"] else None
    return f"{row['linear']} [{row['n']}x{row['k']}] x {row['rows']} rows: " + "; ".join(parts) + f"; best {best}"


def _plot(results: list[dict[str, Any]], title: str, path: Path, finish: Callable[..., None]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    linears = sorted({row["linear"] for row in results})
    fig, axes = plt.subplots(1, len(linears), figsize=(5 * len(linears), 4), squeeze=False)
    for ax, linear in zip(axes[0], linears):
        mine = sorted((row for row in results if row["linear"] == linear), key=lambda row: row["rows"])
        for candidate in sorted({name for row in mine for name in row["read_fraction"]}):
            points = [(row["rows"], row["read_fraction"][candidate]) for row in mine
                      if candidate in row["read_fraction"]]
            ax.plot(*zip(*points), marker="o", label=candidate)
        ax.set_title(f"{linear} [{mine[0]['n']}x{mine[0]['k']}]", fontsize=9)
        ax.set_xlabel("activation rows")
        ax.set_ylabel("floor / time (fraction of read bandwidth)")
    finish(fig, axes[0], title, path)


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("decode-gemm", help="the sampling engine's linear layers at decode-sized "
                                                       "batches against their byte floor, with a tiling sweep")
    parser.add_argument("--shape", default="llama-3.1-8b")
    parser.add_argument("--linears", default=None, help="comma-separated among qkv,o,gate_up,down (default all)")
    parser.add_argument("--rows", default="8,16,32,64", help="activation rows: live sequences per decode step")
    parser.add_argument("--sweep-budget-s", type=float, default=20.0, help="seconds of tiling sweep per cell")
    parser.add_argument("--out", default=str(DEFAULT_RESULTS_DIR), help="results folder")
    parser.set_defaults(func=run)
