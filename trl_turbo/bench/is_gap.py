"""``python -m trl_turbo.bench is-gap``: the sampler/trainer gap at long completions on a real model, and what TRL's
importance-sampling modes make of it (how much of a batch each masks or truncates).

Design decision: the gap is a property of the tokens sampled, not of the IS mode that then weighs them, so each job
records every completion's per-token log-ratio log(π_trainer/π_sampler) once, over the first steps of a real GRPO
run (SmolLM2-135M-Instruct writing essays of up to 2048 tokens, sampled at TRL's default temperature 1.0), and every
mode's verdict is computed from those same ratios (:func:`is_statistics`, pure): the token modes see each token's
ratio, the sequence modes the product over a completion (and trl_turbo's geometric modes its per-token geometric
mean), each against TRL's bounds. Prefixes of 256 to 2048 tokens show how the sequence product degrades with length.
The ratios are read where each trainer has both log-probs: stock TRL's batch (``_generate_and_score_completions``'s
output) and trl_turbo's loss (its raw IS diagnostics), through scoped registry patches that change nothing.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path
from typing import Any

import torch

from .. import losses
from . import set_patched
from .e2e import VARIANT_CONFIG
from .gpu_children import child_main, run_jobs
from .results import DEFAULT_RESULTS_DIR, finish_figure

VARIANTS = ("stock", "turbo", "turbo-fp8", "turbo-fp8-bf16-kv")
# fp8 weights with the model's own KV dtype: tells the fp8 weights' share of the gap from the fp8 KV cache's
_EXTRA_VARIANTS = {"turbo-fp8-bf16-kv": {key: value for key, value in VARIANT_CONFIG["turbo-fp8"].items()
                                         if key != "turbo_vllm_kv_cache_dtype"}}
TOPICS = ("the history of the printing press", "how bridges are built", "the water cycle", "the life of bees",
          "the invention of the telephone", "why the sky is blue", "the Roman Empire", "how computers store numbers",
          "the migration of birds", "volcanoes", "the first moon landing", "how bread is made",
          "the oceans' tides", "the game of chess", "rainforests", "the human heart")
PREFIXES = (256, 512, 1024, 2048)
QUANTILES = (0.001, 0.01, 0.05, 0.25, 0.5, 0.75, 0.95, 0.99, 0.999)


def variant_config(variant: str) -> dict[str, Any]:
    return dict(_EXTRA_VARIANTS.get(variant) or VARIANT_CONFIG[variant])


def _quantiles(values: torch.Tensor) -> dict[str, float]:
    if values.numel() == 0:
        return {}
    points = torch.quantile(values.double(), torch.tensor(QUANTILES, dtype=torch.float64))
    return {f"q{q:g}": float(v) for q, v in zip(QUANTILES, points)}


def _padded(log_ratios: list[torch.Tensor], length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The first ``length`` log-ratios of each completion at least that long, as (B, length) with an all-ones mask."""
    rows = [r[:length].double() for r in log_ratios if r.numel() >= length]
    values = torch.stack(rows) if rows else torch.zeros(0, length, dtype=torch.float64)
    return values, torch.ones_like(values)


def mode_effect(log_ratios: torch.Tensor, mask: torch.Tensor, mode: str, clip_min: float | None,
                clip_max: float | None) -> dict[str, float]:
    """What a mode does to its units (tokens, or completions): trl_turbo's implementation of TRL's IS modes
    (`losses`) applied to these log-ratios. ``changed``: the share it masks or truncates; ``mean_weight``: the mean
    weight it gives; ``ess_fraction``: the effective sample size of those weights, (Σw)² / (n Σw²), as a share of
    the units (1: every unit counts fully); ``negligible``: the share weighted below 0.1, as good as dropped."""
    sampler = torch.zeros_like(log_ratios)
    raw = losses.raw_importance_sampling_ratio(log_ratios, sampler, mask, mode)
    applied = losses.vllm_importance_sampling_ratio(log_ratios, sampler, mask, mode, clip_min, clip_max)
    units = mask.bool() if mode.startswith("token") else torch.ones_like(applied, dtype=torch.bool)
    weights, changed = applied[units], (applied != raw)[units]
    if not weights.numel():
        return {}
    squares = (weights * weights).sum()
    return {"changed": float(changed.double().mean()), "mean_weight": float(weights.mean()),
            "ess_fraction": float(weights.sum() ** 2 / (weights.numel() * squares)) if squares > 0 else 0.0,
            "negligible": float((weights < 0.1).double().mean())}


