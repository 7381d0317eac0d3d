"""Which passes a GRPO step runs with trl_turbo's loss: whether the fused loss is on, whether TRL's old-policy
log-prob forward is needed or can be reused from the training forward, and whether the loss takes TRL's
generation-time importance sampling over.

Design decision: these are TRL's own rules (`GRPOTrainer._generate_and_score_completions` decides the same way from
the same attributes), stated once as pure functions of the trainer, so the seam (`patches.trl_trainer`), the
benchmarks and the tests ask one place.
"""

from __future__ import annotations

from typing import Any

from .. import losses, registry
from ..config import Settings


def fused_loss_enabled(trainer: Any) -> bool:
    return Settings.of(trainer.args).fused_loss and registry.is_active()


def generation_aligned(trainer: Any) -> bool:
    """TRL's rule: each generation's samples are trained on within one optimizer step (no update in between)."""
    generate_every = trainer.args.steps_per_generation * trainer.num_iterations
    return trainer.args.gradient_accumulation_steps % generate_every == 0


def reuses_policy_logps(trainer: Any) -> bool:
    """True when TRL would run an old-log-prob forward only for vLLM IS correction, and its result would equal the
    training forward's detached log-probs (same weights: one iteration, generation aligned with optimizer steps)."""
    args = trainer.args
    if not (fused_loss_enabled(trainer) and Settings.of(args).reuse_policy_logps):
        return False
    return bool(generation_aligned(trainer) and trainer.use_vllm and trainer.vllm_importance_sampling_correction)


def holds_is_gate(trainer: Any) -> bool:
    """Whether TRL's generation-time vLLM IS code is switched off for a generation call (the loss takes it over)."""
    if reuses_policy_logps(trainer):
        return True
    return bool(
        fused_loss_enabled(trainer)
        and trainer.use_vllm
        and trainer.vllm_importance_sampling_correction
        and trainer.vllm_importance_sampling_mode in losses.TURBO_IS_MODES
    )


def needs_old_logps_forward(trainer: Any) -> bool:
    """Whether a generation step runs the extra no-grad forward for old-policy log-probs (TRL's rule, minus reuse)."""
    is_gate = trainer.use_vllm and trainer.vllm_importance_sampling_correction and not holds_is_gate(trainer)
    return bool(not generation_aligned(trainer) or is_gate)
