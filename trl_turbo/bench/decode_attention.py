"""``python -m trl_turbo.bench decode-attention``: one decode step's attention over a paged KV cache, FlashAttention 3
as vLLM calls it against trl_turbo's Triton kernel (`kernels.paged_decode_attention`) under its own cut and each cut
of a sweep, every cell against its byte floor.

Design decisions:
- A cell is (live sequences, context tokens, cache dtype) at a model shape's heads per tensor-parallel rank. The step
  is timed as the engine runs it: one call per decoder layer, each layer over a cache of its own, all captured in one
  CUDA graph and replayed; short contexts then sit in L2 as they do in the engine.
- FA3 runs as vLLM's FlashAttention backend calls it under full CUDA graphs: the ahead-of-time scheduler metadata,
  at most `FA3_SPLITS` splits, and an e4m3 query with the cache's scales where the cache is e4m3 (vLLM quantizes the
  query before the call; that kernel is not timed, for either candidate). trl_turbo's kernel reads the same inputs.
- The floor is the bytes a step must move (every live key and value once, the query in and the output out) at the
  read bandwidth measured in the same command. Each candidate's output is compared with the fp32 reference.
- Inside the engine a CUDA graph captures the kernel once per batch size, cut for the engine's longest context,
  and replays it on every shorter one; `--max-model-len` times that launch too, beside the ones cut for the cell's
  own context.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import random
import time
from pathlib import Path
from typing import Any

from ..kernels.paged_decode_attention import DecodeAttentionConfig, decode_attention_config, run_length
from .decode_gemm import failure_line, graph_seconds_per_call, timed_sweep
from .results import DEFAULT_RESULTS_DIR

PAGE = 16
FA3_SPLITS = 32  # vLLM's flash_attn_max_num_splits_for_cuda_graph
SWEEP_BLOCK_N = (16, 32, 64, 128)
SWEEP_WARPS = (2, 4, 8)
SWEEP_STAGES = (1, 2, 3)
SWEEP_RUNS = (1, 2, 4, 8, 16)


def step_bytes(sequences: int, context: int, q_heads: int, kv_heads: int, head_dim: int, cache_bytes: int,
               layers: int) -> int:
    """What one decode step's attention must move: every live key and value once, the query in (e4m3 with an e4m3
    cache, as vLLM hands it) and the 16-bit output out."""
    per_layer = sequences * (2 * context * kv_heads * head_dim * cache_bytes + (cache_bytes + 2) * q_heads * head_dim)
    return per_layer * layers


def sweep_configs(context: int, fp8: bool = False, runs_first: int | None = None) -> list[DecodeAttentionConfig]:
    """Tile sizes, warps, stages and run counts, each count only where all its runs hold tokens of `context` (whole
    tiles may leave a larger count's last runs empty: the smaller count that has the same runs is tried instead), for
    an e4m3 cell with and without e4m3 scores. The cuts with `runs_first` runs (the default cut's count) come first,
    then the others, each group in a fixed shuffled order so that a sweep its budget cuts short has sampled every
    dimension of the cuts the engine could take."""
    def used(runs: int, block_n: int) -> int:  # the runs that hold tokens of `context`
        return math.ceil(context / run_length(context, runs, block_n))

    configs = set()
    for block_n, warps, stages, runs, fp8_scores in itertools.product(
            SWEEP_BLOCK_N, SWEEP_WARPS, SWEEP_STAGES, sorted({*SWEEP_RUNS, runs_first or 1}),
            (False, True) if fp8 else (False,)):
        configs.add(DecodeAttentionConfig(block_n, warps, stages, used(runs, block_n), fp8_scores))
    # the default's count as this context uses it: a longer longest context asks for more runs than it fills
    first = sorted(c for c in configs if runs_first is not None and c.runs == used(runs_first, c.block_n))
    rest = sorted(configs - set(first))
    random.Random(0).shuffle(first)
    random.Random(0).shuffle(rest)
    return first + rest


def cut_name(cut: DecodeAttentionConfig) -> str:
    """A cut as `--cuts` spells it: tile/warps/stages/runs, and "e4m3" for e4m3 scores."""
    return "/".join(map(str, cut[:4])) + ("/e4m3" if cut.fp8_scores else "")


def parse_cuts(text: str | None) -> tuple[DecodeAttentionConfig, ...]:
    """`--cuts`: comma-separated cuts, each TILE/WARPS/STAGES/RUNS with an optional /e4m3 (e4m3 scores; e4m3 cells
    only)."""
    cuts = []
    for item in filter(None, (part.strip() for part in (text or "").split(","))):
        fields = item.split("/")
        scores = fields[4:] == ["e4m3"]
        if len(fields) not in (4, 5) or (len(fields) == 5 and not scores) or not all(f.isdigit() for f in fields[:4]):
            raise SystemExit(f"--cuts: {item!r} is not TILE/WARPS/STAGES/RUNS[/e4m3], e.g. 32/2/2/1")
        cuts.append(DecodeAttentionConfig(*map(int, fields[:4]), fp8_scores=scores))
    return tuple(cuts)


def _cell_inputs(sequences: int, context: int, q_heads: int, kv_heads: int, head_dim: int, fp8: bool, layers: int,
                 device: Any) -> dict[str, Any]:
    import torch

    from ..ops.merge_fp8 import FP8_DTYPE, FP8_MAX

    generator = torch.Generator(device=device).manual_seed(sequences * 131 + context)
    pages = -(-context // PAGE)
    blocks = sequences * pages + 1
    table = torch.randperm(blocks, device=device, generator=generator)[: sequences * pages]
    table = table.reshape(sequences, pages).to(torch.int32)
    caches = []
    for _ in range(layers):
        kv = torch.randn(blocks, 2, PAGE, kv_heads, head_dim, device=device, generator=generator)
        # e4m3 has no infinity: a value past its range would cast to NaN
        caches.append((kv / (4.0 / FP8_MAX)).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE) if fp8 else kv.to(torch.bfloat16))
    query = torch.randn(sequences, q_heads, head_dim, device=device, generator=generator)
    scales = {}
    if fp8:
        q_scale = torch.tensor([query.abs().max().item() / FP8_MAX], device=device)
        query = (query / q_scale).to(FP8_DTYPE)
        scales = {"q_scale": q_scale, "k_scale": torch.tensor([4.0 / FP8_MAX], device=device),
                  "v_scale": torch.tensor([4.0 / FP8_MAX], device=device)}
    else:
        query = query.to(torch.bfloat16)
    return {"table": table, "caches": caches, "query": query, "scales": scales,
            "lens": torch.full((sequences,), context, dtype=torch.int32, device=device),
            "out": torch.empty((sequences, q_heads, head_dim), dtype=torch.bfloat16, device=device)}


def _fa3_calls(cell: dict[str, Any], context: int, head_dim: int) -> list[Any] | None:
    """vLLM's FA3 decode call per layer, or None where vLLM's FlashAttention is not importable."""
    try:
        from vllm.vllm_flash_attn.flash_attn_interface import flash_attn_varlen_func, get_scheduler_metadata
    except ImportError:
        return None
    import torch

    query, lens, scales = cell["query"], cell["lens"], cell["scales"]
    sequences, q_heads, _ = query.shape
    kv_heads = cell["caches"][0].shape[3]
    starts = torch.arange(sequences + 1, dtype=torch.int32, device=query.device)
    metadata = get_scheduler_metadata(batch_size=sequences, max_seqlen_q=1, max_seqlen_k=context,
                                      num_heads_q=q_heads, num_heads_kv=kv_heads, headdim=head_dim,
                                      cache_seqlens=lens, qkv_dtype=query.dtype, cu_seqlens_q=starts,
                                      page_size=PAGE, causal=True, num_splits=FA3_SPLITS)
    descale = {name.replace("_scale", "_descale"): scale.expand(sequences, kv_heads)
               for name, scale in scales.items()}
    calls = []
    for kv in cell["caches"]:
        keys, values = kv.unbind(1)
        calls.append(lambda keys=keys, values=values: flash_attn_varlen_func(
            q=query, k=keys, v=values, out=cell["out"], cu_seqlens_q=starts, max_seqlen_q=1, seqused_k=lens,
            max_seqlen_k=context, softmax_scale=head_dim ** -0.5, causal=True, block_table=cell["table"],
            scheduler_metadata=metadata, fa_version=3, num_splits=FA3_SPLITS, **descale))
    return calls


def _turbo_calls(cell: dict[str, Any], max_seq_len: int, head_dim: int, config: DecodeAttentionConfig | None) -> list:
    from ..kernels.paged_decode_attention import paged_decode_attention

    calls = []
    for kv in cell["caches"]:
        keys, values = kv.unbind(1)
        calls.append(lambda keys=keys, values=values: paged_decode_attention(
            cell["query"], keys, values, cell["table"], cell["lens"], softmax_scale=head_dim ** -0.5,
            max_seq_len=max_seq_len, out=cell["out"], config=config, **cell["scales"]))
    return calls


def _error(calls: list, cell: dict[str, Any], exact: Any) -> float:
    calls[0]()
    return (cell["out"].float() - exact).abs().max().item()


def measure_cell(sequences: int, context: int, q_heads: int, kv_heads: int, head_dim: int, fp8: bool, layers: int,
                 device: Any, budget_s: float, max_model_len: int | None = None,
                 cuts: tuple[DecodeAttentionConfig, ...] = ()) -> dict[str, Any]:
    """Seconds per layer of each candidate on one cell, their largest error against the fp32 reference, and the
    sweep's cuts sorted fastest first (as many as `budget_s` allows). With `max_model_len`, also the kernel as a
    CUDA graph of the engine captures it: the default cut for the batch and that longest context; and each of
    `cuts` (`--cuts`), whatever the budget."""
    import torch

    from ..ops.paged_decode_attention import reference

    cell = _cell_inputs(sequences, context, q_heads, kv_heads, head_dim, fp8, layers, device)
    keys, values = cell["caches"][0].unbind(1)
    exact = reference(cell["query"], keys, values, cell["table"], cell["lens"], softmax_scale=head_dim ** -0.5,
                      out=torch.empty(cell["query"].shape, device=device), **cell["scales"])
    seconds, errors, failed = {}, {}, {}
    fa3 = _fa3_calls(cell, context, head_dim)
    if fa3 is not None:
        errors["FA3 (vLLM)"] = _error(fa3, cell, exact)
        seconds["FA3 (vLLM)"] = graph_seconds_per_call(fa3)
    processors = torch.cuda.get_device_properties(device).multi_processor_count
    default = _turbo_calls(cell, context, head_dim, None)
    errors["turbo, default cut"] = _error(default, cell, exact)
    seconds["turbo, default cut"] = graph_seconds_per_call(default)
    # the default cut for the longest context the launch serves: the engine's, else the cell's
    rule = decode_attention_config(max_model_len or context, sequences, kv_heads, processors, fp8)
    named = {f"turbo, cut {cut_name(cut)}": cut for cut in cuts if fp8 or not cut.fp8_scores}
    if max_model_len is not None:
        named["turbo, engine cut"] = rule
        if fp8:
            named["turbo, engine cut, e4m3 scores"] = rule._replace(fp8_scores=True)
    for name, cut in named.items():
        captured = _turbo_calls(cell, max_model_len or context, head_dim, cut)
        try:
            error = _error(captured, cell, exact)
            seconds[name], errors[name] = graph_seconds_per_call(captured), error
        except Exception as failure:  # a cut Triton cannot build here: recorded, the cell goes on
            failed[name] = failure_line(failure)

    def time_one(config: DecodeAttentionConfig) -> tuple[float, float]:
        calls = _turbo_calls(cell, context, head_dim, config)
        error = _error(calls, cell, exact)
        return graph_seconds_per_call(calls), error

    swept = timed_sweep(sweep_configs(context, fp8, runs_first=rule.runs), time_one, budget_s)
    if swept["sweep"]:
        seconds["turbo, best cut"] = swept["sweep"][0]["seconds"]
        errors["turbo, best cut"] = swept["sweep"][0]["max_abs_error"]
    return {"seconds": seconds, "max_abs_error": errors, "failed": failed, **swept}


def run(args: argparse.Namespace) -> Path:
    import torch

    from .hardware import measure_apart
    from .results import metadata
    from .roofline import shape_spec

    cuts = parse_cuts(args.cuts)  # bad input fails before any GPU work
    if not torch.cuda.is_available():
        raise SystemExit("the decode-attention benchmark times CUDA kernels: it needs a CUDA GPU")
    device = torch.device("cuda", 0)
    spec = shape_spec(args.shape, None)
    q_heads, kv_heads = spec.query_width // spec.head_dim // args.tp, spec.key_value_heads // args.tp
    if not kv_heads or spec.key_value_heads % args.tp:
        raise SystemExit(f"--tp {args.tp} does not split the shape's {spec.key_value_heads} KV heads")
    cells = [(int(s), int(c)) for s, c in (cell.split("x") for cell in args.cells.split(","))]
    dtypes = [name.strip() for name in args.caches.split(",")]
    if set(dtypes) - {"bf16", "fp8"}:
        raise SystemExit(f"--caches takes bf16 and fp8, got {dtypes}")
    hardware = measure_apart(device)
    bandwidth = hardware["read_bytes_per_s"]
    config = {"shape": args.shape, "tp": args.tp, "q_heads": q_heads, "kv_heads": kv_heads, "head_dim": spec.head_dim,
              "layers": spec.layers, "cells": cells, "caches": dtypes, "page": PAGE, "fa3_splits": FA3_SPLITS,
              "sweep_budget_s": args.sweep_budget_s, "max_model_len": args.max_model_len,
              "cuts": [cut_name(cut) for cut in cuts]}
    meta = {**metadata("decode-attention", device, config), "hardware": hardware}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"decode-attention-{args.shape}-tp{args.tp}-{time.strftime('%Y%m%d-%H%M%S')}"
    results: list[dict[str, Any]] = []
    for dtype, (sequences, context) in itertools.product(dtypes, cells):
        fp8 = dtype == "fp8"
        measured = measure_cell(sequences, context, q_heads, kv_heads, spec.head_dim, fp8, spec.layers, device,
                                args.sweep_budget_s, args.max_model_len, cuts)
        floor = step_bytes(sequences, context, q_heads, kv_heads, spec.head_dim, 1 if fp8 else 2, 1) / bandwidth
        measured["step_ms"] = {name: 1e3 * s * spec.layers for name, s in measured["seconds"].items()}
        measured["read_fraction"] = {name: floor / s for name, s in measured["seconds"].items()}
        results.append({"cache": dtype, "sequences": sequences, "context": context,
                        "floor_step_ms": 1e3 * floor * spec.layers, **measured})
        print(format_row(results[-1]), flush=True)
        torch.cuda.empty_cache()
        (out / f"{stem}.json").write_text(json.dumps({**meta, "rows": results}, indent=2) + "\n")
    print(f"wrote {out / stem}.json")
    return out / f"{stem}.json"


def format_row(row: dict[str, Any]) -> str:
    parts = [f"{name} {ms:.3f} ms ({row['read_fraction'][name]:.0%}, err {row['max_abs_error'][name]:.2g})"
             for name, ms in row["step_ms"].items()]
    best = row["sweep"][0]["config"] if row["sweep"] else None
    return (f"{row['cache']} {row['sequences']} x {row['context']}: floor {row['floor_step_ms']:.3f} ms; "
            + "; ".join(parts) + f"; best {best}")


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("decode-attention", help="one decode step's paged attention: FA3 as vLLM calls "
                                                            "it against trl_turbo's kernel, with a sweep")
    parser.add_argument("--shape", default="llama-3.1-8b")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel size: the heads of one rank")
    parser.add_argument("--cells", default="64x16,64x512,64x1984,8x1984",
                        help="comma-separated SEQUENCESxCONTEXT cells")
    parser.add_argument("--caches", default="fp8,bf16", help="comma-separated among bf16,fp8")
    parser.add_argument("--sweep-budget-s", type=float, default=8.0, help="seconds of sweep per cell")
    parser.add_argument("--cuts", default=None,
                        help="comma-separated cuts timed in every cell whatever the sweep's budget, each "
                             "TILE/WARPS/STAGES/RUNS[/e4m3], e.g. 32/2/2/1,32/2/2/2 (with --sweep-budget-s 0: only "
                             "these)")
    parser.add_argument("--max-model-len", type=int, default=None,
                        help="also time the kernel as the engine's CUDA graphs capture it for this longest context")
    parser.add_argument("--out", default=str(DEFAULT_RESULTS_DIR), help="results folder")
    parser.set_defaults(func=run)
