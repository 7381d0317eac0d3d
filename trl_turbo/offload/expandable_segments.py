"""Expandable segments for the training process's CUDA allocations (`turbo_expandable_segments`).

Design decision: PyTorch's caching allocator gives every device allocation it makes its own segment, and a block freed
in one segment never merges with a neighbour in another. A training step whose tensors change size (a long forward's
layer inputs and tiles, FSDP2's gathered layers) leaves free blocks that later requests do not fit, and the device
keeps them: 17.5 GiB of the 67.4 GiB torch reserved in a 32B FSDP2 step whose tensors peaked at 49.8 GiB. With
PyTorch's expandable segments a stream's allocations share one growing address range, so freed neighbours merge.
PyTorch reads the setting from `PYTORCH_CUDA_ALLOC_CONF` when CUDA starts, and a change at run time applies to the
segments made afterwards; private pools (CUDA graphs, vLLM's sleep-mode pool) never expand. trl_turbo sets both: the
variable, which vLLM's sleep-mode allocator reads to switch the setting off around its own pool and back on, and the
running allocator's setting where CUDA has started. The user's own word in the variable stands (a contrary one is
refused at config time, `checks`); `trl_turbo.unpatch()` puts the variable and the setting back.
"""

from __future__ import annotations

import os

import torch

from .. import registry

ENV = "PYTORCH_CUDA_ALLOC_CONF"
KEY = "expandable_segments"


def configured(conf: str | None = None) -> bool | None:
    """What `conf` (default: the process's `PYTORCH_CUDA_ALLOC_CONF`) says of expandable segments; None: nothing."""
    conf = os.environ.get(ENV, "") if conf is None else conf
    chosen = None
    for option in conf.split(","):
        name, _, value = option.partition(":")
        if name.strip() == KEY:
            chosen = value.strip() == "True"  # PyTorch reads the last mention
    return chosen


def enable() -> bool:
    """Turn expandable segments on for this process unless its `PYTORCH_CUDA_ALLOC_CONF` already names them; True
    where this call turned them on."""
    if configured() is not None:
        return False
    before = os.environ.get(ENV)
    os.environ[ENV] = f"{before},{KEY}:True" if before else f"{KEY}:True"
    _apply(True)
    registry.on_restore(lambda: _restore(before))
    return True


def _restore(before: str | None) -> None:
    if before is None:
        os.environ.pop(ENV, None)
    else:
        os.environ[ENV] = before
    _apply(False)


def _apply(on: bool) -> None:
    """The running allocator's setting, where CUDA has started (else the variable is read when it starts)."""
    if not torch.cuda.is_initialized():
        return
    setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None) or torch.cuda.memory._set_allocator_settings
    setter(f"{KEY}:{on}")
