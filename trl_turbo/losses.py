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

Beyond TRL, the same spec defines loss types and IS modes that only trl_turbo's loss can run
(`TURBO_LOSS_TYPES`, `TURBO_IS_MODES`): GMPO (the objective of TRL's experimental `GMPOTrainer._compute_loss`, term
for term), Clip-Cov / KL-Cov (verl's selection semantics), GPPO, plain REINFORCE, a dual-clip bound for the
ratio-clipping families, and geometric-mean sequence IS modes. The random Clip-Cov subset is drawn from a generator
seeded by the caller (`LossInputs.seed`), so a given (seed, step) selects the same tokens on every run and rank.
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
    "gmpo": "gmpo",
    "clip_cov": "clip_cov",
    "kl_cov": "kl_cov",
    "gppo": "gppo",
    "reinforce": "reinforce",
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
    # GMPO's per-sequence term is (B, 1): its sequence mean is the plain mean over sequences GMPOTrainer takes
    "gmpo": "sequence_mean",
    "clip_cov": "global_token_mean",
    "kl_cov": "global_token_mean",
    "gppo": "global_token_mean",
    "reinforce": "global_token_mean",
}
LOSS_TYPES: tuple[str, ...] = tuple(LOSS_FAMILY)
# Loss types TRL's own `_compute_loss` does not know: they run only through trl_turbo's loss.
TURBO_LOSS_TYPES: tuple[str, ...] = ("gmpo", "clip_cov", "kl_cov", "gppo", "reinforce")
# Families that clip the ratio PPO-style (min of unclipped and clipped terms): the ones a dual-clip bound applies to.
RATIO_CLIP_FAMILIES: tuple[str, ...] = ("clip", "gppo", "clip_cov")
# Loss types that define their own use of the per-token ratio and so need importance_sampling_level="token".
TOKEN_LEVEL_ONLY: tuple[str, ...] = ("gmpo", "clip_cov", "kl_cov", "reinforce")
IS_LEVELS: tuple[str, ...] = ("token", "sequence")
TRL_IS_MODES: tuple[str, ...] = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")
# IS modes TRL's generation-time code does not know: the ratio is computed only in trl_turbo's loss.
TURBO_IS_MODES: tuple[str, ...] = ("sequence_geometric_truncate", "sequence_geometric_mask")
IS_MODES: tuple[str, ...] = TRL_IS_MODES + TURBO_IS_MODES
# IS modes whose weight is the product of every token's ratio: it shrinks like exp(-length x KL(sampler || trainer)).
PRODUCT_IS_MODES: tuple[str, ...] = ("sequence_truncate", "sequence_mask")


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
    dual_clip: float | None = None
    clip_cov_ratio: float = 2e-4
    clip_cov_lb: float = 1.0
    clip_cov_ub: float = 5.0
    kl_cov_ratio: float = 2e-3
    kl_cov_coef: float = 1.0

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
            dual_clip=args.turbo_dual_clip,
            clip_cov_ratio=args.turbo_clip_cov_ratio,
            clip_cov_lb=args.turbo_clip_cov_lb,
            clip_cov_ub=args.turbo_clip_cov_ub,
            kl_cov_ratio=args.turbo_kl_cov_ratio,
            kl_cov_coef=args.turbo_kl_cov_coef,
        )

    def ratio_clip_bounds(self) -> tuple[float, float]:
        """The ratio range outside which a token counts as clipped (GMPO clips in log space: exp(±ε))."""
        if self.family == "gmpo":
            return math.exp(-self.epsilon_low), math.exp(self.epsilon_high)
        return 1 - self.epsilon_low, 1 + self.epsilon_high


