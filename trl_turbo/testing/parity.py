"""Parity harness: the same seeded GRPO computation with stock TRL and with trl_turbo.

Design: two levels, both reused by later features with their switch on.
- `run_training` runs real GRPOTrainer steps (generation, rewards, loss, optimizer) on a tiny model (or a real one
  through `model_loader`) and records, per optimizer step, the loss, every trainable parameter's gradient and value
  and the sampled completions. Stock runs happen with trl_turbo unpatched (`variant="stock"`), so the comparison is
  against TRL itself, not against our switches.
- `loss_and_grads` evaluates one trainer's `_compute_loss` on a hand-built batch with the fused loss on or off, which
  lets tests cover option grids (vLLM IS modes, reference log-probs, ...) that a CPU training run cannot reach.
"""

from __future__ import annotations

import contextlib
import functools
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

import trl_turbo
from trl_turbo.patches import trl_internals
from trl_turbo.tasks import arithmetic
from trl_turbo.testing.models import tiny_model
from trl_turbo.testing.tokenizer import VOCAB, build_tokenizer


@contextlib.contextmanager
def patch_state(variant: str) -> Iterator[None]:
    """`variant="stock"`: TRL exactly as shipped for the duration; `"turbo"`: trl_turbo patched."""
    if variant not in ("stock", "turbo"):
        raise ValueError(f"variant must be 'stock' or 'turbo', got {variant!r}")
    was_patched = trl_turbo.is_patched()
    if variant == "stock":
        trl_turbo.unpatch()
    else:
        trl_turbo.patch()
    try:
        yield
    finally:
        if was_patched:
            trl_turbo.patch()
        else:
            trl_turbo.unpatch()


# Every trl_turbo switch off: the patched trainer must then be stock TRL, bit for bit.
ALL_FEATURES_OFF: dict[str, Any] = {
    "turbo_fused_loss": False,
    "turbo_reuse_policy_logps": False,
    "turbo_memory_plan": "off",
    "turbo_offload_checkpoints": False,
    "turbo_tiled_mlp": False,
    "turbo_lean_norms": False,
    "turbo_forward_token_budget": None,
    "turbo_vllm_match_precision": False,
}


def base_config_kwargs(output_dir: str, **overrides: Any) -> dict[str, Any]:
    """Small, CPU-friendly GRPOConfig arguments shared by the parity tests."""
    kwargs: dict[str, Any] = {
        "output_dir": output_dir,
        "per_device_train_batch_size": 4,
        "num_generations": 4,
        "max_completion_length": 8,
        "learning_rate": 1e-2,
        # SGD keeps parameter updates linear in the gradients; Adam's first step (lr * g / |g|) turns float-level
        # gradient differences on near-zero entries into lr-sized parameter differences.
        "optim": "sgd",
        "bf16": False,
        "use_cpu": True,
        "report_to": "none",
        "logging_steps": 1,
        "save_strategy": "no",
        "seed": 0,
        "data_seed": 0,
        "gradient_checkpointing": False,
        "dataloader_num_workers": 0,
    }
    kwargs.update(overrides)
    return kwargs


@dataclass
class StepRecord:
    loss: float
    grads: dict[str, torch.Tensor] = field(default_factory=dict)
    params: dict[str, torch.Tensor] = field(default_factory=dict)
    logs: dict[str, float] = field(default_factory=dict)  # what the trainer logged for the step
    completion_ids: list[list[int]] = field(default_factory=list)  # the completions the step trained on


