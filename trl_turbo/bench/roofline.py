"""The roofline of an e2e row: its generation against the decode floor and its training phase's model FLOP
utilization (`planning.roofline` has the model), for a new run's rows and, with stated ceilings, for committed files.

Design decision: everything a floor needs is in a results file already (the shape, the workload, the launch, the
variant's settings and the sampling mode it ran), so the same function annotates a row while the bench runs, with
the ceilings `bench.hardware` measured on that machine, and a committed row later, with ceilings given on the
command line (`python -m trl_turbo.bench roofline FILE --read-tbps 4.8 --peak-tflops 989`), which the output
names as given rather than measured.
"""

from __future__ import annotations

import argparse
import functools
import json
from pathlib import Path
from typing import Any

from ..planning.model_spec import ModelSpec, model_spec
from ..planning.roofline import Generation, decode_bytes, generation_floor_s, training_flops
from ..planning.shapes import build_config

GIB = 2**30


@functools.cache
def shape_spec(shape: str, lora_r: int | None) -> ModelSpec:
    return model_spec(build_config(shape), lora_r=lora_r)


def row_generation(row: dict[str, Any], config: dict[str, Any], spec: ModelSpec) -> Generation:
    """The generation one tensor-parallel group of `row` ran: its ranks' prompts x generations, in the dtype its
    engine sampled with."""
    tp = int(config.get("vllm_tp") or 1)
    settings = config.get("variant_config", {}).get(row["variant"], {})
    sampling = row.get("sampling") or ("lora" if row["variant"] == "turbo-lora" else None)
    if sampling == "fp8":
        weight_dtype = "fp8"
    elif config.get("quantization", "none") != "none":
        weight_dtype = "nf4"
    else:
        weight_dtype = "bf16"
    return Generation(
        sequences=int(config["prompts"]) * int(config["generations"]) * tp,
        prompt_len=int(config["prompt_len"]), completion_len=int(config["completion_len"]), tp=tp,
        weight_dtype=weight_dtype,
        kv_bytes=1 if str(settings.get("turbo_vllm_kv_cache_dtype", "auto")).startswith("fp8") else 2,
        adapter_parameters=spec.lora_parameters if sampling == "lora" else 0,
    )


def row_roofline(row: dict[str, Any], config: dict[str, Any],
                 hardware: dict[str, Any] | None) -> dict[str, Any] | None:
    """Generation floor, generation / floor, the decode bytes one rank reads, and the training phase's model FLOPs
    and MFU (None: the row did not complete, or no ceilings)."""
    if hardware is None or not row.get("ok") or row.get("generate_s") is None or row.get("step_s") is None:
        return None
    lora = config.get("lora")
    spec = shape_spec(config["shape"], lora["r"] if lora else None)
    generation = row_generation(row, config, spec)
    floor = generation_floor_s(spec, generation, hardware["read_bytes_per_s"], hardware["bf16_flops_per_s"])
    train_s = row["step_s"] - row["generate_s"] - (row.get("sync_s") or 0.0)
    flops = training_flops(spec, int(config["prompts"]) * int(config["generations"]),
                           int(config["prompt_len"]) + int(config["completion_len"]), full_finetuning=lora is None)
    return {"generation_floor_s": floor, "generation_over_floor": row["generate_s"] / floor,
            "decode_gib_per_rank": decode_bytes(spec, generation) / GIB, "weight_dtype": generation.weight_dtype,
            "train_s": train_s, "train_model_tflops": flops / 1e12,
            "train_mfu": flops / (train_s * hardware["bf16_flops_per_s"]) if train_s > 0 else None}


def format_roofline(row: dict[str, Any], roofline: dict[str, Any] | None) -> str:
    if roofline is None:
        return f"{row.get('variant')}: no roofline (the row did not complete)"
    mfu = roofline["train_mfu"]
    return (f"{row['variant']}: generation {row['generate_s']:.2f} s, floor {roofline['generation_floor_s']:.2f} s "
            f"({roofline['generation_over_floor']:.2f}x; {roofline['decode_gib_per_rank']:.1f} GiB read per rank, "
            f"{roofline['weight_dtype']} weights); training phase {roofline['train_s']:.2f} s, "
            f"{roofline['train_model_tflops']:.0f} TFLOP, MFU {'-' if mfu is None else f'{mfu:.1%}'}")


def run(args: argparse.Namespace) -> None:
    given = None
    if args.read_tbps is not None and args.peak_tflops is not None:
        given = {"read_bytes_per_s": args.read_tbps * 1e12, "bf16_flops_per_s": args.peak_tflops * 1e12}
    for path in args.files:
        data = json.loads(Path(path).read_text())
        hardware = data.get("hardware") or given
        if hardware is None:
            raise SystemExit(f"{path} has no measured ceilings; give --read-tbps and --peak-tflops")
        source = "measured" if data.get("hardware") else "given"
        print(f"{Path(path).name} ({data['gpu']}; {source}: {hardware['read_bytes_per_s'] / 1e12:.2f} TB/s read, "
              f"{hardware['bf16_flops_per_s'] / 1e12:.0f} bf16 TFLOP/s)")
        for row in data["rows"]:
            print("  " + format_roofline(row, row_roofline(row, data["config"], hardware)))


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("roofline", help="generation / floor and training MFU of committed e2e rows")
    parser.add_argument("files", nargs="+", help="e2e results files")
    parser.add_argument("--read-tbps", type=float, default=None, help="read bandwidth, TB/s (files without "
                        "measured ceilings)")
    parser.add_argument("--peak-tflops", type=float, default=None, help="bf16 matmul rate, TFLOP/s (idem)")
    parser.set_defaults(func=run)
