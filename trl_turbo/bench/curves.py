"""``python -m trl_turbo.bench curves``: GRPO learning curves of a real instruct model (SmolLM2-135M-Instruct) on the
addition task, stock TRL against trl_turbo's sampling modes, each with a colocated vLLM engine.

Design decision: the question is whether trl_turbo learns what stock TRL learns, and the answer is only as sharp as
the run-to-run noise, so stock runs with two (or more) training seeds and their spread is the noise band the other
curves are read against. Every job (a variant and a seed) is its own process on one GPU (``gpu_children``), with the
task, rewards and held-out evaluation the README's example uses (``tasks.addition``) and the variants' settings of
``bench e2e`` (one definition of "stock", "turbo", "turbo-fp8"). Two curves per job: the reward of the sampled
completions each step (TRL's own log) and greedy held-out accuracy every few steps (transformers' ``generate``, the
same evaluation for every variant).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

from . import set_patched
from .e2e import VARIANT_CONFIG
from .gpu_children import child_main, run_jobs, save_row
from .results import DEFAULT_RESULTS_DIR, finish_figure

VARIANTS = ("stock", "turbo", "turbo-fp8")
LORA = {"r": 16, "lora_alpha": 32, "target_modules": "all-linear", "task_type": "CAUSAL_LM"}
SMOOTHING_STEPS = 10
REPLIES_KEPT = 4  # greedy held-out replies kept in the row at each evaluation


def parse_jobs(text: str) -> list[tuple[str, int]]:
    """``"stock:0,stock:1,turbo:0"`` -> ``[("stock", 0), ("stock", 1), ("turbo", 0)]`` (a job without ``:seed`` has
    seed 0)."""
    jobs = []
    for item in (part.strip() for part in text.split(",")):
        if not item:
            continue
        variant, _, seed = item.partition(":")
        if variant not in VARIANTS:
            raise SystemExit(f"unknown variant {variant!r}; choose from {VARIANTS}")
        jobs.append((variant, int(seed or 0)))
    if len(set(jobs)) != len(jobs):
        raise SystemExit(f"--jobs names a (variant, seed) twice: {text}")
    return jobs


def noise_band(rows: list[dict[str, Any]], metric: str) -> dict[str, Any] | None:
    """The spread of the finished stock jobs' ``metric`` (a number per row): min, max and their gap (None: fewer than
    two)."""
    values = [row[metric] for row in rows if row.get("ok") and row.get("finished", True)
              and row["variant"] == "stock" and row.get(metric) is not None]
    if len(values) < 2:
        return None
    return {"min": min(values), "max": max(values), "width": max(values) - min(values)}


def tail_mean(values: list[float | None], count: int) -> float | None:
    """Mean of the last ``count`` present values."""
    present = [value for value in values if value is not None][-count:]
    return statistics.fmean(present) if present else None


def run(args: argparse.Namespace) -> Path:
    import torch

    from ..tasks import addition
    from .results import metadata

    jobs = parse_jobs(args.jobs)
    gpus = [gpu.strip() for gpu in args.gpus.split(",") if gpu.strip()]
    if not torch.cuda.is_available():
        raise SystemExit("the curves benchmark runs vLLM: it needs a CUDA GPU")
    model = args.model
    if model is None:
        from ..tasks import smollm2

        model = str(smollm2.checkpoint_dir())
    common = {"steps": args.steps, "eval_every": args.eval_every, "prompts": args.prompts,
              "generations": args.generations, "learning_rate": args.learning_rate, "temperature": args.temperature,
              "lora": LORA, "model": model}
    config = {**common, "max_completion": addition.MAX_COMPLETION,
              "jobs": [f"{variant}:{seed}" for variant, seed in jobs], "gpus": gpus,
              "variant_config": {variant: VARIANT_CONFIG[variant] for variant in {v for v, _ in jobs}}}
    meta = metadata("curves", torch.device("cuda", 0), config)
    specs = [{**common, "name": f"{variant}:{seed}", "variant": variant, "seed": seed} for variant, seed in jobs]
    rows = run_jobs("trl_turbo.bench.curves", specs, gpus, args.job_timeout)
    for row, spec in zip(rows, specs):
        row.setdefault("variant", spec["variant"])
        row.setdefault("seed", spec["seed"])
    summary = {"final_accuracy_band": noise_band(rows, "final_accuracy"),
               "tail_reward_band": noise_band(rows, "tail_reward")}
    meta["summary"] = summary
    stem = f"curves-smollm2-addition-{time.strftime('%Y%m%d-%H%M%S')}"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{stem}.json"
    path.write_text(json.dumps({**meta, "rows": rows}, indent=2) + "\n")
    plot(rows, f"GRPO on SmolLM2-135M-Instruct, addition ({meta['gpu']})", out / f"{stem}.png")
    for row in rows:
        print(format_row(row))
    print(f"stock noise band: {summary}")
    print(f"wrote {path} (+ .png)")
    return path


def format_row(row: dict[str, Any]) -> str:
    if not row.get("ok"):
        return f"{row.get('name')}: FAILED {row.get('error', '')[-1500:]}"
    stopped = "" if row.get("finished", True) else f" (stopped early: {str(row.get('error'))[:200]})"
    reward = "-" if row.get("tail_reward") is None else f"{row['tail_reward']:.3f}"
    return (f"{row['name']}: {row['steps_done']} steps in {row['train_s']:.0f} s{stopped}; held-out accuracy "
            f"{row['accuracy'][0][1]:.1%} -> {row['final_accuracy']:.1%}; sampled reward over the last "
            f"{SMOOTHING_STEPS} steps {reward}")


def plot(rows: list[dict[str, Any]], title: str, path: Path) -> None:
    """Left: the sampled completions' reward per step (mean over a sliding window). Right: greedy held-out accuracy.
    Stock's seeds are drawn thin in grey-blue: their spread is the noise band."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (reward_ax, accuracy_ax) = plt.subplots(1, 2, figsize=(13, 4.5))
    colours = {"stock": "C0", "turbo": "C1", "turbo-fp8": "C2"}
    for row in (r for r in rows if r.get("ok")):
        style = {"color": colours.get(row["variant"], "C3"), "linewidth": 1.0 if row["variant"] == "stock" else 1.8,
                 "linestyle": "-" if row["seed"] == 0 else "--", "label": row["name"]}
        rewards = [entry.get("reward") for entry in row["log"]]
        smooth = [tail_mean(rewards[:index + 1], SMOOTHING_STEPS) for index in range(len(rewards))]
        reward_ax.plot(range(1, len(smooth) + 1), smooth, **style)
        steps, accuracy = zip(*row["accuracy"])
        accuracy_ax.plot(steps, accuracy, marker="o", markersize=3, **style)
    reward_ax.set_ylabel(f"sampled reward (mean of the last {SMOOTHING_STEPS} steps)")
    accuracy_ax.set_ylabel("held-out accuracy (greedy, 200 sums)")
    for ax in (reward_ax, accuracy_ax):
        ax.set_xlabel("GRPO step")
    finish_figure(fig, (reward_ax, accuracy_ax), title, path)


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("curves", help="GRPO learning curves of SmolLM2-135M-Instruct: stock vs trl_turbo")
    parser.add_argument("--jobs", default="stock:0,stock:1,turbo:0,turbo-fp8:0",
                        help=f"comma-separated variant:seed, variants among {','.join(VARIANTS)}")
    parser.add_argument("--gpus", default="0", help="comma-separated GPU indices; the jobs are spread over them")
    parser.add_argument("--model", default=None, help="local checkpoint (default: SmolLM2-135M-Instruct, converted)")
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--eval-every", type=int, default=25, help="steps between held-out evaluations")
    parser.add_argument("--prompts", type=int, default=8, help="prompts per step")
    parser.add_argument("--generations", type=int, default=8, help="completions per prompt")
    parser.add_argument("--learning-rate", type=float, default=2e-4)
    parser.add_argument("--temperature", type=float, default=0.5)
    parser.add_argument("--job-timeout", type=float, default=400.0, help="seconds a job may run (it stops training "
                        "shortly before, keeping the steps done)")
    parser.add_argument("--out", default=str(DEFAULT_RESULTS_DIR), help="results folder")
    parser.set_defaults(func=run)


