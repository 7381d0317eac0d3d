"""Autocast state captured in a forward pass and re-entered where its computation is redone (backward passes run
outside the forward's autocast): recomputed checkpoints, MLP tiles and gated products see the dtypes they saw."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

AutocastState = list[tuple[str, bool, torch.dtype]]


def autocast_state() -> AutocastState:
    return [(d, torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in ("cpu", "cuda")]


@contextlib.contextmanager
def restored_autocast(state: AutocastState) -> Iterator[None]:
    """Re-enter the autocast state `autocast_state()` captured."""
    with contextlib.ExitStack() as stack:
        for device_type, enabled, dtype in state:
            stack.enter_context(torch.autocast(device_type, dtype=dtype, enabled=enabled))
        yield
