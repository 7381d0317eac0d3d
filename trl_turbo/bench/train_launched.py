"""``bench train --launch <accelerate config> --processes N``: the training phase of whole GRPO steps on several GPUs,
stock TRL against trl_turbo, per GPU.

Design decision: FSDP2 and DeepSpeed wrap the model only inside `Trainer.train()`, so a launched row cannot drive
`compute_loss` by hand as the one-GPU benchmark does. Each (variant, completion length) instead runs as an e2e child,
one after the other: the same launcher (TRL's own accelerate config), checkpoint, device-memory sampler and rank
merge, with TRL's generation replaced by synthetic rollouts (`synthetic`), and no vLLM engine. A step is then one
micro-batch of `--micro-batch` sequences per GPU: forward, backward, FSDP2's gathers and reduce-scatters and the
optimizer. The peak is the largest of any GPU's, sampled from the driver as in e2e. With ``--side-by-side`` every
variant runs at once on GPUs of its own (as e2e's), its lengths one after the other.
"""

from __future__ import annotations

import argparse
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from ..planning.shapes import SHAPES
from . import e2e, step_profile
from .gpu_children import launch_command, visible_devices
from .results import metadata, write


def specs(args: argparse.Namespace, lengths: list[int], variants: list[str], configs: dict[str, dict[str, Any]],
          checkpoint: Path, output_dir: str) -> list[dict[str, Any]]:
    """One e2e child spec per (variant, completion length): one prompt's group of `--micro-batch` sequences per GPU
    and step, trained as one micro-batch."""
    common = {"shape": args.shape, "quantization": "none", "launch": args.launch, "processes": args.processes,
              "prompts": 1, "generations": args.micro_batch, "micro_batch": args.micro_batch,
              "prompt_len": args.prompt_len, "warmup": args.warmup,
              # a profiled step comes after the timed ones, and is not one of them (`e2e.summarize`)
              "steps": args.steps + args.warmup + bool(args.profile_step),
              "profile_step": args.steps + args.warmup if args.profile_step else None,
              "seed": 0, "vllm_tp": 1, "lora": e2e.LORA,
              "rollouts": e2e.SYNTHETIC, "checkpoint": str(checkpoint), "variant_config": configs,
              "profile_decode": [], "unsloth_site": None}
    return [{**common, "variant": variant, "completion_len": length,
             "output_dir": str(Path(output_dir) / f"{variant}-{length}")}
            for variant in variants for length in lengths]


def run(args: argparse.Namespace, lengths: list[int], variants: list[str],
        configs: dict[str, dict[str, Any]]) -> Path:
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("bench train --launch runs on GPUs: this machine shows none")
    if args.quantization != "none" or args.tis:
        raise SystemExit("bench train --launch measures bf16 LoRA without TIS: leave out --quantization and --tis")
    launch_command(args.launch, args.processes)  # an unknown launch fails before anything runs
    checkpoint = Path(args.checkpoint or Path(tempfile.gettempdir()) / f"trl-turbo-{args.shape}")
    e2e.prepare_checkpoint(args.shape, checkpoint, 0, "cuda")
    torch.cuda.empty_cache()  # the model written from this process: its memory back to the children's GPUs
    device = torch.device("cuda", 0)
    config = {"shape": args.shape, "model_config": SHAPES[args.shape], "launch": args.launch,
              "processes": args.processes, "micro_batch_per_gpu": args.micro_batch, "prompt_len": args.prompt_len,
              "lengths": lengths, "variants": variants, "variant_config": configs, "steps": args.steps,
              "profile_step": bool(args.profile_step),
              "warmup": args.warmup, "rollouts": e2e.SYNTHETIC,
              "lora": e2e.LORA, "loss_type": "dapo", "beta": 0.0,
              "gradient_checkpointing": True, "dtype": "bfloat16"}
    meta = metadata("train", device, config)
    stem = f"train-{args.shape}-{args.processes}gpu-{args.launch}-{time.strftime('%Y%m%d-%H%M%S')}"
    panels = (("peak_gib", f"peak per GPU (GiB), {args.launch} x {args.processes}"), ("step_s", "step time (s)"))
    groups = (e2e.side_by_side_devices([args.processes] * len(variants),
                                       visible_devices(torch.cuda.device_count()))
              if args.side_by_side else [None] * len(variants))
    rows: list[dict[str, Any]] = []
    written = threading.Lock()
    path = Path(args.out) / f"{stem}.json"

    def run_variant(variant: str, devices: list[str] | None, output_dir: str) -> None:
        for spec in specs(args, lengths, [variant], configs, checkpoint, output_dir):
            row = e2e.run_child(spec, args.variant_timeout, devices)
            row["completion_len"] = spec["completion_len"]
            if devices is not None:
                row["devices"] = devices
            with written:
                rows.append(row)
                rows.sort(key=lambda r: (variants.index(r["variant"]), r["completion_len"]))
                print(format_row(row), flush=True)
                # after every row: a run cut short keeps what it measured
                write(meta, rows, args.shape, Path(args.out), series=lambda r: r["variant"], panels=panels,
                      stem=stem)
            if not row.get("ok"):
                return  # a longer completion of a variant that failed would fail too

    with tempfile.TemporaryDirectory() as output_dir:
        threads = [threading.Thread(target=run_variant, args=(variant, devices, output_dir))
                   for variant, devices in zip(variants, groups, strict=True)]
        for thread in threads:  # side by side: at once, each on GPUs of its own; else one after the other
            thread.start()
            if not args.side_by_side:
                thread.join()
        for thread in threads:
            thread.join()
    print(f"wrote {path} (+ .png)")
    return path


def format_row(row: dict[str, Any]) -> str:
    from . import fmt

    label = f"{row['variant']:>11} {row.get('launch')}x{row.get('processes')} L={row.get('completion_len')}"
    if not row.get("ok"):
        return f"{label} FAILED: {row.get('error')}"
    profiled = step_profile.profile_of(row)
    return (f"{label} peak per GPU={fmt(row['peak_gib'], '6.2f')} GiB (each {row.get('peak_gib_per_rank')})  "
            f"init peak={fmt(row.get('init_peak_gib'), '6.2f')} GiB  step={fmt(row['step_s'], '7.2f')} s"
            + (f"\n    {step_profile.format_step(profiled)}" if profiled else ""))
