"""The GRPO loss family, specified once.

Design: every loss option (loss_type → ratio family, clipping, per-token weight, reduction; importance-sampling level;
KL; vLLM importance-sampling correction) is defined here, on [B, T] tensors of per-token log-probs. Where those
log-probs come from is not this module's business: the patched GRPOTrainer feeds it the fused kernel's output
(`trl_turbo.ops.fused_logprobs`), the tests and benchmarks feed it naive full-logits log-probs
(`trl_turbo.ops.reference_logprobs`). Both paths run the same functions, so they cannot drift.

The [B, T] math is cheap next to the LM head (O(B·T) against O(B·T·V·H)), so it stays in PyTorch where autograd
differentiates it; the kernel only needs d(loss)/d(logp) and d(loss)/d(entropy) per token.

Semantics follow TRL 1.16's `GRPOTrainer._compute_loss` and its generation-time IS ratio operation by operation
(including the order of clamps), so that a patched trainer reproduces stock TRL's loss and gradients.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

# loss_type → how the per-token term is built from the ratio ("family") and how it is reduced ("reduction").
LOSS_FAMILY: dict[str, str] = {
    "grpo": "clip",
    "bnpo": "clip",
    "dr_grpo": "clip",
    "dapo": "clip",
    "luspo": "clip",
    "cispo": "cispo",
    "sapo": "sapo",
    "vespo": "vespo",
}
LOSS_REDUCTION: dict[str, str] = {
    "grpo": "sequence_mean",
    "sapo": "sequence_mean",
    "bnpo": "token_mean",
    "dr_grpo": "fixed_length",
    "dapo": "global_token_mean",
    "cispo": "global_token_mean",
    "vespo": "global_token_mean",
    "luspo": "sequence_sum",
}
LOSS_TYPES: tuple[str, ...] = tuple(LOSS_FAMILY)
IS_LEVELS: tuple[str, ...] = ("token", "sequence")
IS_MODES: tuple[str, ...] = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")


@dataclass(frozen=True)
class LossSpec:
    """Everything that decides the loss, read once from a GRPOConfig (or GRPOTrainer attributes)."""

    loss_type: str = "dapo"
    importance_sampling_level: str = "token"
    epsilon_low: float = 0.2
    epsilon_high: float = 0.2
    delta: float | None = None
    beta: float = 0.0
    use_bias_correction_kl: bool = True
    sapo_temperature_pos: float = 1.0
    sapo_temperature_neg: float = 1.05
    vespo_k_pos: float = 2.0
    vespo_lambda_pos: float = 3.0
    vespo_k_neg: float = 3.0
    vespo_lambda_neg: float = 2.0
    off_policy_mask_threshold: float | None = None
    vllm_is_correction: bool = False
    vllm_is_mode: str = "sequence_mask"
    vllm_is_clip_min: float | None = None
    vllm_is_clip_max: float | None = 3.0

    @property
    def family(self) -> str:
        return LOSS_FAMILY[self.loss_type]

    @property
    def reduction(self) -> str:
        return LOSS_REDUCTION[self.loss_type]

    @classmethod
    def from_trainer(cls, trainer: Any) -> LossSpec:
        """Build the spec the way GRPOTrainer resolves it (epsilon_high defaulting, the use_vllm gate)."""
        args = trainer.args
        return cls(
            loss_type=trainer.loss_type,
            importance_sampling_level=trainer.importance_sampling_level,
            epsilon_low=trainer.epsilon_low,
            epsilon_high=trainer.epsilon_high,
            delta=args.delta,
            beta=trainer.beta,
            use_bias_correction_kl=args.use_bias_correction_kl,
            sapo_temperature_pos=args.sapo_temperature_pos,
            sapo_temperature_neg=args.sapo_temperature_neg,
            vespo_k_pos=args.vespo_k_pos,
            vespo_lambda_pos=args.vespo_lambda_pos,
            vespo_k_neg=args.vespo_k_neg,
            vespo_lambda_neg=args.vespo_lambda_neg,
            off_policy_mask_threshold=trainer.off_policy_mask_threshold,
            vllm_is_correction=bool(trainer.use_vllm and trainer.vllm_importance_sampling_correction),
            vllm_is_mode=trainer.vllm_importance_sampling_mode,
            vllm_is_clip_min=trainer.vllm_importance_sampling_clip_min,
            vllm_is_clip_max=trainer.vllm_importance_sampling_clip_max,
        )


def validate_loss_options(args: Any) -> None:
    """Config-time checks for combinations the loss spec cannot honour (clear errors instead of mid-step crashes)."""
    if args.importance_sampling_level not in IS_LEVELS:
        raise ValueError(
            f"Unknown `importance_sampling_level={args.importance_sampling_level!r}`; use one of {IS_LEVELS}."
        )
    if args.vllm_importance_sampling_mode not in IS_MODES:
        raise ValueError(
            f"Unknown `vllm_importance_sampling_mode={args.vllm_importance_sampling_mode!r}`; use one of {IS_MODES}."
        )


# ----------------------------------------------------------------------------------------------- importance sampling
def vllm_importance_sampling_ratio(
    trainer_logps: torch.Tensor,
    sampling_logps: torch.Tensor,
    mask: torch.Tensor,
    mode: str,
    clip_min: float | None,
    clip_max: float | None,
) -> torch.Tensor:
    """Truncated/masked IS ratio between the trainer's and the sampler's log-probs: (B, T) for token modes, (B, 1)
    for sequence modes. No gradient flows through it (callers pass detached log-probs)."""
    per_token_logps_diff = (trainer_logps - sampling_logps) * mask
    # Tokens the sampler could not score (NaN) get ratio 1 rather than NaN
    per_token_logps_diff = torch.nan_to_num(per_token_logps_diff, nan=0.0)
    if mode in ("sequence_mask", "sequence_truncate"):
        logps_diff = per_token_logps_diff.sum(dim=-1, keepdim=True)
    else:
        logps_diff = per_token_logps_diff
    ratio = torch.exp(logps_diff)
    if mode in ("sequence_truncate", "token_truncate"):
        return torch.clamp(ratio, min=clip_min, max=clip_max)
    if mode in ("sequence_mask", "token_mask"):
        min_val = clip_min if clip_min is not None else -math.inf
        max_val = clip_max if clip_max is not None else math.inf
        return ratio.masked_fill((ratio < min_val) | (ratio > max_val), value=0.0)
    raise ValueError(f"Unknown vLLM importance sampling mode: {mode!r}; use one of {IS_MODES}.")


def off_policy_sequence_mask(
    advantages: torch.Tensor,
    per_token_logps: torch.Tensor,
    sampling_per_token_logps: torch.Tensor,
    mask: torch.Tensor,
    threshold: float,
) -> torch.Tensor:
    """DeepSeek-V3.2 off-policy sequence mask, (B, 1): keep when A >= 0 or the mean sampler→policy KL <= threshold."""
    kl_div = torch.nan_to_num(sampling_per_token_logps - per_token_logps.detach(), nan=0.0)
    seq_kl_sum = (kl_div * mask).sum(dim=1, keepdim=True)
    avg_seq_kl = seq_kl_sum / mask.sum(dim=1, keepdim=True).clamp(min=1.0)
    return ((advantages >= 0) | (avg_seq_kl <= threshold)).to(dtype=mask.dtype)


@torch.no_grad()
def vespo_gamma_weights(
    advantages: torch.Tensor,
    log_ratio_per_token: torch.Tensor,
    mask: torch.Tensor,
    importance_sampling_ratio: torch.Tensor | None,
    k_pos: float,
    lambda_pos: float,
    k_neg: float,
    lambda_neg: float,
) -> torch.Tensor:
    """VESPO's detached gamma weight φ(w) = e^λ·w^k·e^{−λw} of the sequence ratio w (IS ratio folded in), (B, 1)."""
    lower_clamp = math.log(1e-8)
    log_ratio_clamped = torch.clamp(log_ratio_per_token, -20.0, 20.0)
    seq_log_ratio = torch.sum(log_ratio_clamped * mask, dim=-1, keepdim=True)
    if importance_sampling_ratio is not None:
        log_is_ratio = torch.clamp(torch.log(importance_sampling_ratio), lower_clamp, 20.0)
        seq_log_ratio += torch.sum(log_is_ratio, dim=-1, keepdim=True)
    log_w_seq = torch.clamp(seq_log_ratio, lower_clamp, 20.0)
    w_seq = torch.exp(log_w_seq)
    is_nonneg_adv = advantages >= 0
    k_seq = torch.where(is_nonneg_adv, k_pos, k_neg)
    lambda_seq = torch.where(is_nonneg_adv, lambda_pos, lambda_neg).clamp(min=1e-4)
    log_phi = lambda_seq + k_seq * log_w_seq - lambda_seq * w_seq
    return torch.exp(log_phi).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)


