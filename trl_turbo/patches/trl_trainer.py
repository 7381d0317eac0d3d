"""Patches of TRL's GRPOTrainer: fused log-probs, the loss from `trl_turbo.losses`, and skipping the redundant
old-log-prob forward.

Seams (all looked up by TRL at call time, so setting them is enough; nothing of TRL's source is rewritten):
- `trl.trainer.utils._ChunkedLogProbFunction`: the kernel behind TRL's fused LM head (`add_fused_lm_head`). TRL keeps
  doing everything around it (the backbone call through DDP/FSDP/ZeRO wrappers, ZeRO-3 head gathering, DTensor
  heads, scattering per-token values back to [B, T]); only the kernel is ours. Outside a GRPO log-prob pass, and for
  statistics our kernel does not produce, calls go to TRL's original.
- `GRPOTrainer._get_per_token_logps_and_entropies`: wrapped to tell the kernel, through a context variable, whether
  entropy is wanted at all (TRL's old/ref passes compute it and throw it away).
- `GRPOTrainer._compute_loss`: replaced by `trl_turbo.grpo.loss_step` (TRL's computation built from the single loss
  spec `trl_turbo.losses`, in sequence groups where the micro-batch is over the token budget:
  `trl_turbo.grpo.sequence_groups`); the entropy gradient is skipped in the kernel unless the entropy bonus is on.
- `GRPOTrainer._generate_and_score_completions`: TRL's vLLM-IS gate is held off for the duration of the call when
  the old-policy log-probs are provably the training forward's own (num_iterations == 1, generation aligned with the
  optimizer step), so TRL skips that whole extra forward, and whenever the IS mode is one TRL does not know
  (`losses.TURBO_IS_MODES`), so TRL's generation-time IS code never sees it. TRL still runs the old-log-prob forward
  when it needs it for its own reason (generation misaligned with optimizer steps). Whenever TRL produced no IS ratio,
  the loss computes it (same formula, `losses.vllm_importance_sampling_ratio`) from the old-policy log-probs when
  present, else from the training forward's detached log-probs, and logs TRL's sampling metrics. The raw ratio
  diagnostics (`losses.importance_sampling_diagnostics`) are logged from the loss on every step, whoever computed
  the ratio.
- `GRPOTrainer.create_scheduler` (transformers' Trainer method): after it, the optimizer exists and any LR scheduler
  has wrapped its step; with `turbo_offload_optimizer_states` the optimizer's states (all, or that share of them)
  then go to the host between steps (`offload.optimizer_states`).

Each replaced method consults `args.turbo_*` on every call, so with the switches off the trainer is stock TRL.
"""

from __future__ import annotations

import contextvars
import functools
import inspect
from dataclasses import dataclass

import torch

from .. import registry, run_plan
from ..config import Settings
from ..grpo import loss_step
from ..grpo.sequence_groups import sequence_groups
from ..grpo.step_plan import fused_loss_enabled, holds_is_gate
from ..offload import optimizer_states
from ..ops import fused_logprobs


@dataclass(frozen=True)
class _HeadOptions:
    compute_entropy: bool
    entropy_grad: bool | None
    chunk_tokens: int | None


_head_options: contextvars.ContextVar[_HeadOptions | None] = contextvars.ContextVar("trl_turbo_head", default=None)
_FUSED_OUTPUTS = frozenset({"log_probs", "entropy"})


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


def _wrap_get_per_token_logps(original):
    signature = inspect.signature(original)

    @functools.wraps(original)
    def _get_per_token_logps_and_entropies(self, *args, **kwargs):
        if not fused_loss_enabled(self):
            return original(self, *args, **kwargs)
        bound = signature.bind(self, *args, **kwargs)
        options = _HeadOptions(
            compute_entropy=bool(bound.arguments.get("compute_entropy", False)),
            entropy_grad=loss_step.entropy_gradient_wanted(),
            chunk_tokens=Settings.of(self.args).logprob_chunk_tokens,
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
        with registry.scoped(self, "vllm_importance_sampling_correction", False):
            return original(self, inputs)

    return _generate_and_score_completions


def _wrap_compute_loss(original):
    @functools.wraps(original)
    def _compute_loss(self, model, inputs):
        if not fused_loss_enabled(self):
            return original(self, model, inputs)
        groups = sequence_groups(self, inputs)
        if groups is None:
            return loss_step.compute_loss(self, model, inputs)
        return loss_step.grouped_compute_loss(self, model, inputs, groups)

    return _compute_loss


def _wrap_create_scheduler(original):
    @functools.wraps(original)
    def create_scheduler(self, *args, **kwargs):
        scheduler = original(self, *args, **kwargs)
        # the optimizer exists by now, prepared or not, and an LR scheduler has wrapped what it steps
        share = run_plan.of(self).memory.optimizer_states_offload
        if share and getattr(self, "optimizer", None) is not None:
            optimizer_states.install(self.optimizer, self.accelerator.device, share)
        return scheduler

    return create_scheduler


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
    registry.set_attr(GRPOTrainer, "create_scheduler", _wrap_create_scheduler(GRPOTrainer.create_scheduler))
