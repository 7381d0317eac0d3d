"""The GRPOConfig of the GRPOTrainer being constructed, for the objects TRL builds inside its constructor.

Design decision: TRL never hands its config to some of the objects it builds (the vLLM engine among them). The
constructor wrapper (`trl_trainer_init`) sets a context variable for the duration of the call, and the patches of
those objects read it here; this module imports nothing of trl_turbo, so every patch can depend on it.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import Any

_constructing: contextvars.ContextVar[Any] = contextvars.ContextVar("trl_turbo_grpo_config", default=None)


def constructing_config() -> Any:
    """The GRPOConfig of the GRPOTrainer being constructed (None outside a constructor, or when TRL builds its
    default config because none was passed)."""
    return _constructing.get()


@contextlib.contextmanager
def constructing(config: Any) -> Iterator[None]:
    """`constructing_config()` is `config` inside the block."""
    token = _constructing.set(config)
    try:
        yield
    finally:
        _constructing.reset(token)