def validate_loss_options(args: Any) -> None:
    """Config-time checks for combinations the loss spec cannot honour (clear errors instead of mid-step crashes).
    Reads TRL's fields and the `turbo_*` loss fields of `trl_turbo.config`."""
    if args.importance_sampling_level not in IS_LEVELS:
        raise ValueError(
            f"Unknown `importance_sampling_level={args.importance_sampling_level!r}`; use one of {IS_LEVELS}."
        )
    mode = args.vllm_importance_sampling_mode
    if mode not in IS_MODES:
        raise ValueError(f"Unknown `vllm_importance_sampling_mode={mode!r}`; use one of {IS_MODES}.")
    if (
        args.vllm_importance_sampling_correction
        and mode == "sequence_geometric_truncate"
        and args.vllm_importance_sampling_clip_min is None
        and args.vllm_importance_sampling_clip_max is None
    ):
        raise ValueError(
            "`vllm_importance_sampling_mode='sequence_geometric_truncate'` needs at least one of "
            "`vllm_importance_sampling_clip_min` / `vllm_importance_sampling_clip_max`."
        )
    loss_type = args.loss_type
    if loss_type not in LOSS_FAMILY:  # unknown names are reported by trl_turbo.checks
        return
    family = LOSS_FAMILY[loss_type]
    if loss_type in TOKEN_LEVEL_ONLY and args.importance_sampling_level != "token":
        raise ValueError(
            f"`loss_type={loss_type!r}` defines its own use of the per-token ratio; it needs "
            f"`importance_sampling_level='token'`, got {args.importance_sampling_level!r}."
        )
    if (
        loss_type == "gmpo"
        and args.use_vllm
        and args.vllm_importance_sampling_correction
        and not mode.startswith("sequence")
    ):
        raise ValueError(
            "`loss_type='gmpo'` has one importance weight per sequence, so its vLLM IS correction must be "
            f"sequence-level: use a `sequence_*` `vllm_importance_sampling_mode`, got {mode!r}."
        )
    generate_every = args.steps_per_generation * args.num_iterations
    if loss_type == "reinforce" and (args.num_iterations != 1 or args.gradient_accumulation_steps % generate_every):
        raise ValueError(
            "`loss_type='reinforce'` is on-policy (no ratio, no clipping): every sample must be trained on in the "
            "optimizer step it was generated for, so it needs `num_iterations=1` and `gradient_accumulation_steps` "
            f"a multiple of `steps_per_generation` (got num_iterations={args.num_iterations}, "
            f"steps_per_generation={args.steps_per_generation}, gradient_accumulation_steps="
            f"{args.gradient_accumulation_steps}). Use a ratio-clipping loss type (e.g. 'dapo') to reuse samples."
        )
    if args.delta is not None and loss_type in TURBO_LOSS_TYPES and family not in RATIO_CLIP_FAMILIES:
        raise ValueError(
            f"`delta` caps the unclipped ratio of PPO-style two-sided clipping, which `loss_type={loss_type!r}` "
            "does not have; it would have no effect. Set `delta=None`."
        )
    dual_clip = args.turbo_dual_clip
    if dual_clip is not None:
        if family not in RATIO_CLIP_FAMILIES:
            clipping = sorted(t for t, f in LOSS_FAMILY.items() if f in RATIO_CLIP_FAMILIES)
            raise ValueError(
                f"`turbo_dual_clip` bounds the clipped ratio term of negative-advantage tokens, but "
                f"`loss_type={loss_type!r}` has no PPO-style ratio clipping. Use it with one of {clipping}, or "
                "set `turbo_dual_clip=None`."
            )
        if not (math.isfinite(dual_clip) and dual_clip > 1.0):
            raise ValueError(f"`turbo_dual_clip` must be a finite number > 1 (the paper uses 3), got {dual_clip}.")
    for name in ("turbo_clip_cov_ratio", "turbo_kl_cov_ratio"):
        value = getattr(args, name)
        if not 0.0 < value <= 1.0:
            raise ValueError(f"`{name}` is a fraction of tokens in (0, 1], got {value}.")
    if not args.turbo_clip_cov_lb < args.turbo_clip_cov_ub:
        raise ValueError(
            f"`turbo_clip_cov_lb` ({args.turbo_clip_cov_lb}) must be smaller than `turbo_clip_cov_ub` "
            f"({args.turbo_clip_cov_ub})."
        )
    if not (math.isfinite(args.turbo_kl_cov_coef) and args.turbo_kl_cov_coef >= 0):
        raise ValueError(f"`turbo_kl_cov_coef` must be a finite number >= 0, got {args.turbo_kl_cov_coef}.")