# ----------------------------------------------------------------------------------------------------- the loss
@dataclass
class LossInputs:
    """[B, T] tensors for one micro-batch. `advantages` is (B,) or (B, T)."""

    per_token_logps: torch.Tensor
    mask: torch.Tensor
    advantages: torch.Tensor
    old_per_token_logps: torch.Tensor | None = None
    ref_per_token_logps: torch.Tensor | None = None
    sampling_per_token_logps: torch.Tensor | None = None
    importance_sampling_ratio: torch.Tensor | None = None
    entropy_mask: torch.Tensor | None = None


@dataclass
class Normalizers:
    """What the reductions divide by, resolved by the caller exactly as GRPOTrainer does."""

    accumulation_steps: float = 1.0  # current_gradient_accumulation_steps in train mode, 1 in eval
    num_items_in_batch: torch.Tensor | float | None = None  # global completion-token count of the generation batch
    num_processes: int = 1
    steps_per_generation: int = 1
    max_completion_length: int = 1
    training: bool = True


@dataclass
class LossOutput:
    loss: torch.Tensor  # scalar, already divided for gradient accumulation (TRL's loss_is_scaled_for_ga contract)
    policy_loss: torch.Tensor  # detached, before the accumulation division
    coef_1: torch.Tensor  # the (possibly delta-capped) ratio, for clip metrics
    per_token_kl: torch.Tensor | None
    phi_seq: torch.Tensor | None


