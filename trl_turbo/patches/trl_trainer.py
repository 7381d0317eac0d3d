"""Patches of TRL's GRPOTrainer: fused log-probs, the loss from `trl_turbo.losses`, and skipping the redundant
old-log-prob forward.

Seams (all looked up by TRL at call time, so setting them is enough; nothing of TRL's source is rewritten):
- `trl.trainer.utils._ChunkedLogProbFunction`: the kernel behind TRL's fused LM head (`add_fused_lm_head`). TRL keeps
  doing everything around it (the backbone call through DDP/FSDP/ZeRO wrappers, ZeRO-3 head gathering, DTensor
  heads, scattering per-token values back to [B, T]); only the kernel is ours. Outside a GRPO log-prob pass, and for
  statistics our kernel does not produce, calls go to TRL's original.
- `GRPOTrainer._get_per_token_logps_and_entropies`: wrapped to tell the kernel, through a context variable, whether
  entropy is wanted at all (TRL's old/ref passes compute it and throw it away).
- `GRPOTrainer._compute_loss`: replaced by the same computation built from `trl_turbo.losses` (the single loss spec);
  the entropy gradient is skipped in the kernel unless the entropy bonus is on.
- `GRPOTrainer._generate_and_score_completions`: TRL's vLLM-IS gate is held off for the duration of the call when
  the old-policy log-probs are provably the training forward's own (num_iterations == 1, generation aligned with the
  optimizer step), so TRL skips that whole extra forward, and whenever the IS mode is one TRL does not know
  (`losses.TURBO_IS_MODES`), so TRL's generation-time IS code never sees it. TRL still runs the old-log-prob forward
  when it needs it for its own reason (generation misaligned with optimizer steps). Whenever TRL produced no IS ratio,
  the loss computes it (same formula, `losses.vllm_importance_sampling_ratio`) from the old-policy log-probs when
  present, else from the training forward's detached log-probs, and logs TRL's sampling metrics. The raw ratio
  diagnostics (`losses.importance_sampling_diagnostics`) are logged from the loss on every step, whoever computed
  the ratio.

Each replaced method consults `args.turbo_*` on every call, so with the switches off the trainer is stock TRL.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import inspect
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from .. import losses
from ..ops import fused_logprobs
from . import registry


@dataclass(frozen=True)
class _HeadOptions:
    compute_entropy: bool
    entropy_grad: bool | None
    chunk_tokens: int | None


_head_options: contextvars.ContextVar[_HeadOptions | None] = contextvars.ContextVar("trl_turbo_head", default=None)
_entropy_grad: contextvars.ContextVar[bool | None] = contextvars.ContextVar("trl_turbo_entropy_grad", default=None)
_FUSED_OUTPUTS = frozenset({"log_probs", "entropy"})


def fused_loss_enabled(trainer: Any) -> bool:
    return bool(getattr(trainer.args, "turbo_fused_loss", False)) and registry.is_active()


def generation_aligned(trainer: Any) -> bool:
    """TRL's rule: each generation's samples are trained on within one optimizer step (no update in between)."""
    generate_every = trainer.args.steps_per_generation * trainer.num_iterations
    return trainer.args.gradient_accumulation_steps % generate_every == 0


def reuses_policy_logps(trainer: Any) -> bool:
    """True when TRL would run an old-log-prob forward only for vLLM IS correction, and its result would equal the
    training forward's detached log-probs (same weights: one iteration, generation aligned with optimizer steps)."""
    args = trainer.args
    if not (fused_loss_enabled(trainer) and getattr(args, "turbo_reuse_policy_logps", False)):
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


class FusedLogProbAdapter:
    """Stands in for TRL's `_ChunkedLogProbFunction`: same `apply` contract, trl_turbo's kernel inside."""

    @staticmethod
    def apply(
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        targets: torch.Tensor,
        temperature: float,
        chunk_size: int,
        final_logit_softcapping: float | None = None,
        logit_scale: float = 1.0,
        outputs: tuple[str, ...] = ("log_probs",),
    ) -> tuple[torch.Tensor | None, ...]:
        options = _head_options.get()
        if options is None or not set(outputs) <= _FUSED_OUTPUTS:
            import trl.trainer.utils as trl_utils

            original = registry.original(trl_utils, "_ChunkedLogProbFunction")
            return original.apply(
                hidden, weight, bias, targets, temperature, chunk_size, final_logit_softcapping, logit_scale, outputs
            )
        want_entropy = "entropy" in outputs and options.compute_entropy
        logps, entropy = fused_logprobs(
            hidden,
            weight,
            targets,
            bias=bias,
            temperature=temperature,
            logit_scale=logit_scale,
            softcap=final_logit_softcapping,
            compute_entropy=want_entropy,
            entropy_grad=options.entropy_grad if want_entropy else False,
            chunk_tokens=options.chunk_tokens,
        )
        return logps, entropy, None, None, None


