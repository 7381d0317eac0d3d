"""``python -m trl_turbo.bench train``: peak memory and time of one GRPO training micro-step, stock TRL vs trl_turbo.

Design decision: the step is driven through the real ``GRPOTrainer.compute_loss`` + ``backward()`` on a synthetic
batch shaped like the output of ``_generate_and_score_completions`` (random prompt/completion ids, no padding), so
generation and reward scoring — identical for both variants — are left out, and the measurement is exactly the part
trl_turbo changes. The model (random init, real shape, bf16, LoRA r=16 on all linear layers, non-reentrant gradient
checkpointing) is built once, directly on the device; a fresh ``GRPOTrainer`` is built for every (variant, length)
so TRL's init-time model patching (the fused LM head) runs under the patch state being measured. With ``--tis``, the
vLLM importance-sampling correction is simulated: stock TRL then needs a no-grad forward for ``old_per_token_logps``
at generation time, which is counted in the step here, because trl_turbo may skip it. Under a launch of several
GPUs (``--launch fsdp2``) whole steps run instead, through `train_launched`.
"""

from __future__ import annotations

import argparse
import math
import statistics
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import torch

from ..offload.install import runtime_of
from ..patches import trl_internals
from ..planning.shapes import QUANTIZATIONS, SHAPES, build_config
from . import (
    fmt,
    free_memory,
    memory_allocated,
    parse_lengths,
    parse_turbo_overrides,
    peak_allocated,
    reset_peak,
    resolve_device,
    set_patched,
    synchronize,
)
from .gpu_children import SINGLE_GPU
from .results import DEFAULT_RESULTS_DIR, GIB, metadata, write
from .synthetic import synthetic_inputs

# Config each variant adds to GRPOConfig; stock runs first, with trl_turbo unpatched. Each trainer built on the
# shared model first removes what an earlier one installed, so every variant runs exactly its own features.
VARIANT_CONFIG: dict[str, dict[str, Any]] = {
    "stock": {},
    "turbo-loss": {"turbo_offload_checkpoints": False, "turbo_tiled_mlp": False},
    "turbo": {"turbo_liger_layers": False},  # every other default; Liger's share is measured by turbo-liger
    "turbo-min": {"turbo_liger_layers": False, "turbo_memory_plan": "min"},  # the most frugal memory plan
    "turbo-liger": {"turbo_liger_layers": True},
}
VARIANTS = tuple(VARIANT_CONFIG)


