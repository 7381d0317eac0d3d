"""``python -m trl_turbo.bench cpu-step``: what ``import trl_turbo`` costs where its features cannot help: whole GRPO
steps of a tiny model on CPU, TRL's defaults otherwise, with and without the import.

Design decision: every (variant, repeat) runs in a fresh interpreter, alternating stock and turbo, so neither import
order, warm caches nor a noisy neighbour favours one variant; a child is started as ``-m trl_turbo.bench``, whose
package import patches TRL, so the stock child calls ``trl_turbo.unpatch()`` before building its trainer and every
child reports its patch state, which the driver checks; a step's time is from the trainer's step-begin to
step-end callbacks, the first step (warm-up) left out, and each variant reports the median over all its steps. The
model (``--model``) is a random-init tiny Llama (``tiny-llama``, the default) or a tiny Gemma 3 vision-language model
(``tiny-vlm``, :mod:`trl_turbo.testing.vlm`: prompts with a 56×56 picture each, fed through its processor), both with
a real vocabulary size (Qwen's 151,936 by default), where the LM head and the loss over the vocabulary dominate a CPU
step. The result file is named after the model.
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

from . import set_patched
from .results import DEFAULT_RESULTS_DIR, metadata, write

VARIANTS = ("stock", "turbo")
MODELS = ("tiny-llama", "tiny-vlm")
DATASET_SIZE = 64


def workload(model_name: str, vocab: int) -> tuple[Any, Any, Any]:
    """The (model, processing class, training dataset) of ``model_name``, built offline."""
    from ..tasks import arithmetic

    if model_name == "tiny-vlm":
        from ..testing.vlm import build_vlm_processor, image_dataset, tiny_vlm

        processor = build_vlm_processor()
        return tiny_vlm(processor, vocab_size=vocab), processor, image_dataset(DATASET_SIZE)
    from ..testing.models import tiny_model
    from ..testing.tokenizer import build_tokenizer

    model = tiny_model("llama", vocab_size=vocab, hidden_size=64, layers=2)
    return model, build_tokenizer(), arithmetic.load_dataset("train").select(range(DATASET_SIZE))


def build_trainer(model_name: str, vocab: int, output_dir: str, steps: int, completion_len: int,
                  callbacks: list[Any] | None = None) -> Any:
    """A GRPOTrainer of ``model_name`` on CPU for ``steps`` steps, TRL's defaults otherwise (8 completions per prompt,
    one prompt batch of 8 per step, the arithmetic task's format reward)."""
    from trl import GRPOConfig, GRPOTrainer

    from ..tasks import arithmetic

    model, processing_class, dataset = workload(model_name, vocab)
    config = GRPOConfig(output_dir=output_dir, use_cpu=True, bf16=False, report_to="none", save_strategy="no",
                        per_device_train_batch_size=8, num_generations=8, max_completion_length=completion_len,
                        max_steps=steps, logging_steps=1, seed=0)
    return GRPOTrainer(model=model, reward_funcs=[arithmetic.format_reward], args=config, train_dataset=dataset,
                       processing_class=processing_class, callbacks=callbacks)


def run_child(variant: str, model_name: str, vocab: int, steps: int, completion_len: int) -> dict[str, Any]:
    """Train ``steps`` + 1 GRPO steps in this process; return the per-step seconds (the first one dropped) and whether
    trl_turbo was patched in while training."""
    import time

    import trl_turbo

    # This child runs inside trl_turbo's package, whose import already patched TRL: stock restores TRL's own code.
    set_patched(variant == "turbo")

    import torch
    from transformers import TrainerCallback

    torch.manual_seed(0)
    times: list[float] = []

    class StepTimer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            self.start = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            times.append(time.perf_counter() - self.start)

    with tempfile.TemporaryDirectory() as out:
        build_trainer(model_name, vocab, out, steps + 1, completion_len, [StepTimer()]).train()
    timed = times[1:]
    return {"variant": variant, "patched": trl_turbo.is_patched(), "model": model_name, "vocab": vocab,
            "steps_run": len(times), "step_s_all": timed, "step_s": statistics.median(timed) if timed else None}


def run(args: argparse.Namespace) -> None:
    rows: list[dict[str, Any]] = []
    for vocab in [int(v) for v in args.vocab.split(",")]:
        samples: dict[str, list[float]] = {v: [] for v in VARIANTS}
        for _ in range(args.repeats):
            for variant in VARIANTS:
                result = subprocess.run(
                    [sys.executable, "-m", "trl_turbo.bench", "cpu-step", "--child", variant, "--model", args.model,
                     "--vocab", str(vocab), "--steps", str(args.steps), "--completion-len", str(args.completion_len)],
                    capture_output=True, text=True, check=True)
                child = json.loads(result.stdout.strip().splitlines()[-1])
                if child["patched"] != (variant == "turbo"):
                    raise RuntimeError(f"the {variant} child ran with trl_turbo patched={child['patched']}")
                samples[variant] += child["step_s_all"]
        for variant in VARIANTS:
            rows.append({"variant": variant, "model": args.model, "vocab": vocab, "completion_len": args.completion_len,
                         "ok": True, "step_s": statistics.median(samples[variant]),
                         "steps_timed": len(samples[variant]), "step_s_all": samples[variant]})
        stock, turbo = rows[-2]["step_s"], rows[-1]["step_s"]
        print(f"vocab {vocab}: stock {stock:.3f} s, turbo {turbo:.3f} s per step ({turbo / stock:.3f}x)")
    meta = metadata("cpu-step", _cpu(), {"model": args.model, "steps": args.steps, "repeats": args.repeats,
                                         "completion_len": args.completion_len})
    meta["command"] = " ".join(["python3", "-m", "trl_turbo.bench", *sys.argv[1:]])
    path = write(meta, rows, args.model, Path(args.out), series=lambda row: row["variant"],
                 panels=[("step_s", "s per GRPO step (median)")])
    print(f"wrote {path}")


def _cpu():
    import torch

    return torch.device("cpu")


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("cpu-step", help="GRPO steps of a tiny model on CPU, with and without the import")
    parser.add_argument("--model", choices=MODELS, default=MODELS[0], help="the tiny model a step trains")
    parser.add_argument("--vocab", default="151936", help="comma-separated vocabulary sizes")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per process (after one warm-up step)")
    parser.add_argument("--repeats", type=int, default=3, help="processes per variant, alternating")
    parser.add_argument("--completion-len", type=int, default=32)
    parser.add_argument("--out", default=str(DEFAULT_RESULTS_DIR), help="results folder")
    parser.add_argument("--child", choices=VARIANTS, default=None, help=argparse.SUPPRESS)
    parser.set_defaults(func=_dispatch)


def _dispatch(args: argparse.Namespace) -> None:
    if args.child is not None:
        print(json.dumps(run_child(args.child, args.model, int(args.vocab), args.steps, args.completion_len)))
    else:
        run(args)
