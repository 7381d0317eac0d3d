"""``python -m trl_turbo.bench cpu-step``: what ``import trl_turbo`` costs where its features cannot help: whole GRPO
steps of a tiny model on CPU, TRL's defaults otherwise, with and without the import.

Design decision: every (variant, repeat) runs in a fresh interpreter, alternating stock and turbo, so neither import
order, warm caches nor a noisy neighbour favours one variant; a step's time is from the trainer's step-begin to
step-end callbacks, the first step (warm-up) left out, and each variant reports the median over all its steps. The
model is a random-init tiny Llama with a real vocabulary size (Qwen's 151,936 by default), where the LM head and the
loss over the vocabulary dominate a CPU step.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from .results import DEFAULT_RESULTS_DIR, metadata, write

VARIANTS = ("stock", "turbo")


def run_child(variant: str, vocab: int, steps: int, completion_len: int) -> dict[str, Any]:
    """Train ``steps`` + 1 GRPO steps in this process; return the per-step seconds (the first one dropped)."""
    if variant == "turbo":
        import trl_turbo  # noqa: F401  (the one line a user adds)
    import time

    import torch
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from ..tasks import arithmetic
    from ..testing.models import tiny_model
    from ..testing.tokenizer import build_tokenizer

    torch.manual_seed(0)
    model = tiny_model("llama", vocab_size=vocab, hidden_size=64, layers=2)
    times: list[float] = []

    class StepTimer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            self.start = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            times.append(time.perf_counter() - self.start)

    with tempfile.TemporaryDirectory() as out:
        config = GRPOConfig(output_dir=out, use_cpu=True, bf16=False, report_to="none", save_strategy="no",
                            per_device_train_batch_size=8, num_generations=8, max_completion_length=completion_len,
                            max_steps=steps + 1, logging_steps=1, seed=0)
        trainer = GRPOTrainer(model=model, reward_funcs=[arithmetic.format_reward], args=config,
                              train_dataset=arithmetic.load_dataset("train").select(range(64)),
                              processing_class=build_tokenizer(), callbacks=[StepTimer()])
        trainer.train()
    return {"variant": variant, "vocab": vocab, "step_s_all": times[1:], "step_s": statistics.median(times[1:])}


def run(args: argparse.Namespace) -> None:
    rows: list[dict[str, Any]] = []
    for vocab in [int(v) for v in args.vocab.split(",")]:
        samples: dict[str, list[float]] = {v: [] for v in VARIANTS}
        for _ in range(args.repeats):
            for variant in VARIANTS:
                result = subprocess.run(
                    [sys.executable, "-m", "trl_turbo.bench", "cpu-step", "--child", variant, "--vocab", str(vocab),
                     "--steps", str(args.steps), "--completion-len", str(args.completion_len)],
                    capture_output=True, text=True, check=True)
                child = json.loads(result.stdout.strip().splitlines()[-1])
                samples[variant] += child["step_s_all"]
        for variant in VARIANTS:
            rows.append({"variant": variant, "vocab": vocab, "completion_len": args.completion_len, "ok": True,
                         "step_s": statistics.median(samples[variant]), "steps_timed": len(samples[variant]),
                         "step_s_all": samples[variant]})
        stock, turbo = rows[-2]["step_s"], rows[-1]["step_s"]
        print(f"vocab {vocab}: stock {stock:.3f} s, turbo {turbo:.3f} s per step ({turbo / stock:.3f}x)")
    meta = metadata("cpu-step", _cpu(), {"steps": args.steps, "repeats": args.repeats,
                                         "completion_len": args.completion_len})
    meta["command"] = " ".join(["python3", "-m", "trl_turbo.bench", *sys.argv[1:]])
    path = write(meta, rows, "tiny-llama", Path(args.out), series=lambda row: row["variant"],
                 panels=[("step_s", "s per GRPO step (median)")])
    print(f"wrote {path}")


def _cpu():
    import torch

    return torch.device("cpu")


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("cpu-step", help="GRPO steps of a tiny model on CPU, with and without the import")
    parser.add_argument("--vocab", default="151936", help="comma-separated vocabulary sizes")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per process (after one warm-up step)")
    parser.add_argument("--repeats", type=int, default=3, help="processes per variant, alternating")
    parser.add_argument("--completion-len", type=int, default=32)
    parser.add_argument("--out", default=str(DEFAULT_RESULTS_DIR), help="results folder")
    parser.add_argument("--child", choices=VARIANTS, default=None, help=argparse.SUPPRESS)
    parser.set_defaults(func=_dispatch)


def _dispatch(args: argparse.Namespace) -> None:
    if args.child is not None:
        print(json.dumps(run_child(args.child, int(args.vocab), args.steps, args.completion_len)))
    else:
        run(args)