def variant_config(variant: str, forward_token_budget: int | None = None,
                   overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """The GRPOConfig fields `variant` adds; a `forward_token_budget` splits the turbo variants' micro-batches into
    sequence groups of at most that many tokens, and `overrides` (`--turbo-set`) go to the turbo variants too (stock
    has no such fields)."""
    config = dict(VARIANT_CONFIG[variant])
    if variant != "stock":
        if forward_token_budget is not None:
            config["turbo_forward_token_budget"] = forward_token_budget
        config.update(overrides or {})
    return config


def build_model(shape: str, device: torch.device, lora_r: int = 16, quantization: str = "none") -> torch.nn.Module:
    """Random-init bf16 model of ``shape`` built on ``device`` (with a quantization: saved, then reloaded through
    bitsandbytes, as a user loads a checkpoint), wrapped in LoRA, in train mode with checkpointing."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    config = build_config(shape)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16, attn_implementation="sdpa")
    if QUANTIZATIONS[quantization]:
        with tempfile.TemporaryDirectory() as checkpoint:
            model.save_pretrained(checkpoint)
            del model
            free_memory(device)
            model = AutoModelForCausalLM.from_pretrained(
                checkpoint, dtype=torch.bfloat16, attn_implementation="sdpa", device_map={"": str(device)},
                quantization_config=BitsAndBytesConfig(**QUANTIZATIONS[quantization]))
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.enable_input_require_grads()
    lora = LoraConfig(r=lora_r, lora_alpha=lora_r, target_modules="all-linear", task_type="CAUSAL_LM")
    model = get_peft_model(model, lora)
    model.train()
    return model


def _zero_reward(completions: list[Any], **_: Any) -> list[float]:
    return [0.0] * len(completions)


def build_trainer(model: torch.nn.Module, micro_batch: int, completion_len: int, device: torch.device,
                  output_dir: str, tis: bool, variant_config: dict[str, Any] | None = None) -> Any:
    """A ``GRPOTrainer`` (DAPO loss, beta 0) around ``model``; with ``tis`` it believes its samples came from vLLM."""
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from trl_turbo.testing.tokenizer import build_tokenizer

    # TRL wraps `forward` of the base model in an instance attribute; drop the previous trainer's wrapper so that
    # each trainer patches the plain class forward, as it would in a fresh process.
    model.get_base_model().__dict__.pop("forward", None)
    args = GRPOConfig(
        output_dir=output_dir,
        beta=0.0,
        loss_type="dapo",
        bf16=device.type == "cuda",
        use_cpu=device.type == "cpu",
        gradient_checkpointing=True,
        gradient_checkpointing_kwargs={"use_reentrant": False},
        per_device_train_batch_size=micro_batch,
        # GRPO needs >= 2 generations per prompt: a micro-batch of 1 is half of a 2-sequence generation batch
        num_generations=max(2, micro_batch),
        steps_per_generation=max(2, micro_batch) // micro_batch,
        max_completion_length=completion_len,
        report_to="none",
        save_strategy="no",
        **(variant_config or {}),
    )
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=_zero_reward,
        args=args,
        train_dataset=Dataset.from_dict({"prompt": ["1+1="] * micro_batch}),
        processing_class=build_tokenizer(),
    )
    trainer.current_gradient_accumulation_steps = 1
    trainer.model.train()
    if tis:
        # Set after construction: `use_vllm=True` in the config would start a vLLM engine
        trainer.use_vllm = True
        trainer.vllm_importance_sampling_correction = True
    return trainer


def importance_sampling_ratio(trainer: Any, old_logps: torch.Tensor, sampling_logps: torch.Tensor,
                              mask: torch.Tensor) -> torch.Tensor:
    """TRL 1.16's vLLM IS ratio (``_generate_and_score_completions``) for the trainer's mode and clip bounds."""
    mode = trainer.vllm_importance_sampling_mode
    diff = torch.nan_to_num((old_logps - sampling_logps) * mask, nan=0.0)
    if mode in ("sequence_mask", "sequence_truncate"):
        diff = diff.sum(dim=-1, keepdim=True)
    ratio = torch.exp(diff)
    low, high = trainer.vllm_importance_sampling_clip_min, trainer.vllm_importance_sampling_clip_max
    if mode.endswith("_truncate"):
        return torch.clamp(ratio, min=low, max=high)
    low = -math.inf if low is None else low
    high = math.inf if high is None else high
    return ratio.masked_fill((ratio < low) | (ratio > high), 0.0)


def old_logps_pass(trainer: Any, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """What stock TRL runs at generation time under TIS: a no-grad forward for the old log-probs, then the IS ratio."""
    from trl.models.utils import disable_gradient_checkpointing

    input_ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
    attention_mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
    with torch.no_grad(), disable_gradient_checkpointing(trainer.model, trainer.args.gradient_checkpointing_kwargs):
        old = trl_internals.per_token_logps(
            trainer,
            trainer.model,
            input_ids,
            attention_mask,
            inputs["completion_ids"].size(1),
            batch_size=trainer.args.per_device_train_batch_size,
        )
        ratio = importance_sampling_ratio(trainer, old, inputs["sampling_per_token_logps"], inputs["completion_mask"])
    return {"old_per_token_logps": old, "importance_sampling_ratio": ratio}


def turbo_needs_old_logps_pass(trainer: Any) -> bool:
    try:
        from trl_turbo.grpo.step_plan import needs_old_logps_forward
    except ImportError:
        return True
    return bool(needs_old_logps_forward(trainer))


def train_step(trainer: Any, inputs: dict[str, torch.Tensor], with_old_pass: bool) -> None:
    """One micro-step as measured: [old-logps pass +] ``compute_loss`` + ``backward``; gradients land in the model."""
    step_inputs = dict(inputs)
    if with_old_pass:
        step_inputs.update(old_logps_pass(trainer, inputs))
    with trainer.compute_loss_context_manager():
        loss = trainer.compute_loss(trainer.model, step_inputs)
    loss.backward()


def measure(trainer: Any, inputs: dict[str, torch.Tensor], with_old_pass: bool, device: torch.device,
            steps: int, warmup: int = 1) -> dict[str, float | None]:
    """Run ``warmup`` untimed micro-steps, then time ``steps``; peak/static memory of the timed steps (GiB, CUDA
    only). Without warm-up the first step's time includes one-off costs (kernel compilation, host buffers)."""
    model = trainer.model
    for _ in range(warmup):
        train_step(trainer, inputs, with_old_pass)
    model.zero_grad(set_to_none=True)
    synchronize(device)
    static = memory_allocated(device)
    reset_peak(device)
    times = []
    for _ in range(steps):
        model.zero_grad(set_to_none=True)
        synchronize(device)
        start = time.perf_counter()
        train_step(trainer, inputs, with_old_pass)
        synchronize(device)
        times.append(time.perf_counter() - start)
    peak = peak_allocated(device)
    model.zero_grad(set_to_none=True)
    return {
        "peak_gib": None if peak is None else peak / GIB,
        "static_gib": None if static is None else static / GIB,
        "step_s": statistics.median(times),
    }


def run_length(model: torch.nn.Module, variant: str, completion_len: int, args: argparse.Namespace,
               device: torch.device, output_dir: str) -> dict[str, Any]:
    """Build a trainer for one completion length under the current patch state and measure it; errors become rows."""
    row: dict[str, Any] = {
        "variant": variant,
        "shape": args.shape,
        "quantization": args.quantization,
        "micro_batch": args.micro_batch,
        "prompt_len": args.prompt_len,
        "completion_len": completion_len,
        "tis": args.tis,
        "ok": False,
        "error": None,
        "old_logps_pass": None,
        "peak_gib": None,
        "static_gib": None,
        "step_s": None,
        "tokens_per_s": None,
    }
    try:
        fields = variant_config(variant, args.forward_token_budget, parse_turbo_overrides(args.turbo_set))
        trainer = build_trainer(model, args.micro_batch, completion_len, device, output_dir, args.tis, fields)
        inputs = synthetic_inputs(args.micro_batch, args.prompt_len, completion_len, SHAPES[args.shape]["vocab_size"],
                                  device, args.tis)
        row["old_logps_pass"] = args.tis and (variant == "stock" or turbo_needs_old_logps_pass(trainer))
        row.update(measure(trainer, inputs, row["old_logps_pass"], device, args.steps, args.warmup))
        row["ok"] = True
        row["tokens_per_s"] = args.micro_batch * (args.prompt_len + completion_len) / row["step_s"]
        runtime = runtime_of(trainer.model)
        if runtime is not None and runtime.offloader is not None:
            stats = runtime.offloader.take_stats()  # summed over warm-up and timed steps
            row["offloaded_gib"] = stats.offloaded_bytes / GIB
            row["host_peak_gib"] = stats.host_bytes_peak / GIB
            row["copy_wait_s"] = stats.wait_s
    except torch.OutOfMemoryError:
        row["error"] = "OOM"
    except Exception as exc:  # recorded, so one broken variant does not lose the rest of a long GPU run
        traceback.print_exc()
        row["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        model.zero_grad(set_to_none=True)
    return row


def run(args: argparse.Namespace) -> Path:
    device = resolve_device(args.device)
    lengths = parse_lengths(args.lengths)
    variants = [variant.strip() for variant in args.variants.split(",") if variant.strip()]
    unknown = set(variants) - set(VARIANTS)
    if unknown:
        raise SystemExit(f"unknown variants {sorted(unknown)}; choose from {VARIANTS}")
    variants.sort(key=VARIANTS.index)  # stock first: it runs with the patches removed
    overrides = parse_turbo_overrides(args.turbo_set)
    if args.forward_token_budget is not None and "turbo_forward_token_budget" in overrides:
        raise SystemExit("--forward-token-budget and --turbo-set turbo_forward_token_budget: give one of them")
    for variant in variants:
        clash = sorted(set(overrides) & set(VARIANT_CONFIG[variant]))
        if clash and variant != "stock":
            raise SystemExit(f"--turbo-set {', '.join(clash)}: the variant {variant!r} sets this itself")
    if args.side_by_side and args.launch == SINGLE_GPU:
        raise SystemExit("--side-by-side runs launched variants at once: add --launch fsdp2 (or another config)")
    if args.profile_step and args.launch == SINGLE_GPU:
        raise SystemExit("--profile-step profiles a launched row's whole step: add --launch fsdp2 (or another config)")
    if args.launch != SINGLE_GPU:
        from . import train_launched

        configs = {variant: variant_config(variant, args.forward_token_budget, overrides) for variant in variants}
        return train_launched.run(args, lengths, variants, configs)
    config = {
        "shape": args.shape,
        "model_config": SHAPES[args.shape],
        "micro_batch": args.micro_batch,
        "prompt_len": args.prompt_len,
        "lengths": lengths,
        "variants": variants,
        "tis": args.tis,
        "forward_token_budget": args.forward_token_budget,
        "turbo_set": overrides,
        "steps": args.steps,
        "warmup": args.warmup,
        "lora": {"r": 16, "alpha": 16, "target_modules": "all-linear"},
        "quantization": {key: str(value) for key, value in QUANTIZATIONS[args.quantization].items()} or None,
        "loss_type": "dapo",
        "beta": 0.0,
        "gradient_checkpointing": "non-reentrant",
        "attn_implementation": "sdpa",
        "dtype": "bfloat16",
        "device": str(device),
    }
    meta = metadata("train", device, config)
    torch.manual_seed(0)
    model = build_model(args.shape, device, quantization=args.quantization)
    rows: list[dict[str, Any]] = []
    quantized = "" if args.quantization == "none" else f"-{args.quantization}"
    stem = f"train-{args.shape}{quantized}-{time.strftime('%Y%m%d-%H%M%S')}"
    panels = (("peak_gib", "peak memory (GiB)"), ("step_s", "step time (s)"))
    with tempfile.TemporaryDirectory() as output_dir:
        for variant in variants:
            set_patched(variant != "stock")
            for completion_len in lengths:
                row = run_length(model, variant, completion_len, args, device, output_dir)
                free_memory(device)  # the trainer, inputs and activations of that length are unreferenced now
                rows.append(row)
                print(_format_row(row), flush=True)
                # Saved after every row: a run cut short by a time limit keeps what it measured
                path = write(meta, rows, args.shape, Path(args.out), series=_series, panels=panels, stem=stem)
                if not row["ok"]:
                    break  # longer completions of this variant would fail too
    print(f"wrote {path} (+ .png)")
    return path


def _series(row: dict[str, Any]) -> str:
    return f"{row['variant']}{' +TIS' if row['tis'] else ''}"


def _format_row(row: dict[str, Any]) -> str:
    status = "ok" if row["ok"] else row["error"]
    return (
        f"{row['variant']:>6} B={row['micro_batch']} P={row['prompt_len']} L={row['completion_len']:>6} "
        f"tis={int(row['tis'])} old_pass={int(bool(row['old_logps_pass']))} {status:>3}  "
        f"peak={fmt(row['peak_gib'], '7.2f')} GiB  static={fmt(row['static_gib'], '6.2f')} GiB  "
        f"step={fmt(row['step_s'], '7.3f')} s  {fmt(row['tokens_per_s'], '9.0f')} tok/s"
    )


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive number of tokens, got {value}")
    return value


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("train", help="GRPO micro-step (compute_loss + backward) of a real model shape")
    parser.add_argument("--shape", required=True, choices=sorted(SHAPES))
    parser.add_argument("--micro-batch", type=int, default=8, help="sequences per micro-step (= num_generations)")
    parser.add_argument("--lengths", default="2048,8192,20480", help="comma-separated completion lengths")
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--variants", default="stock,turbo", help=f"comma-separated, among {','.join(VARIANTS)}")
    parser.add_argument("--tis", action="store_true", help="simulate vLLM importance-sampling correction")
    parser.add_argument("--quantization", default="none", choices=sorted(QUANTIZATIONS),
                        help="nf4: QLoRA (bitsandbytes 4-bit NF4, double quantization, bf16 compute)")
    parser.add_argument("--forward-token-budget", type=_positive_int, default=None,
                        help="turbo variants: sequence groups of at most this many tokens (turbo_forward_token_budget)")
    parser.add_argument("--turbo-set", action="append", default=[], metavar="FIELD=VALUE",
                        help="a trl_turbo GRPOConfig field for the turbo variants (repeatable), e.g. "
                             "turbo_training_memory_gib=25")
    parser.add_argument("--steps", type=int, default=1, help="timed micro-steps after the warm-up (median reported)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed micro-steps first (0 for longest-length probes)")
    parser.add_argument("--out", default=str(DEFAULT_RESULTS_DIR), help="results folder")
    parser.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    parser.add_argument("--launch", default=SINGLE_GPU,
                        help="1gpu, or one of TRL's accelerate configs (fsdp2, ...): whole steps on --processes GPUs")
    parser.add_argument("--processes", type=int, default=2, help="GPUs of a --launch other than 1gpu")
    parser.add_argument("--checkpoint", default=None,
                        help="--launch: where the random-init checkpoint is saved (reused)")
    parser.add_argument("--variant-timeout", type=float, default=1200.0,
                        help="--launch: seconds before a variant is stopped")
    parser.add_argument("--side-by-side", action="store_true",
                        help="--launch: every variant at once, each on --processes GPUs of its own")
    parser.add_argument("--profile-step", action="store_true",
                        help="--launch: one more step under the profiler, after the timed ones (allow for it in "
                             "--variant-timeout): each stream's busy time, and what the compute stream waited behind")
    parser.set_defaults(func=run)
