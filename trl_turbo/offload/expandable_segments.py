"""Expandable segments for the training process's CUDA allocations (`turbo_expandable_segments`).

Design decision: PyTorch's caching allocator gives every device allocation it makes its own segment, and a block freed
in one segment never merges with a neighbour in another. A training step whose tensors change size (a long forward's
layer inputs and tiles, FSDP2's gathered layers) leaves free blocks that later requests do not fit, and the device
keeps them: 17.6 GiB of the 67.4 GiB torch reserved in a 32B FSDP2 step whose tensors peaked at 49.8 GiB. With
PyTorch's expandable segments a stream's allocations share one growing address range, so freed neighbours merge.
PyTorch reads its settings from `PYTORCH_CUDA_ALLOC_CONF` (else the generic `PYTORCH_ALLOC_CONF`) when CUDA starts,
and a change at run time applies to the segments made afterwards; private pools (CUDA graphs, vLLM's sleep-mode pool)
never expand. trl_turbo sets both: `PYTORCH_CUDA_ALLOC_CONF` (the settings in force, with expandable segments added),
which vLLM's sleep-mode allocator reads to switch them off around its own pool and back on
(`vllm_contract.EXPANDABLE_SEGMENTS`), and the running allocator's setting where CUDA has started. The setting is the
process's: once on it stays on for later trainers, until `trl_turbo.unpatch()` takes back what trl_turbo wrote (a
value the user set since stays). The user's own word in the settings stands; a contrary one is refused at config time
(`checks`).
"""

from __future__ import annotations

import os

import torch

from .. import registry

ENV = "PYTORCH_CUDA_ALLOC_CONF"
GENERIC_ENV = "PYTORCH_ALLOC_CONF"  # read by PyTorch only where ENV is unset
KEY = "expandable_segments"
ON = f"{KEY}:True"


def settings_in_force() -> tuple[str, str | None]:
    """The variable PyTorch reads its allocator settings from, and its value (None: neither is set)."""
    for name in (ENV, GENERIC_ENV):
        if name in os.environ:
            return name, os.environ[name]
    return ENV, None


def configured(conf: str | None = None) -> bool | None:
    """What `conf` (default: the settings in force) says of expandable segments; None: nothing. PyTorch reads the
    last mention and takes only `True` or `False`: ValueError for another value."""
    if conf is None:
        conf = settings_in_force()[1] or ""
    chosen = None
    for option in conf.split(","):
        name, _, value = option.partition(":")
        if name.strip() != KEY:
            continue
        if value.strip() not in ("True", "False"):
            raise ValueError(f"`{KEY}:{value.strip()}` in the allocator settings is neither True nor False, the two "
                             "values PyTorch takes.")
        chosen = value.strip() == "True"
    return chosen


def enable() -> bool:
    """Turn expandable segments on for this process unless its allocator settings already name them; True where this
    call turned them on."""
    if configured() is not None:
        return False
    before, in_force = os.environ.get(ENV), settings_in_force()[1]
    ours = f"{in_force},{ON}" if in_force else ON
    os.environ[ENV] = ours
    _apply(True)
    registry.on_restore(lambda: _restore(before, ours))
    return True


def _restore(before: str | None, ours: str) -> None:
    """Put back the variable as it was before trl_turbo wrote `ours`, and the running allocator's setting, unless the
    variable has been set since (the user's word then stands)."""
    if os.environ.get(ENV) != ours:
        return
    if before is None:
        del os.environ[ENV]
    else:
        os.environ[ENV] = before
    _apply(False)


def _apply(on: bool) -> None:
    """The running allocator's setting, where CUDA has started (else the variable is read when it starts)."""
    if not torch.cuda.is_initialized():
        return
    setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None) or torch.cuda.memory._set_allocator_settings
    setter(f"{KEY}:{on}")