def is_statistics(log_ratios: list[torch.Tensor], clip_min: float | None = None, clip_max: float | None = 3.0,
                  prefixes: tuple[int, ...] = PREFIXES) -> dict[str, Any]:
    """What every IS mode of TRL (and trl_turbo's geometric ones) does with these completions.

    ``log_ratios``: one 1-D tensor per completion, its tokens' log(π_trainer/π_sampler) in order. Returns the token
    ratios' quantiles, the mean |log-ratio| and the k3 KL estimate per token; and per prefix length L (over the
    completions at least L tokens long): the quantiles of the sequence log-ratio (sum over L tokens) and, per mode,
    what it does to its units at [clip_min, clip_max] (:func:`mode_effect`).
    """
    tokens = torch.cat([r.double() for r in log_ratios]) if log_ratios else torch.zeros(0, dtype=torch.float64)
    stats: dict[str, Any] = {
        "completions": len(log_ratios), "tokens": int(tokens.numel()),
        "mean_length": tokens.numel() / max(1, len(log_ratios)),
        "clip_min": clip_min, "clip_max": clip_max,
    }
    if tokens.numel():
        stats["mean_abs_log_ratio"] = float(tokens.abs().mean())
        stats["k3_kl"] = float((tokens.exp() - tokens - 1).mean())
        stats["token_ratio_quantiles"] = _quantiles(tokens.exp())
    by_prefix = {}
    for length in prefixes:
        values, mask = _padded(log_ratios, length)
        if not values.shape[0]:
            continue
        by_prefix[str(length)] = {
            "completions": values.shape[0],
            "sequence_log_ratio_quantiles": _quantiles(values.sum(-1)),
            "geometric_log_ratio_quantiles": _quantiles(values.mean(-1)),
            "modes": {mode: mode_effect(values, mask, mode, clip_min, clip_max) for mode in losses.IS_MODES},
        }
    stats["by_prefix"] = by_prefix
    return stats


def histograms(log_ratios: list[torch.Tensor], longest: int) -> dict[str, Any]:
    """Counts of the token log-ratios over [-2, 2] and of the full-length sequences' log-ratios over [-40, 40]."""
    tokens = torch.cat([r.double() for r in log_ratios]) if log_ratios else torch.zeros(0, dtype=torch.float64)
    sums = torch.tensor([float(r.double().sum()) for r in log_ratios if r.numel() >= longest], dtype=torch.float64)
    token_edges = torch.linspace(-2, 2, 81, dtype=torch.float64)
    sequence_edges = torch.linspace(-40, 40, 81, dtype=torch.float64)
    return {"token_edges": token_edges.tolist(),
            "token_counts": torch.histogram(tokens.clamp(-2, 2), token_edges).hist.tolist(),
            "sequence_edges": sequence_edges.tolist(),
            "sequence_counts": torch.histogram(sums.clamp(-40, 40), sequence_edges).hist.tolist()}


def completion_log_ratios(trainer_logps: torch.Tensor, sampling_logps: torch.Tensor,
                          mask: torch.Tensor) -> list[torch.Tensor]:
    """Each row's log(π_trainer/π_sampler) over its completion tokens (tokens vLLM gave no log-prob for are left
    out, as TRL counts them as ratio 1)."""
    difference = (trainer_logps.detach().float() - sampling_logps.detach().float()).cpu()
    keep = (mask.bool() & ~torch.isnan(sampling_logps)).cpu()
    return [row[row_keep] for row, row_keep in zip(difference, keep)]