def grpo_loss(spec: LossSpec, batch: LossInputs, norm: Normalizers) -> LossOutput:
    """TRL's GRPO objective for `spec`, as a differentiable function of `batch.per_token_logps`."""
    per_token_logps, mask = batch.per_token_logps, batch.mask
    advantages = batch.advantages
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(1)
    old = batch.old_per_token_logps
    old = per_token_logps.detach() if old is None else old

    if spec.off_policy_mask_threshold is not None:
        sampling = batch.sampling_per_token_logps if batch.sampling_per_token_logps is not None else old
        off_policy_mask = off_policy_sequence_mask(
            advantages, per_token_logps, sampling, mask, spec.off_policy_mask_threshold
        )

    log_ratio = per_token_logps - old
    if spec.importance_sampling_level == "token":
        log_importance_weights = log_ratio
    elif spec.importance_sampling_level == "sequence":
        log_importance_weights = (log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)
        log_importance_weights = log_importance_weights.unsqueeze(-1)
    else:
        raise ValueError(f"Unknown importance sampling level: {spec.importance_sampling_level}")
    coef_1 = torch.exp(log_importance_weights)

    per_token_kl = None
    if spec.beta != 0.0:
        ref = batch.ref_per_token_logps
        per_token_kl = torch.exp(ref - per_token_logps) - (ref - per_token_logps) - 1
        if spec.use_bias_correction_kl:
            per_token_kl = per_token_kl * coef_1

    phi_seq = None
    family = spec.family
    if family == "cispo":
        clamped_ratios = torch.clamp(coef_1, max=spec.epsilon_high).detach()
        per_token_loss = -clamped_ratios * advantages * per_token_logps
    elif family == "clip":
        coef_2 = torch.clamp(coef_1, 1 - spec.epsilon_low, 1 + spec.epsilon_high)
        if spec.delta is not None:
            coef_1 = torch.clamp(coef_1, max=spec.delta)
        per_token_loss = -torch.min(coef_1 * advantages, coef_2 * advantages)
    elif family == "sapo":
        temperatures = torch.where(advantages > 0, spec.sapo_temperature_pos, spec.sapo_temperature_neg)
        per_token_loss = -(torch.sigmoid(temperatures * (coef_1 - 1)) * 4 / temperatures) * advantages
    elif family == "vespo":
        phi_seq = vespo_gamma_weights(
            advantages,
            log_ratio,
            mask,
            batch.importance_sampling_ratio,
            spec.vespo_k_pos,
            spec.vespo_lambda_pos,
            spec.vespo_k_neg,
            spec.vespo_lambda_neg,
        )
        per_token_loss = -phi_seq * advantages * per_token_logps
    else:
        raise ValueError(f"Unknown loss type: {spec.loss_type}")

    if spec.off_policy_mask_threshold is not None:
        per_token_loss = per_token_loss * off_policy_mask
    if batch.entropy_mask is not None:
        per_token_loss = per_token_loss * batch.entropy_mask
    if spec.vllm_is_correction and family != "vespo":
        per_token_loss = per_token_loss * batch.importance_sampling_ratio
    if spec.beta != 0.0:
        per_token_loss = per_token_loss + spec.beta * per_token_kl

    loss, policy_loss = reduce_loss(spec, per_token_loss, mask, norm)
    return LossOutput(loss=loss, policy_loss=policy_loss, coef_1=coef_1, per_token_kl=per_token_kl, phi_seq=phi_seq)


