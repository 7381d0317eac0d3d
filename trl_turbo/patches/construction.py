"""The run plan of the GRPOTrainer being constructed, for the objects TRL builds inside its constructor.

Design decision: TRL never hands its config to some of the objects it builds (the vLLM engine among them). The
constructor wrapper (`trl_trainer_init`) sets a context variable to the plan in progress (`run_plan.PlanInProgress`)
for the duration of the call; the patches of those objects read its config and record their decisions in it. This
module imports nothing of trl_turbo, so every patch can depend on it.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import Any

_constructing: contextvars.ContextVar[Any] = contextvars.ContextVar("trl_turbo_run_plan", default=None)


def constructing_plan() -> Any:
    """The plan in progress of the GRPOTrainer being constructed (None outside a constructor)."""
    return _constructing.get()


def constructing_config() -> Any:
    """The GRPOConfig of the GRPOTrainer being constructed (None outside a constructor, or when TRL builds its
    default config because none was passed)."""
    return getattr(_constructing.get(), "config", None)


@contextlib.contextmanager
def constructing(plan: Any) -> Iterator[None]:
    """`constructing_plan()` is `plan` inside the block."""
    token = _constructing.set(plan)
    try:
        yield
    finally:
        _constructing.reset(token)