# ------------------------------------------------------------------------------------------------ the driver
def run(args: argparse.Namespace) -> Path:
    from .results import metadata

    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    if set(variants) - set(VARIANTS):
        raise SystemExit(f"unknown variants {sorted(set(variants) - set(VARIANTS))}; choose from {VARIANTS}")
    if not torch.cuda.is_available():
        raise SystemExit("the is-gap benchmark runs vLLM: it needs a CUDA GPU")
    model = args.model
    if model is None:
        from ..tasks import smollm2

        model = str(smollm2.checkpoint_dir())
    common = {"model": model, "steps": args.steps, "completion_len": args.completion_len, "prompts": args.prompts,
              "generations": args.generations, "micro_batch": args.micro_batch}
    config = {**common, "variants": variants, "variant_config": {v: variant_config(v) for v in variants},
              "temperature": 1.0, "ignore_eos": True, "clip_max": 3.0, "clip_min": None}
    meta = metadata("is-gap", torch.device("cuda", 0), config)
    gpus = [gpu.strip() for gpu in args.gpus.split(",") if gpu.strip()]
    rows = run_jobs("trl_turbo.bench.is_gap", [{**common, "name": v, "variant": v} for v in variants], gpus,
                    args.job_timeout)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"is-gap-smollm2-{args.completion_len}-{time.strftime('%Y%m%d-%H%M%S')}"
    path = out / f"{stem}.json"
    path.write_text(json.dumps({**meta, "rows": rows}, indent=2) + "\n")
    plot(rows, f"sampler/trainer log-ratios, SmolLM2-135M-Instruct, {args.completion_len}-token completions "
               f"({meta['gpu']})", out / f"{stem}.png")
    for row in rows:
        print(format_row(row))
    print(f"wrote {path} (+ .png)")
    return path


def format_row(row: dict[str, Any]) -> str:
    if not row.get("ok"):
        return f"{row.get('name')}: FAILED {str(row.get('error'))[-1500:]}"
    stats = row["statistics"]
    prefixes = "; ".join(
        f"L={length}: " + ", ".join(f"{mode} {p['modes'][mode]['changed']:.1%} changed, ESS "
                                    f"{p['modes'][mode]['ess_fraction']:.0%}"
                                    for mode in ("sequence_mask", "sequence_geometric_mask", "token_truncate"))
        for length, p in stats["by_prefix"].items())
    return (f"{row['name']}: {stats['completions']} completions, "
            f"mean |log r| {stats.get('mean_abs_log_ratio', 0):.4f}, "
            f"k3 KL {stats.get('k3_kl', 0):.2e}; {prefixes}")