def reduce_loss(
    spec: LossSpec, per_token_loss: torch.Tensor, mask: torch.Tensor, norm: Normalizers
) -> tuple[torch.Tensor, torch.Tensor]:
    """Aggregate per-token losses by the loss type's reduction; returns (loss / accumulation, detached policy loss)."""
    reduction = spec.reduction
    if reduction == "global_token_mean":
        # num_items_in_batch spans the generation batch: rescale it to one accumulation window
        normalizer = norm.num_items_in_batch.clamp(min=1.0) / norm.num_processes
        if norm.training:
            normalizer = normalizer * norm.accumulation_steps / norm.steps_per_generation
        loss = (per_token_loss * mask).sum() / normalizer
        return loss, loss.detach()
    if reduction == "sequence_mean":
        loss = ((per_token_loss * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
    elif reduction == "token_mean":
        loss = (per_token_loss * mask).sum() / mask.sum().clamp(min=1.0)
    elif reduction == "fixed_length":
        loss = (per_token_loss * mask).sum() / (per_token_loss.size(0) * norm.max_completion_length)
    elif reduction == "sequence_sum":
        loss = (per_token_loss * mask).sum(-1).mean()
    else:
        raise ValueError(f"Unknown reduction {reduction!r} for loss type {spec.loss_type!r}")
    return loss / norm.accumulation_steps, loss.detach()


def entropy_bonus(entropies: torch.Tensor, effective_mask: torch.Tensor, accumulation_steps: float) -> torch.Tensor:
    """Mean entropy over the tokens the bonus acts on, scaled only for gradient accumulation (subtract coef × this)."""
    return (entropies * effective_mask).sum() / effective_mask.sum().clamp(min=1.0) / accumulation_steps