def build_trainer(
    config_kwargs: dict[str, Any],
    *,
    arch: str = "llama",
    peft: bool = False,
    reward_funcs: list[Callable] | None = None,
    model_kwargs: dict[str, Any] | None = None,
    config_cls: type | None = None,
    trainer_cls: type | None = None,
    quantization: dict[str, Any] | None = None,
    model_loader: Callable[[], tuple[torch.nn.Module, Any]] | None = None,
):
    """A GRPOTrainer (or `trainer_cls`, configured by `config_cls`, e.g. TRL's GMPOTrainer) on a tiny `arch` model,
    the testbed tokenizer and the shipped arithmetic data. `quantization`: `BitsAndBytesConfig` arguments; the model
    is then saved and reloaded quantized (QLoRA with `peft=True`). `model_loader`: returns a model and its tokenizer
    to train in place of the tiny model and the testbed tokenizer (e.g. `trl_turbo.tasks.smollm2.load`)."""
    from trl import GRPOConfig, GRPOTrainer

    config_cls = config_cls or GRPOConfig
    trainer_cls = trainer_cls or GRPOTrainer

    if model_loader is not None:
        model, tokenizer = model_loader()
    else:
        model, tokenizer = tiny_model(arch, vocab_size=len(VOCAB), **(model_kwargs or {})), build_tokenizer()
    if quantization is not None:
        device = "cpu" if config_kwargs.get("use_cpu", False) else "cuda"
        model = _quantized(model, f"{config_kwargs['output_dir']}/tiny-{arch}-unquantized", quantization, device)
    if config_kwargs.get("beta", 0.0) != 0.0 and not peft:
        # TRL loads the reference model from the policy's name_or_path: give it a local copy to load.
        model_dir = f"{config_kwargs['output_dir']}/tiny-{arch}"
        model.save_pretrained(model_dir)
        model.config._name_or_path = model_dir
    peft_config = None
    if peft:
        from peft import LoraConfig

        peft_config = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=0.0)
    args = config_cls(**config_kwargs)
    return trainer_cls(
        model=model,
        reward_funcs=reward_funcs or [arithmetic.format_reward, arithmetic.correctness_reward],
        args=args,
        train_dataset=arithmetic.load_dataset("train").select(range(64)),
        processing_class=tokenizer,
        peft_config=peft_config,
    )


def _quantized(model: torch.nn.Module, path: str, quantization: dict[str, Any], device: str) -> torch.nn.Module:
    """`model` saved to `path` and loaded back through bitsandbytes onto `device`."""
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    model.save_pretrained(path)
    return AutoModelForCausalLM.from_pretrained(path, quantization_config=BitsAndBytesConfig(**quantization),
                                                dtype=next(model.parameters()).dtype, device_map=device)


def run_training(
    variant: str,
    config_overrides: dict[str, Any] | None = None,
    *,
    steps: int = 3,
    arch: str = "llama",
    peft: bool = False,
    model_kwargs: dict[str, Any] | None = None,
    quantization: dict[str, Any] | None = None,
    prepare_model: Callable[[torch.nn.Module], None] | None = None,
    model_loader: Callable[[], tuple[torch.nn.Module, Any]] | None = None,
    reward_funcs: list[Callable] | None = None,
) -> list[StepRecord]:
    """Seeded GRPO training steps; returns one record per optimizer step. `prepare_model` edits the seeded model's
    weights (under no_grad) before training; `model_loader` and `reward_funcs` as in `build_trainer`."""
    from transformers import TrainerCallback

    records: list[StepRecord] = []
    generations: list[list[list[int]]] = []

    class _Recorder(TrainerCallback):
        def __init__(self, model: torch.nn.Module) -> None:
            self.model = model

        def on_pre_optimizer_step(self, args, state, control, **kwargs):
            grads = {
                n: p.grad.detach().clone()
                for n, p in self.model.named_parameters()
                if p.requires_grad and p.grad is not None
            }
            records.append(StepRecord(loss=float("nan"), grads=grads))

        def on_optimizer_step(self, args, state, control, **kwargs):
            records[-1].params = {
                n: p.detach().clone() for n, p in self.model.named_parameters() if p.requires_grad
            }

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs and records:
                records[-1].loss = float(logs["loss"])
                records[-1].logs = dict(logs)

    with patch_state(variant), tempfile.TemporaryDirectory() as tmp:
        config = base_config_kwargs(tmp, max_steps=steps, **(config_overrides or {}))
        torch.manual_seed(0)
        trainer = build_trainer(config, arch=arch, peft=peft, model_kwargs=model_kwargs, quantization=quantization,
                                model_loader=model_loader, reward_funcs=reward_funcs)
        if prepare_model is not None:
            with torch.no_grad():
                prepare_model(trainer.model)
        trainer.reward_funcs[0] = _recording(trainer.reward_funcs[0], generations)
        trainer.add_callback(_Recorder(trainer.model))
        trainer.train()
    for record, completion_ids in zip(records, generations):  # one generation per step in these configurations
        record.completion_ids = completion_ids
    return records


