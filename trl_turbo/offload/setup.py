"""Putting a run's memory policy on its model: Liger's layers or lean norms, the checkpointing runtime with its
offloader and memory planner, and tiled MLPs.

Design decision: what to install is decided once (`offload.policy.MemoryPolicy`); this module only carries it out,
for the trainer's seam (`patches.trl_checkpointing`) and anything else that trains a transformers model.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from ..host_memory import offload_budget_bytes
from .checkpoint import CheckpointOffloader
from .install import (
    CheckpointingRuntime,
    detach_model,
    install_lean_norms,
    install_liger_layers,
    install_runtime,
    install_tiled_mlp,
    memory_planner,
)
from .policy import CeilingSource, MemoryPolicy

_logger = logging.getLogger("trl_turbo")
_said_without_cuda: list[bool] = [False]


def say_what_auto_means_without_cuda(policy: MemoryPolicy, device: torch.device) -> str | None:
    """Once per process, at INFO level: on a device without CUDA the automatic plan has nothing to save memory for,
    so it keeps every activation and offloads nothing. Returns the message the first time (None after, or where it
    does not apply)."""
    if device.type == "cuda" or not policy.planner or _said_without_cuda[0]:
        return None
    _said_without_cuda[0] = True
    message = (f"trl_turbo: no CUDA device ({device.type}): turbo_memory_plan='auto' keeps every layer's activations "
               "(no recompute, as without gradient_checkpointing) and offloads nothing; the loss and norm "
               "features keep their settings.")
    _logger.info(message)
    return message


def apply_memory_policy(model: torch.nn.Module, policy: MemoryPolicy, device: torch.device,
                        host_budget_gib: float | None,
                        generation_footprint: Callable[[], int | None] | None = None) -> CheckpointingRuntime | None:
    """Install what `policy` asks for on `model` (the base model, not its PEFT wrapper), after undoing what an earlier
    trainer installed on it; returns the checkpointing runtime (None: transformers' checkpointing stays).
    `generation_footprint`: the device memory the colocated engine's last generation used (the ceiling in standby)."""
    detach_model(model)
    if policy.liger:
        install_liger_layers(model)  # its norms save as little as the lean ones: they take their place
    elif policy.lean_norms:
        install_lean_norms(model)
    if not policy.checkpointing:
        return None
    say_what_auto_means_without_cuda(policy, device)
    offloader = CheckpointOffloader(offload_budget_bytes(host_budget_gib)) if policy.offload else None
    planner = memory_planner(model, can_offload=offloader is not None) if policy.planner else None
    if planner is not None and policy.ceiling is CeilingSource.USER:
        ceiling_bytes = int(policy.ceiling_gib * 2**30)
        planner.ceiling = lambda: ceiling_bytes  # the user's budget for the training phase
    elif planner is not None and policy.ceiling is CeilingSource.GENERATION and generation_footprint is not None:
        planner.ceiling = generation_footprint  # training grows back at most to what the last generation used
    runtime = CheckpointingRuntime(offloader, planner)
    install_runtime(model, runtime)
    if policy.tiled_mlp_tokens is not None or planner is not None:  # untiled: the kept layers' lean gated product
        install_tiled_mlp(model, policy.tiled_mlp_tokens,
                          untile_post_norm=planner.keeps_layers if planner is not None else None)
    return runtime