@contextlib.contextmanager
def _entropy_gradient(needed: bool) -> Iterator[None]:
    token = _entropy_grad.set(needed)
    try:
        yield
    finally:
        _entropy_grad.reset(token)


def _wrap_get_per_token_logps(original):
    signature = inspect.signature(original)

    @functools.wraps(original)
    def _get_per_token_logps_and_entropies(self, *args, **kwargs):
        if not fused_loss_enabled(self):
            return original(self, *args, **kwargs)
        bound = signature.bind(self, *args, **kwargs)
        options = _HeadOptions(
            compute_entropy=bool(bound.arguments.get("compute_entropy", False)),
            entropy_grad=_entropy_grad.get(),
            chunk_tokens=self.args.turbo_logprob_chunk_tokens,
        )
        token = _head_options.set(options)
        try:
            return original(self, *args, **kwargs)
        finally:
            _head_options.reset(token)

    return _get_per_token_logps_and_entropies


def _wrap_generate_and_score(original):
    @functools.wraps(original)
    def _generate_and_score_completions(self, inputs):
        if not holds_is_gate(self):
            return original(self, inputs)
        # TRL reads this instance attribute to decide on the old-logps forward and the IS ratio; the loss takes
        # both over (see module docstring). Restored even if generation raises.
        self.vllm_importance_sampling_correction = False
        try:
            return original(self, inputs)
        finally:
            self.vllm_importance_sampling_correction = True

    return _generate_and_score_completions


def check_loss_owner(trainer_cls: type, config: Any) -> None:
    """Before the model loads: trl_turbo's loss settings against the class that will compute the loss. A TRL trainer
    that overrides `_compute_loss` (GMPOTrainer) never runs trl_turbo's loss, so settings only that loss implements
    would be ignored; a GRPOConfig subclass is not checked for unknown loss types at config time (its own trainer may
    define them), so that check happens here, where the trainer is known (and only where both `compute_loss` and
    `_compute_loss` are GRPOTrainer's). A user's override is left alone: it may call trl_turbo's loss through
    `super()`."""
    from trl.trainer.grpo_trainer import GRPOTrainer

    from ..config import check_loss_type_known, turbo_loss_settings

    if config is None or not getattr(config, "turbo_fused_loss", False):
        return  # the config's own validation refused trl_turbo-only settings
    def owner_of(method: str) -> type:
        return next(cls for cls in trainer_cls.__mro__ if method in cls.__dict__)

    owner = owner_of("_compute_loss")
    if owner is GRPOTrainer:  # its `_compute_loss` is trl_turbo's
        if owner_of("compute_loss") is GRPOTrainer:
            check_loss_type_known(config.loss_type)
        return
    # `loss_type` is not among them: TRL's own trainers with their own loss do not read it
    ignored = turbo_loss_settings(config, with_loss_type=False) if owner.__module__.split(".")[0] == "trl" else []
    if ignored:
        raise ValueError(
            f"{owner.__name__} computes its own loss (it overrides `_compute_loss`), so trl_turbo's loss "
            f"never runs and {' and '.join(ignored)} would have no effect. Remove them, or train with GRPOTrainer."
        )


def _wrap_compute_loss(original):
    @functools.wraps(original)
    def _compute_loss(self, model, inputs):
        if not fused_loss_enabled(self):
            return original(self, model, inputs)
        groups = sequence_groups(self, inputs)
        if groups is None:
            return _turbo_compute_loss(self, model, inputs)
        return _grouped_compute_loss(self, model, inputs, groups)

    return _compute_loss