# ----------------------------------------------------------------------------------------------- importance sampling
def raw_importance_sampling_ratio(
    trainer_logps: torch.Tensor, sampling_logps: torch.Tensor, mask: torch.Tensor, mode: str
) -> torch.Tensor:
    """The ratio π_trainer / π_sampler at `mode`'s level, before truncation or masking: (B, T) for token modes,
    (B, 1) for sequence modes (exp of the summed token log-ratios, or of their mean for `sequence_geometric_*`, as in
    verl's rollout correction)."""
    per_token_logps_diff = (trainer_logps - sampling_logps) * mask
    # Tokens the sampler could not score (NaN) get ratio 1 rather than NaN
    per_token_logps_diff = torch.nan_to_num(per_token_logps_diff, nan=0.0)
    if mode in ("sequence_mask", "sequence_truncate"):
        logps_diff = per_token_logps_diff.sum(dim=-1, keepdim=True)
    elif mode in TURBO_IS_MODES:
        logps_diff = per_token_logps_diff.sum(dim=-1, keepdim=True) / mask.sum(dim=-1, keepdim=True).clamp(min=1.0)
    elif mode in ("token_mask", "token_truncate"):
        logps_diff = per_token_logps_diff
    else:
        raise ValueError(f"Unknown vLLM importance sampling mode: {mode!r}; use one of {IS_MODES}.")
    return torch.exp(logps_diff)


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
    ratio = raw_importance_sampling_ratio(trainer_logps, sampling_logps, mask, mode)
    if mode.endswith("truncate"):
        return torch.clamp(ratio, min=clip_min, max=clip_max)
    return ratio.masked_fill(_outside(ratio, clip_min, clip_max), value=0.0)


def _outside(ratio: torch.Tensor, clip_min: float | None, clip_max: float | None) -> torch.Tensor:
    min_val = clip_min if clip_min is not None else -math.inf
    max_val = clip_max if clip_max is not None else math.inf
    return (ratio < min_val) | (ratio > max_val)


@torch.no_grad()
def importance_sampling_diagnostics(
    trainer_logps: torch.Tensor,
    sampling_logps: torch.Tensor,
    mask: torch.Tensor,
    mode: str,
    clip_min: float | None,
    clip_max: float | None,
) -> dict[str, torch.Tensor]:
    """This process's raw trainer/sampler ratio statistics, before truncation or masking, as scalars keyed by metric
    name (to go under `sampling/`). Names ending in /min and /max are reduced by min/max across processes, the rest
    by mean. `sampler_trainer_kl` is the k3 estimate of KL(sampler ‖ trainer) per token, mean(r − 1 − log r) with
    r = π_trainer/π_sampler on the sampled tokens (non-negative, unbiased)."""
    valid = mask.bool() & ~torch.isnan(sampling_logps)
    rows = mask.sum(-1) > 0
    dtype = torch.promote_types(trainer_logps.dtype, torch.float32)
    zero = trainer_logps.new_zeros((), dtype=dtype)
    stats: dict[str, torch.Tensor] = {}

    def describe(name: str, values: torch.Tensor) -> None:
        values = values.to(dtype)
        has = values.numel() > 0
        stats[f"{name}/mean"] = values.mean() if has else zero
        stats[f"{name}/min"] = values.min() if has else zero
        stats[f"{name}/max"] = values.max() if has else zero
        stats[f"{name}/p95"] = torch.quantile(values, 0.95, interpolation="higher") if has else zero

    level_ratio = {}
    for name, level in (
        ("raw_importance_sampling_ratio", "token_mask"),
        ("raw_sequence_importance_sampling_ratio", "sequence_mask"),
        ("raw_geometric_sequence_importance_sampling_ratio", "sequence_geometric_mask"),
    ):
        ratio = raw_importance_sampling_ratio(trainer_logps, sampling_logps, mask, level)
        units = ratio[valid] if level == "token_mask" else ratio[rows]
        describe(name, units)
        level_ratio[level] = units
    level = "token_mask" if mode.startswith("token") else "sequence_geometric_mask" if mode in TURBO_IS_MODES else (
        "sequence_mask"
    )
    outside = _outside(level_ratio[level], clip_min, clip_max).to(dtype)
    kind = "truncated" if mode.endswith("truncate") else "masked"
    stats[f"is_{kind}_fraction"] = outside.mean() if outside.numel() > 0 else zero
    log_r = (trainer_logps - sampling_logps)[valid].to(dtype)
    k3 = torch.exp(log_r) - log_r - 1
    stats["sampler_trainer_kl"] = k3.mean() if k3.numel() > 0 else zero
    return stats


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


