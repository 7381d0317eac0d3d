"""GRPOTrainer.training_step: trl_turbo's per-step metrics into TRL's, and the rollout sanity alarm.

Seam: `GRPOTrainer.training_step` is wrapped; after each micro-step the metrics of `trl_turbo.grpo.step_metrics`
(offload statistics, the device-memory peak, the memory plan, the colocated engine's timings), reduced over the ranks,
go into TRL's `_metrics["train"]`, which TRL averages over the logging interval; then the rollout alarm reads the
sampler/trainer gap TRL logged there.
"""

from __future__ import annotations

import functools

from .. import registry, run_plan
from ..grpo import step_metrics


def _wrap_training_step(original):
    @functools.wraps(original)
    def training_step(self, *args, **kwargs):
        loss = original(self, *args, **kwargs)
        logged = self._metrics["train"]
        for name, value in step_metrics.reduced_over_ranks(self.accelerator, step_metrics.step_values(self)).items():
            logged[name].append(value)
        step_metrics.check_rollout(self, logged, run_plan.of(self).rollout_check)
        return loss

    return training_step


def apply() -> None:
    from trl.trainer.grpo_trainer import GRPOTrainer

    registry.set_attr(GRPOTrainer, "training_step", _wrap_training_step(GRPOTrainer.__dict__["training_step"]))