def _recording(reward_func: Callable, sink: list[list[list[int]]]) -> Callable:
    """`reward_func`, appending the token ids of the completions it scores to `sink` (one entry per generation)."""

    @functools.wraps(reward_func)
    def reward(*args: Any, completion_ids: list[list[int]], **kwargs: Any) -> list[float]:
        sink.append([list(ids) for ids in completion_ids])
        return reward_func(*args, completion_ids=completion_ids, **kwargs)

    return reward


def assert_records_close(
    stock: list[StepRecord], turbo: list[StepRecord], *, rtol: float = 1e-4, atol: float = 1e-6
) -> None:
    """Step-by-step equality of losses, gradients and parameters (within float reassociation tolerance)."""
    assert len(stock) == len(turbo) and stock, f"step counts differ: {len(stock)} vs {len(turbo)}"
    for step, (a, b) in enumerate(zip(stock, turbo)):
        torch.testing.assert_close(b.loss, a.loss, rtol=rtol, atol=atol,
                                   msg=lambda m, step=step: f"loss, step {step}: {m}")
        assert a.grads.keys() == b.grads.keys(), f"step {step}: different parameters received gradients"
        for name in a.grads:
            torch.testing.assert_close(b.grads[name], a.grads[name], rtol=rtol, atol=atol,
                                       msg=lambda m, name=name, step=step: f"grad {name}, step {step}: {m}")
            torch.testing.assert_close(b.params[name], a.params[name], rtol=rtol, atol=atol,
                                       msg=lambda m, name=name, step=step: f"param {name}, step {step}: {m}")


def synthetic_batch(
    trainer: Any,
    *,
    batch: int = 4,
    prompt_len: int = 5,
    completion_len: int = 7,
    seed: int = 0,
    with_sampling_logps: bool = False,
    with_ref_logps: bool = False,
    with_old_logps: bool = False,
) -> dict[str, torch.Tensor]:
    """A batch shaped like `_generate_and_score_completions`' output, with ragged completions and off-policy noise."""
    gen = torch.Generator().manual_seed(seed)
    vocab = trainer.model.config.vocab_size
    completion_mask = torch.ones(batch, completion_len, dtype=torch.long)
    for row in range(batch):
        length = int(torch.randint(1, completion_len + 1, (1,), generator=gen))
        completion_mask[row, length:] = 0
    inputs: dict[str, torch.Tensor] = {
        "prompt_ids": torch.randint(3, vocab, (batch, prompt_len), generator=gen),
        "prompt_mask": torch.ones(batch, prompt_len, dtype=torch.long),
        "completion_ids": torch.randint(3, vocab, (batch, completion_len), generator=gen),
        "completion_mask": completion_mask,
        "advantages": torch.randn(batch, generator=gen),
        "num_items_in_batch": completion_mask.sum().float(),
    }
    noise = lambda: 0.3 * torch.randn(batch, completion_len, generator=gen)  # noqa: E731
    if with_sampling_logps or with_old_logps or with_ref_logps:
        with torch.no_grad():
            current = trl_internals.per_token_logps(
                trainer,
                trainer.model,
                torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1),
                torch.cat([inputs["prompt_mask"], completion_mask], 1),
                completion_len,
            )
        if with_sampling_logps:
            inputs["sampling_per_token_logps"] = current + noise()
        if with_old_logps:
            inputs["old_per_token_logps"] = current + noise()
        if with_ref_logps:
            inputs["ref_per_token_logps"] = current + noise()
    return inputs


def loss_and_grads(trainer: Any, inputs: dict[str, torch.Tensor], *, fused: bool) -> tuple[torch.Tensor, dict]:
    """TRL's loss step (`_compute_loss`) with trl_turbo's fused loss on or off; returns the loss and parameter
    gradients."""
    trainer.args.turbo_fused_loss = fused
    if not hasattr(trainer, "current_gradient_accumulation_steps"):  # set by Trainer's loop; not run here
        trainer.current_gradient_accumulation_steps = trainer.args.gradient_accumulation_steps
    trainer.model.zero_grad(set_to_none=True)
    loss = trl_internals.compute_loss(trainer, trainer.model, dict(inputs))
    loss.backward()
    grads = {
        n: p.grad.detach().clone() for n, p in trainer.model.named_parameters() if p.grad is not None
    }
    return loss.detach(), grads
