"""The body of GRPOTrainer's `_compute_loss` under trl_turbo: TRL's loss step rebuilt on the one loss spec
(`trl_turbo.losses`), with TRL's metrics, the adaptive-entropy controller and sequence groups.

Design decision: this is the method TRL's `_compute_loss` would run, so it reads the trainer instance as that method
does (its `_metrics`, entropy-controller state, `_get_per_token_logps_and_entropies`); it patches nothing.
`trl_turbo.patches.trl_trainer` installs it and is the only place that touches TRL's classes. The kernel learns
whether the entropy needs a gradient through a context variable (`entropy_gradient`), set here and read by the
seam that configures TRL's fused LM head.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from .. import losses
from .sequence_groups import slice_inputs

_entropy_grad: contextvars.ContextVar[bool | None] = contextvars.ContextVar("trl_turbo_entropy_grad", default=None)


def entropy_gradient_wanted() -> bool | None:
    """Whether the loss being computed needs the entropy's gradient (None: outside trl_turbo's loss)."""
    return _entropy_grad.get()


@contextlib.contextmanager
def entropy_gradient(needed: bool) -> Iterator[None]:
    token = _entropy_grad.set(needed)
    try:
        yield
    finally:
        _entropy_grad.reset(token)


def grouped_compute_loss(self, model, inputs, groups: list[slice]):
    """Forward and backward one sequence group at a time, so activations scale with a group, not the micro-batch.
    All groups but the last are backpropagated here; the returned loss carries the last group's graph and the
    others' values, so the Trainer's own backward completes the step and logs the whole micro-batch's loss."""
    sequences = inputs["prompt_ids"].size(0)
    mask = inputs["completion_mask"] if "tool_mask" not in inputs else inputs["completion_mask"] * inputs["tool_mask"]
    whole = WholeBatch(sequences=sequences, tokens=mask.sum())
    done = None
    for index, rows in enumerate(groups):
        loss = compute_loss(self, model, slice_inputs(inputs, rows, sequences), whole)
        if index < len(groups) - 1:
            self.accelerator.backward(loss)
            done = loss.detach() if done is None else done + loss.detach()
    if whole.policy_loss is not None:
        mode = "train" if self.model.training else "eval"
        self._metrics[mode]["policy_loss"].append(self.accelerator.gather(whole.policy_loss).nanmean().item())
    return loss + done


def log_sampling_metrics(trainer: Any, mode: str, trainer_logps, sampling_logps, ratio, mask, sequence_level) -> None:
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
    p95_delta = torch.quantile(delta.float(), 0.95) if 0 < delta.numel() <= 2**24 else max_delta
    metrics = trainer._metrics[mode]
    metrics["sampling/sampling_logp_difference/mean"].append(accelerator.gather(mean_delta).mean().item())
    metrics["sampling/sampling_logp_difference/max"].append(accelerator.gather(max_delta).max().item())
    # trl_turbo's addition (the rollout check's tail): each rank's 95th percentile, averaged over ranks
    metrics["sampling/sampling_logp_difference/p95"].append(accelerator.gather(p95_delta).mean().item())
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


def log_raw_sampling_metrics(trainer: Any, mode: str, stats: dict[str, torch.Tensor]) -> None:
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
class WholeBatch:
    """Counts of the whole micro-batch while its loss is computed one sequence group at a time."""

    sequences: int
    tokens: torch.Tensor
    policy_loss: torch.Tensor | None = None  # summed over groups, logged once


def compute_loss(self, model, inputs, whole: WholeBatch | None = None):
    """The loss of `inputs`. For a group of the micro-batch's sequences (`whole`), reductions that average over
    the micro-batch divide by its counts, and the policy-loss metric is accumulated in `whole` for the caller."""
    from trl.trainer.utils import nanmax, nanmin

    prompt_ids, prompt_mask = inputs["prompt_ids"], inputs["prompt_mask"]
    completion_ids, completion_mask = inputs["completion_ids"], inputs["completion_mask"]
    input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
    attention_mask = torch.cat([prompt_mask, completion_mask], dim=1)
    logits_to_keep = completion_ids.size(1)
    mask = completion_mask if "tool_mask" not in inputs else completion_mask * inputs["tool_mask"]

    with entropy_gradient(bool(self._entropy_bonus_enabled)):
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
            log_sampling_metrics(
                self, mode, trainer_logps, sampling, importance_sampling_ratio, mask,
                spec.vllm_is_mode.startswith("seq"),
            )
        log_raw_sampling_metrics(self, mode, losses.importance_sampling_diagnostics(*is_args))

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
            update_adaptive_entropy(self, entropies, effective_mask)
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


def update_adaptive_entropy(self, entropies: torch.Tensor, effective_mask: torch.Tensor) -> None:
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
