"""The rollout sanity alarm: from the sampler/trainer log-prob gap TRL already computes, notice that vLLM sampled
from weights other than the live policy (a stale or missing adapter, unrestored or unmerged weights) and say so.

Design decision: the gap (mean |log p_vLLM - log p_trainer| per completion token) has a floor set by numerics: kernel
and precision differences between the two engines, the same for every step of a healthy run whatever the policy
does. The first `warmup` observations set that floor (LoRA's B starts at zero, so early on even a sampler without the
adapter agrees with the trainer: the alarm measures drift, not a fixed threshold a model's numerics might exceed).
A sampler that stopped following the policy diverges from the trainer as the adapter trains; the alarm trips when
the gap stays above max(`factor` x floor, floor + `margin`) for `patience` observations in a row, once per run.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field


class RolloutMismatch(RuntimeError):
    """vLLM's samples do not come from the policy being trained (`turbo_rollout_check='error'`)."""


@dataclass
class RolloutCheck:
    warmup: int = 2
    factor: float = 4.0
    margin: float = 0.02  # nats per token
    patience: int = 2
    floor: float | None = None
    _early: list[float] = field(default_factory=list)
    _above: list[float] = field(default_factory=list)
    tripped: bool = False

    def observe(self, gap: float) -> str | None:
        """Take one step's mean gap; returns the alarm's message the first time it trips, else None."""
        if self.tripped or not math.isfinite(gap):
            return None
        if self.floor is None:
            self._early.append(gap)
            if len(self._early) == self.warmup:
                self.floor = min(self._early)
            return None
        if gap <= self.threshold:
            self._above.clear()
            return None
        self._above.append(gap)
        if len(self._above) < self.patience:
            return None
        self.tripped = True
        recent = ", ".join(f"{g:.4f}" for g in self._above)
        return (f"trl_turbo: vLLM's samples do not come from the policy being trained. The mean |log p_vLLM - "
                f"log p_trainer| per completion token was {recent} over the last {len(self._above)} steps, against "
                f"{self.floor:.4f} in the first {self.warmup} (alarm above {self.threshold:.4f}). The sampler is "
                "likely using other weights than the trainer: a stale or missing adapter, base weights changed or "
                "not restored, or an adapter that never reached vLLM. The importance-sampling correction hides "
                "part of this, but the run trains off-policy. Set `turbo_rollout_check='off'` to silence this, or "
                "'error' to stop the run when it happens.")

    @property
    def threshold(self) -> float:
        assert self.floor is not None
        return max(self.factor * self.floor, self.floor + self.margin)