# ------------------------------------------------------------------------------------------------ the child
def run_job(spec: dict[str, Any], row: dict[str, Any] | None = None) -> dict[str, Any]:
    """Train one variant with one seed; the row holds TRL's log of every step and the held-out accuracy curve. The
    row (`row`, filled in place, so a failure keeps what was measured) is saved at every evaluation, and training
    stops at `spec["deadline"]`."""
    set_patched(spec["variant"] != "stock")  # this module's import patched TRL; stock runs unpatched
    from peft import LoraConfig
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from ..tasks import addition

    row = {} if row is None else row
    accuracy: list[tuple[int, float]] = []
    log: list[dict[str, float]] = []
    row.update(ok=True, variant=spec["variant"], seed=spec["seed"], steps_done=0, train_s=0.0, accuracy=accuracy,
               log=log)
    train, held_out = addition.problems()
    tokenizer = AutoTokenizer.from_pretrained(spec["model"])

    def evaluate(model: Any, step: int) -> None:
        replies = addition.greedy_replies(model, tokenizer, held_out)
        accuracy.append((step, addition.accuracy_of(replies, held_out["answer"])))
        row.setdefault("replies", []).append((step, replies[:REPLIES_KEPT]))  # what the policy has become
        row.update(steps_done=step, train_s=time.perf_counter() - train_start, final_accuracy=accuracy[-1][1],
                   tail_reward=tail_mean([entry.get("reward") for entry in log], SMOOTHING_STEPS))
        save_row(spec, row)

    class Recorder(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "reward" in logs:
                log.append({key: float(value) for key, value in logs.items() if isinstance(value, (int, float))})

        def on_step_end(self, args, state, control, model=None, **kwargs):
            if state.global_step % spec["eval_every"] == 0 or state.global_step == args.max_steps:
                evaluate(model, state.global_step)
            if time.time() > spec["deadline"]:
                control.should_training_stop = True

    config = GRPOConfig(
        output_dir=spec["output_dir"], max_steps=spec["steps"], learning_rate=spec["learning_rate"],
        per_device_train_batch_size=spec["prompts"] * spec["generations"], num_generations=spec["generations"],
        temperature=spec["temperature"], max_completion_length=addition.MAX_COMPLETION, beta=0.0,
        gradient_checkpointing=True, bf16=True, model_init_kwargs={"dtype": "bfloat16"}, logging_steps=1,
        report_to="none", save_strategy="no", seed=spec["seed"], disable_tqdm=True,
        use_vllm=True, vllm_mode="colocate", vllm_max_model_length=128, **VARIANT_CONFIG[spec["variant"]],
    )
    trainer = GRPOTrainer(model=spec["model"], processing_class=tokenizer, reward_funcs=addition.accuracy_reward,
                          args=config, train_dataset=train, peft_config=LoraConfig(**spec["lora"]))
    trainer.add_callback(Recorder())
    train_start = time.perf_counter()
    evaluate(trainer.model, 0)
    trainer.train()
    if accuracy[-1][0] != trainer.state.global_step:
        evaluate(trainer.model, trainer.state.global_step)
    return row


if __name__ == "__main__":
    child_main(run_job)