def sequence_groups(trainer: Any, inputs: dict[str, Any]) -> list[slice] | None:
    """Split the micro-batch into groups of whole sequences of at most `turbo_forward_token_budget` tokens each,
    when it exceeds the budget and the loss allows it; None: one forward over the whole micro-batch.

    With several processes every rank runs the same number of groups (the largest any rank needs): each group is
    a forward and backward pass, and DDP's buffer broadcasts, ZeRO-3's and FSDP's gathers and their gradient
    reductions are collectives that every rank has to enter equally often. Ranks' completions are padded to
    different lengths, so a rank-local count could hang the run."""
    budget = getattr(trainer.args, "turbo_forward_token_budget", None)
    if budget is None or not (torch.is_grad_enabled() and trainer.model.training) or not splittable_loss(trainer):
        return None
    prompt_ids, completion_ids = inputs["prompt_ids"], inputs["completion_ids"]
    sequences, length = prompt_ids.size(0), prompt_ids.size(1) + completion_ids.size(1)
    per_group = max(1, budget // length)
    count = -(-sequences // per_group) if sequences * length > budget else 1
    if not rows_are_sequences(inputs, sequences):
        count = 0  # this micro-batch cannot be split (its rank still takes part in the agreement below)
    if trainer.accelerator.num_processes > 1:
        count = agreed_group_count(trainer.accelerator, count, prompt_ids.device)
    count = min(count, sequences)  # GRPO's micro-batches have the same number of sequences on every rank
    if count < 2:
        return None
    size, larger = divmod(sequences, count)
    bounds = [0]
    for index in range(count):
        bounds.append(bounds[-1] + size + (1 if index < larger else 0))
    return [slice(start, end) for start, end in zip(bounds, bounds[1:])]


def agreed_group_count(accelerator: Any, count: int, device: torch.device) -> int:
    """The largest group count of any rank, or 0 (no split anywhere) when some rank's micro-batch cannot be split
    (count 0); one small all-gather per micro-batch, on every rank."""
    counts = accelerator.gather(torch.tensor([count], device=device))
    return 0 if int(counts.min().item()) == 0 else int(counts.max().item())


def splittable_loss(trainer: Any) -> bool:
    """Whether the loss of a micro-batch is the sum of its sequence groups' losses (given whole-batch normalizers).
    Not so for statistics over all tokens of the micro-batch (entropy quantile, Clip-/KL-Cov covariances), the
    adaptive entropy controller's once-per-step update, MoE aux losses, or DeepSpeed (one backward per step)."""
    from accelerate.utils import DistributedType

    return (
        trainer.top_entropy_quantile >= 1.0
        and trainer.loss_type not in ("clip_cov", "kl_cov")
        and not trainer.use_adaptive_entropy
        and not trainer.aux_loss_enabled
        and trainer.accelerator.distributed_type != DistributedType.DEEPSPEED
    )


# Image inputs are laid out per image, patch or tile (TRL slices them with `num_images`, grids or tile counts), so
# their rows are not sequences even where the counts happen to agree.
IMAGE_INPUTS = ("pixel_values", "image_grid_thw", "pixel_attention_mask", "image_sizes", "image_position_ids",
                "spatial_shapes", "num_tiles")


def rows_are_sequences(inputs: dict[str, Any], sequences: int) -> bool:
    """Whether every batched input has one row per sequence, so a group of sequences is a slice of each (no image
    inputs; tensors of one row per sequence or scalars; lists of one item per sequence or non-lists)."""
    if any(inputs.get(name) is not None for name in IMAGE_INPUTS):
        return False
    for value in inputs.values():
        if torch.is_tensor(value) and value.dim() > 0 and value.size(0) != sequences:
            return False
        if isinstance(value, list) and len(value) != sequences:
            return False
    return True


def _slice_inputs(inputs: dict[str, Any], rows: slice, sequences: int) -> dict[str, Any]:
    def take(value):
        if torch.is_tensor(value) and value.dim() > 0 and value.size(0) == sequences:
            return value[rows]
        if isinstance(value, list) and len(value) == sequences:
            return value[rows]
        return value

    return {key: take(value) for key, value in inputs.items()}


def _grouped_compute_loss(self, model, inputs, groups: list[slice]):
    """Forward and backward one sequence group at a time, so activations scale with a group, not the micro-batch.
    All groups but the last are backpropagated here; the returned loss carries the last group's graph and the
    others' values, so the Trainer's own backward completes the step and logs the whole micro-batch's loss."""
    sequences = inputs["prompt_ids"].size(0)
    mask = inputs["completion_mask"] if "tool_mask" not in inputs else inputs["completion_mask"] * inputs["tool_mask"]
    whole = _WholeBatch(sequences=sequences, tokens=mask.sum())
    done = None
    for index, rows in enumerate(groups):
        loss = _turbo_compute_loss(self, model, _slice_inputs(inputs, rows, sequences), whole)
        if index < len(groups) - 1:
            self.accelerator.backward(loss)
            done = loss.detach() if done is None else done + loss.detach()
    if whole.policy_loss is not None:
        mode = "train" if self.model.training else "eval"
        self._metrics[mode]["policy_loss"].append(self.accelerator.gather(whole.policy_loss).nanmean().item())
    return loss + done


def _log_sampling_metrics(trainer: Any, mode: str, trainer_logps, sampling_logps, ratio, mask, sequence_level) -> None:
    """TRL's `sampling/*` metrics, computed where the ratio now is: in the loss."""
    from trl.trainer.utils import nanmax, nanmin

    accelerator = trainer.accelerator
    device = trainer_logps.device
    bool_mask = mask.bool()
    delta = torch.abs(trainer_logps - sampling_logps)
    delta = delta[bool_mask & ~torch.isnan(delta)]
    zero = torch.tensor(0.0, device=device)
    mean_delta = torch.mean(delta) if delta.numel() > 0 else zero
    max_delta = torch.max(delta) if delta.numel() > 0 else zero
    metrics = trainer._metrics[mode]
    metrics["sampling/sampling_logp_difference/mean"].append(accelerator.gather(mean_delta).mean().item())
    metrics["sampling/sampling_logp_difference/max"].append(accelerator.gather(max_delta).max().item())
    flat = ratio.flatten() if sequence_level else ratio[bool_mask]
    has = flat.numel() > 0
    metrics["sampling/importance_sampling_ratio/min"].append(
        nanmin(accelerator.gather(torch.min(flat) if has else zero)).item()
    )
    metrics["sampling/importance_sampling_ratio/mean"].append(
        accelerator.gather(torch.mean(flat) if has else zero).nanmean().item()
    )
    metrics["sampling/importance_sampling_ratio/max"].append(
        nanmax(accelerator.gather(torch.max(flat) if has else zero)).item()
    )


def _log_raw_sampling_metrics(trainer: Any, mode: str, stats: dict[str, torch.Tensor]) -> None:
    """`losses.importance_sampling_diagnostics` across processes: min of /min, max of /max, mean of the rest."""
    from trl.trainer.utils import nanmax, nanmin

    metrics = trainer._metrics[mode]
    for name, value in stats.items():
        gathered = trainer.accelerator.gather(value.detach().float().reshape(1))
        if name.endswith("/min"):
            reduced = nanmin(gathered)
        elif name.endswith("/max"):
            reduced = nanmax(gathered)
        else:
            reduced = gathered.nanmean()
        metrics[f"sampling/{name}"].append(reduced.item())


_MULTIMODAL_KEYS = (
    "pixel_values",
    "image_grid_thw",
    "num_images",
    "pixel_attention_mask",
    "spatial_shapes",
    "num_tiles",
    "image_sizes",
    "token_type_ids",
    "mm_token_type_ids",
    "image_position_ids",
)


@dataclass
class _WholeBatch:
    """Counts of the whole micro-batch while its loss is computed one sequence group at a time."""

    sequences: int
    tokens: torch.Tensor
    policy_loss: torch.Tensor | None = None  # summed over groups, logged once


def _turbo_compute_loss(self, model, inputs, whole: _WholeBatch | None = None):
    """The loss of `inputs`. For a group of the micro-batch's sequences (`whole`), reductions that average over
    the micro-batch divide by its counts, and the policy-loss metric is accumulated in `whole` for the caller."""
    from trl.trainer.utils import nanmax, nanmin

    prompt_ids, prompt_mask = inputs["prompt_ids"], inputs["prompt_mask"]
    completion_ids, completion_mask = inputs["completion_ids"], inputs["completion_mask"]
    input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
    attention_mask = torch.cat([prompt_mask, completion_mask], dim=1)
    logits_to_keep = completion_ids.size(1)
    mask = completion_mask if "tool_mask" not in inputs else completion_mask * inputs["tool_mask"]

    with _entropy_gradient(bool(self._entropy_bonus_enabled)):
        per_token_logps, entropies, aux_loss = self._get_per_token_logps_and_entropies(
            model,
            input_ids,
            attention_mask,
            logits_to_keep,
            compute_entropy=True,
            compute_aux_loss=self.aux_loss_enabled,
            **{key: inputs.get(key) for key in _MULTIMODAL_KEYS},
        )

    entropy_mask = None
    if self.top_entropy_quantile < 1.0:
        entropy_mask = self.get_high_entropy_mask(entropies, mask, 1 - self.top_entropy_quantile)

    mode = "train" if self.model.training else "eval"
    spec = losses.LossSpec.from_trainer(self)
    importance_sampling_ratio = inputs.get("importance_sampling_ratio")
    if spec.vllm_is_correction:
        # The policy at generation time: TRL's old-policy log-probs when it computed them, else (reused, see
        # _generate_and_score_completions) this very forward's.
        sampling = inputs["sampling_per_token_logps"]
        old = inputs.get("old_per_token_logps")
        trainer_logps = per_token_logps.detach() if old is None else old
        is_args = (trainer_logps, sampling, mask, spec.vllm_is_mode, spec.vllm_is_clip_min, spec.vllm_is_clip_max)
        if importance_sampling_ratio is None:
            importance_sampling_ratio = losses.vllm_importance_sampling_ratio(*is_args)
            _log_sampling_metrics(
                self, mode, trainer_logps, sampling, importance_sampling_ratio, mask,
                spec.vllm_is_mode.startswith("seq"),
            )
        _log_raw_sampling_metrics(self, mode, losses.importance_sampling_diagnostics(*is_args))

    batch = losses.LossInputs(
        per_token_logps=per_token_logps,
        mask=mask,
        advantages=inputs["advantages"],
        old_per_token_logps=inputs.get("old_per_token_logps"),
        ref_per_token_logps=inputs.get("ref_per_token_logps"),
        sampling_per_token_logps=inputs.get("sampling_per_token_logps"),
        importance_sampling_ratio=importance_sampling_ratio,
        entropy_mask=entropy_mask,
        # Clip-Cov's random subset: the same on every rank and rerun for a given (seed, micro-step)
        seed=self.args.seed * 1_000_003 + self._step,
    )
    training = mode == "train"
    accumulation = self.current_gradient_accumulation_steps if training else 1.0
    norm = losses.Normalizers(
        accumulation_steps=accumulation,
        num_items_in_batch=inputs.get("num_items_in_batch"),
        num_processes=self.accelerator.num_processes,
        steps_per_generation=self.args.steps_per_generation,
        max_completion_length=self.max_completion_length,
        training=training,
        batch_sequences=None if whole is None else whole.sequences,
        batch_tokens=None if whole is None else whole.tokens,
    )
    out = losses.grpo_loss(spec, batch, norm)
    loss = out.loss

    if self._entropy_bonus_enabled:
        effective_mask = mask if entropy_mask is None else mask * entropy_mask
        entropy_loss = losses.entropy_bonus(entropies, effective_mask, accumulation, norm.batch_tokens)
        if self.use_adaptive_entropy:
            apply_coef = self.entropy_coef if self._last_world_entropy <= self.args.entropy_target else 0.0
        else:
            apply_coef = self.entropy_coef
        loss = loss - apply_coef * entropy_loss
        if whole is None:
            self._metrics[mode]["policy_loss"].append(self.accelerator.gather(out.policy_loss).nanmean().item())
        else:
            whole.policy_loss = out.policy_loss if whole.policy_loss is None else whole.policy_loss + out.policy_loss
        if self.use_adaptive_entropy and training:
            _update_adaptive_entropy(self, entropies, effective_mask)
        if training and self.accelerator.sync_gradients:
            self._metrics[mode]["entropy_coef"].append(self.entropy_coef)

    if self.aux_loss_enabled:
        loss = loss + self.router_aux_loss_coef * aux_loss / accumulation
        self._metrics[mode]["aux_loss"].append(self.accelerator.gather_for_metrics(aux_loss).mean().item())

    advantages = batch.advantages.unsqueeze(1) if batch.advantages.dim() == 1 else batch.advantages

    def masked_seq_mean(x):
        if x.shape[1] == 1:
            return x.squeeze(1)
        return (x * mask).sum(-1) / mask.sum(-1)

    def global_masked_mean(x):
        if x.shape[1] == 1:
            local_sum, local_count = x.sum(), torch.tensor(float(x.shape[0]), device=x.device)
        else:
            local_sum, local_count = (x * mask).sum(), mask.sum().float()
        totals = self.accelerator.reduce(torch.stack([local_sum, local_count]), reduction="sum")
        return (totals[0] / totals[1].clamp(min=1.0)).item()

    metrics = self._metrics[mode]
    if spec.beta != 0.0:
        metrics["kl"].append(global_masked_mean(out.per_token_kl))
    metrics["entropy"].append(global_masked_mean(entropies))
    coef_1 = out.coef_1
    if spec.family in losses.RATIO_CLIP_FAMILIES or spec.family == "gmpo":
        low_bound, high_bound = spec.ratio_clip_bounds()
        is_low_clipped = (coef_1 < low_bound) & (advantages < 0)
        is_high_clipped = (coef_1 > high_bound) & (advantages > 0)
        is_region_clipped = is_low_clipped | is_high_clipped
        metrics["clip_ratio/low_mean"].append(global_masked_mean(is_low_clipped.float()))
        metrics["clip_ratio/high_mean"].append(global_masked_mean(is_high_clipped.float()))
        metrics["clip_ratio/region_mean"].append(global_masked_mean(is_region_clipped.float()))
        gathered_low_clip = self.accelerator.gather(masked_seq_mean(is_low_clipped.float()))
        metrics["clip_ratio/low_min"].append(nanmin(gathered_low_clip).item())
        gathered_high_clip = self.accelerator.gather(masked_seq_mean(is_high_clipped.float()))
        metrics["clip_ratio/high_max"].append(nanmax(gathered_high_clip).item())
    elif spec.family == "cispo":
        is_cispo_clipped = (coef_1 > spec.epsilon_high) & (advantages > 0)
        metrics["cispo_clip_ratio"].append(global_masked_mean(is_cispo_clipped.float()))
    elif spec.family == "vespo":
        metrics["vespo/phi_seq_mean"].append(global_masked_mean(out.phi_seq))
    if out.dual_clipped is not None:
        metrics["clip_ratio/dual_clip_mean"].append(global_masked_mean(out.dual_clipped.float()))
    if out.cov_selected is not None:
        metrics[f"{spec.loss_type}/selected_fraction"].append(global_masked_mean(out.cov_selected.float()))
    return loss


def _update_adaptive_entropy(self, entropies: torch.Tensor, effective_mask: torch.Tensor) -> None:
    """TRL's Skywork-OR1 adaptive entropy controller: window-global entropy, updated at optimizer-step boundaries."""
    stats = torch.stack([(entropies * effective_mask).sum(), effective_mask.sum()]).detach()
    self._entropy_window_stats = stats if self._entropy_window_stats is None else self._entropy_window_stats + stats
    if self.accelerator.sync_gradients:
        window_stats = self.accelerator.reduce(self._entropy_window_stats, reduction="sum")
        world_entropy = (window_stats[0] / window_stats[1].clamp(min=1.0)).item()
        args = self.args
        if world_entropy <= args.entropy_target:
            self.entropy_coef = min(self.entropy_coef + args.entropy_coef_delta, args.entropy_coef_max)
        else:
            self.entropy_coef = max(self.entropy_coef - args.entropy_coef_delta, args.entropy_coef_min)
        self._last_world_entropy = world_entropy
        self._entropy_window_stats = None


def apply() -> None:
    import trl.trainer.utils as trl_utils
    from trl.trainer.grpo_trainer import GRPOTrainer

    registry.set_attr(trl_utils, "_ChunkedLogProbFunction", FusedLogProbAdapter)
    for name, wrap in (
        ("_get_per_token_logps_and_entropies", _wrap_get_per_token_logps),
        ("_compute_loss", _wrap_compute_loss),
        ("_generate_and_score_completions", _wrap_generate_and_score),
    ):
        registry.set_attr(GRPOTrainer, name, wrap(GRPOTrainer.__dict__[name]))