def gmpo_sequence_ratio(
    log_ratio: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, epsilon_low: float, epsilon_high: float
) -> torch.Tensor:
    """GMPO's (B, 1) importance weight: the geometric mean of the token ratios, each clipped in log space to
    [−ε_low, ε_high] on the side PPO's min would clip (sign-aware, one-sided), i.e. exp(masked mean of the clipped
    log-ratios)."""
    clamped = torch.clamp(log_ratio, min=-epsilon_low, max=epsilon_high)
    clipped = torch.where(advantages > 0, torch.minimum(log_ratio, clamped), torch.maximum(log_ratio, clamped))
    log_weight = (clipped * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1.0)
    return torch.exp(log_weight)


def _token_covariance(per_token_logps: torch.Tensor, advantages: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Per-token centred product (A − mean A)·(log π − mean log π), means over this micro-batch's valid tokens."""
    logps = per_token_logps.detach()
    adv = advantages.detach().expand_as(logps)
    return (adv - adv[valid].mean()) * (logps - logps[valid].mean())


@torch.no_grad()
def clip_cov_selection(
    per_token_logps: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clipped: torch.Tensor,
    ratio: float,
    lb: float,
    ub: float,
    seed: int,
) -> torch.Tensor:
    """Clip-Cov's (B, T) bool selection: max(1, ⌊ratio·N⌋) tokens drawn uniformly (seeded) among the valid,
    not-already-clipped tokens whose covariance lies strictly in (lb, ub); N = valid tokens of the micro-batch."""
    valid = mask.bool()
    selected = torch.zeros_like(valid)
    if not valid.any():
        return selected
    cov = _token_covariance(per_token_logps, advantages, valid)
    candidates = (valid & ~clipped & (cov > lb) & (cov < ub)).flatten().nonzero().squeeze(1)
    count = min(max(int(ratio * valid.sum().item()), 1), candidates.numel())
    order = torch.randperm(candidates.numel(), generator=torch.Generator().manual_seed(seed))
    selected.view(-1)[candidates[order[:count].to(candidates.device)]] = True
    return selected


@torch.no_grad()
def kl_cov_selection(
    per_token_logps: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, ratio: float
) -> torch.Tensor:
    """KL-Cov's (B, T) bool selection: the max(1, ⌊ratio·N⌋) valid tokens of largest covariance."""
    valid = mask.bool()
    selected = torch.zeros_like(valid)
    if not valid.any():
        return selected
    cov = _token_covariance(per_token_logps, advantages, valid).masked_fill(~valid, -math.inf)
    count = max(int(ratio * valid.sum().item()), 1)
    selected.view(-1)[torch.topk(cov.flatten(), count).indices] = True
    return selected


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
    seed: int = 0  # seeds the random token subset of clip_cov; callers derive it from (run seed, step)


@dataclass
class Normalizers:
    """What the reductions divide by, resolved by the caller exactly as GRPOTrainer does."""

    accumulation_steps: float = 1.0  # current_gradient_accumulation_steps in train mode, 1 in eval
    num_items_in_batch: torch.Tensor | float | None = None  # global completion-token count of the generation batch
    num_processes: int = 1
    steps_per_generation: int = 1
    max_completion_length: int = 1
    training: bool = True
    # When the loss is evaluated over a group of the micro-batch's sequences (forward token budget), the reductions
    # that average over the micro-batch divide by the whole micro-batch's sequence and token counts instead.
    batch_sequences: int | None = None
    batch_tokens: torch.Tensor | None = None


@dataclass
class LossOutput:
    loss: torch.Tensor  # scalar, already divided for gradient accumulation (TRL's loss_is_scaled_for_ga contract)
    policy_loss: torch.Tensor  # detached, before the accumulation division
    coef_1: torch.Tensor  # the (possibly delta-capped) ratio, for clip metrics
    per_token_kl: torch.Tensor | None
    phi_seq: torch.Tensor | None
    cov_selected: torch.Tensor | None = None  # (B, T) bool: clip_cov's detached / kl_cov's penalised tokens
    dual_clipped: torch.Tensor | None = None  # (B, T) bool: tokens held at the dual-clip bound


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

    family = spec.family
    per_token_kl = None
    if spec.beta != 0.0:
        ref = batch.ref_per_token_logps
        per_token_kl = torch.exp(ref - per_token_logps) - (ref - per_token_logps) - 1
        if spec.use_bias_correction_kl and family != "gmpo":  # GMPOTrainer's KL has no bias correction
            per_token_kl = per_token_kl * coef_1

    phi_seq = cov_selected = dual_clipped = None
    entropy_mask = batch.entropy_mask
    if family == "cispo":
        clamped_ratios = torch.clamp(coef_1, max=spec.epsilon_high).detach()
        per_token_loss = -clamped_ratios * advantages * per_token_logps
    elif family in RATIO_CLIP_FAMILIES:
        coef_2 = torch.clamp(coef_1, 1 - spec.epsilon_low, 1 + spec.epsilon_high)
        if family == "gppo":
            # GPPO: the clipped term keeps the clipped value but its gradient is clip(r)·∇log r, not 0
            coef_2 = coef_2.detach() * torch.exp(log_importance_weights - log_importance_weights.detach())
        if family == "clip_cov":
            clipped = coef_2 * advantages < coef_1 * advantages  # PPO's min picks the clipped term: no gradient
            cov_selected = clip_cov_selection(
                per_token_logps, advantages, mask, clipped, spec.clip_cov_ratio, spec.clip_cov_lb,
                spec.clip_cov_ub, batch.seed,
            )
        if spec.delta is not None:
            coef_1 = torch.clamp(coef_1, max=spec.delta)
        per_token_loss = -torch.min(coef_1 * advantages, coef_2 * advantages)
        if spec.dual_clip is not None:
            dual_bound = -spec.dual_clip * advantages
            dual_clipped = (advantages < 0) & (per_token_loss > dual_bound)
            per_token_loss = torch.where(dual_clipped, dual_bound, per_token_loss)
        if cov_selected is not None:
            per_token_loss = per_token_loss * ~cov_selected
    elif family == "gmpo":
        # The entropy mask acts inside GMPO's geometric mean (as in GMPOTrainer), not on the sequence term
        seq_mask = mask if entropy_mask is None else mask * entropy_mask
        entropy_mask = None
        per_token_loss = -gmpo_sequence_ratio(
            log_ratio, advantages, seq_mask, spec.epsilon_low, spec.epsilon_high
        ) * advantages
    elif family == "kl_cov":
        cov_selected = kl_cov_selection(per_token_logps, advantages, mask, spec.kl_cov_ratio)
        per_token_loss = -coef_1 * advantages + spec.kl_cov_coef * cov_selected * log_ratio.abs()
    elif family == "reinforce":
        per_token_loss = -advantages * per_token_logps
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
    if entropy_mask is not None:
        per_token_loss = per_token_loss * entropy_mask
    if spec.vllm_is_correction and family != "vespo":
        per_token_loss = per_token_loss * batch.importance_sampling_ratio
    if spec.beta != 0.0:
        per_token_loss = per_token_loss + spec.beta * per_token_kl

    loss, policy_loss = reduce_loss(spec, per_token_loss, mask, norm)
    return LossOutput(
        loss=loss,
        policy_loss=policy_loss,
        coef_1=coef_1,
        per_token_kl=per_token_kl,
        phi_seq=phi_seq,
        cov_selected=cov_selected,
        dual_clipped=dual_clipped,
    )


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
    sequences = per_token_loss.size(0) if norm.batch_sequences is None else norm.batch_sequences
    if reduction == "sequence_mean":
        per_sequence = (per_token_loss * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)
        loss = per_sequence.mean() if norm.batch_sequences is None else per_sequence.sum() / sequences
    elif reduction == "token_mean":
        tokens = mask.sum() if norm.batch_tokens is None else norm.batch_tokens
        loss = (per_token_loss * mask).sum() / tokens.clamp(min=1.0)
    elif reduction == "fixed_length":
        loss = (per_token_loss * mask).sum() / (sequences * norm.max_completion_length)
    elif reduction == "sequence_sum":
        per_sequence = (per_token_loss * mask).sum(-1)
        loss = per_sequence.mean() if norm.batch_sequences is None else per_sequence.sum() / sequences
    else:
        raise ValueError(f"Unknown reduction {reduction!r} for loss type {spec.loss_type!r}")
    return loss / norm.accumulation_steps, loss.detach()


def entropy_bonus(
    entropies: torch.Tensor,
    effective_mask: torch.Tensor,
    accumulation_steps: float,
    batch_tokens: torch.Tensor | None = None,
) -> torch.Tensor:
    """Mean entropy over the tokens the bonus acts on, scaled only for gradient accumulation (subtract coef × this).
    `batch_tokens`: the whole micro-batch's count of those tokens, when `entropies` covers a group of its sequences."""
    tokens = effective_mask.sum() if batch_tokens is None else batch_tokens
    return (entropies * effective_mask).sum() / tokens.clamp(min=1.0) / accumulation_steps