def plot(rows: list[dict[str, Any]], title: str, path: Path) -> None:
    """Left: token log-ratio histogram per variant. Right: full-length sequence log-ratio histogram, with log(C_max)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (token_ax, sequence_ax) = plt.subplots(1, 2, figsize=(13, 4.5))
    for row in (r for r in rows if r.get("ok")):
        histogram = row["histograms"]
        for ax, key in ((token_ax, "token"), (sequence_ax, "sequence")):
            edges, counts = histogram[f"{key}_edges"], histogram[f"{key}_counts"]
            total = sum(counts) or 1
            ax.stairs([c / total for c in counts], edges, label=row["name"])
    sequence_ax.axvline(math.log(3.0), color="black", linestyle=":", linewidth=1, label="log 3 (TRL's C_max)")
    token_ax.set_yscale("log")
    token_ax.set_xlabel("token log(π_trainer / π_sampler)")
    sequence_ax.set_xlabel("full-length completion: sum of token log-ratios")
    for ax in (token_ax, sequence_ax):
        ax.set_ylabel("fraction")
    finish_figure(fig, (token_ax, sequence_ax), title, path)


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("is-gap", help="sampler/trainer gap and IS masking at long completions, "
                                                  "SmolLM2-135M-Instruct")
    parser.add_argument("--variants", default="turbo,turbo-fp8", help=f"comma-separated, among {','.join(VARIANTS)}")
    parser.add_argument("--gpus", default="0", help="comma-separated GPU indices; the jobs are spread over them")
    parser.add_argument("--model", default=None, help="local checkpoint (default: SmolLM2-135M-Instruct, converted)")
    parser.add_argument("--steps", type=int, default=3, help="GRPO steps whose completions are recorded")
    parser.add_argument("--completion-len", type=int, default=2048)
    parser.add_argument("--prompts", type=int, default=8, help="prompts per step")
    parser.add_argument("--generations", type=int, default=8, help="completions per prompt")
    parser.add_argument("--micro-batch", type=int, default=16)
    parser.add_argument("--job-timeout", type=float, default=400.0)
    parser.add_argument("--out", default=str(DEFAULT_RESULTS_DIR), help="results folder")
    parser.set_defaults(func=run)


# ------------------------------------------------------------------------------------------------ the child
def distinct_words_reward(completions: list[Any], **kwargs: Any) -> list[float]:
    """Share of distinct words in the reply: a reward with some spread, so the steps recorded are ordinary GRPO
    steps (advantages not all zero)."""
    from ..tasks.arithmetic import completion_text

    texts = [completion_text(c).split() for c in completions]
    return [len(set(words)) / max(1, len(words)) for words in texts]


def run_job(spec: dict[str, Any], row: dict[str, Any] | None = None) -> dict[str, Any]:
    """Three recorded GRPO steps of one variant; `row` (filled in place) gets the statistics of every recorded
    completion's log-ratios and their histograms."""
    set_patched(spec["variant"] != "stock")  # this module's import patched TRL; stock runs unpatched
    import datasets
    from peft import LoraConfig
    from transformers import AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from .. import registry
    from .curves import LORA

    recorded: list[torch.Tensor] = []
    tokenizer = AutoTokenizer.from_pretrained(spec["model"])
    prompts = [{"prompt": [{"role": "user", "content": f"Write a long, detailed essay about {topic}."}]}
               for topic in TOPICS]
    batch = spec["prompts"] * spec["generations"]
    config = GRPOConfig(
        output_dir=spec["output_dir"], max_steps=spec["steps"], learning_rate=1e-5,
        per_device_train_batch_size=spec["micro_batch"], gradient_accumulation_steps=batch // spec["micro_batch"],
        num_generations=spec["generations"], max_completion_length=spec["completion_len"], beta=0.0,
        gradient_checkpointing=True, bf16=True, model_init_kwargs={"dtype": "bfloat16"}, logging_steps=1,
        report_to="none", save_strategy="no", seed=0, disable_tqdm=True, generation_kwargs={"ignore_eos": True},
        use_vllm=True, vllm_mode="colocate", vllm_max_model_length=spec["completion_len"] + 128,
        **variant_config(spec["variant"]),
    )
    trainer = GRPOTrainer(model=spec["model"], processing_class=tokenizer, reward_funcs=distinct_words_reward,
                          args=config, train_dataset=datasets.Dataset.from_list(prompts),
                          peft_config=LoraConfig(**LORA))
    if spec["variant"] == "stock":
        generate_and_score = trainer._generate_and_score_completions

        def recording_batch(*args: Any, **kwargs: Any) -> dict[str, Any]:
            output = generate_and_score(*args, **kwargs)
            recorded.extend(completion_log_ratios(output["old_per_token_logps"], output["sampling_per_token_logps"],
                                                  output["completion_mask"]))
            return output

        scope = registry.scoped(trainer, "_generate_and_score_completions", recording_batch)
    else:
        diagnostics = losses.importance_sampling_diagnostics

        def recording_diagnostics(trainer_logps, sampling_logps, mask, *rest):
            recorded.extend(completion_log_ratios(trainer_logps, sampling_logps, mask))
            return diagnostics(trainer_logps, sampling_logps, mask, *rest)

        scope = registry.scoped(losses, "importance_sampling_diagnostics", recording_diagnostics)
    start = time.perf_counter()
    with scope:
        trainer.train()
    row = {} if row is None else row
    row.update(ok=True, variant=spec["variant"], train_s=time.perf_counter() - start,
               statistics=is_statistics(recorded, trainer.vllm_importance_sampling_clip_min,
                                        trainer.vllm_importance_sampling_clip_max),
               histograms=histograms(recorded, spec["completion_len"]))
    return row


if __name__ == "__main__":
    child_main(run_job)
