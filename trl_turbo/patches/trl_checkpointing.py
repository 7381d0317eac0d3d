"""GRPOTrainer side of offloaded checkpointing and tiled MLPs: set them up on the model, report their traffic.

Seams: `configure` runs after TRL's `GRPOTrainer.__init__` (see `trl_trainer_init`): the model gets its
`CheckpointingRuntime`, Liger's layers or lean norms, and tiled MLPs, and transformers' patched `_set_gradient_checkpointing` keeps
trl_turbo's checkpoint function in place across every later enable. `GRPOTrainer.training_step`: after each
micro-step, the offload statistics go into TRL's metrics as `offload/*`.
"""

from __future__ import annotations

import functools
import os
from typing import Any

import torch

from ..offload import CheckpointOffloader
from . import registry
from .transformers_checkpointing import (
    CheckpointingRuntime,
    install_lean_norms,
    install_liger_layers,
    install_runtime,
    install_tiled_mlp,
)

_GIB = 2**30
_HOST_BUDGET_FRACTION = 0.8


def available_host_bytes() -> int:
    """MemAvailable from /proc/meminfo (Linux); elsewhere the OS's count of available pages."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def multi_process_checkpointing_unsupported(args: Any) -> bool:
    """trl_turbo's checkpoint function backpropagates each layer in a nested (reentrant) backward pass, and DDP marks
    a parameter ready twice then ("Expected to mark a variable ready only once"). Until issue #7 moves it onto
    non-reentrant checkpointing, several processes keep transformers' checkpointing (config.validate warns)."""
    return args.world_size > 1


def _base_model(model: torch.nn.Module) -> torch.nn.Module:
    get_base_model = getattr(model, "get_base_model", None)
    return get_base_model() if callable(get_base_model) else model


def configure(trainer: Any) -> CheckpointingRuntime | None:
    """Install trl_turbo's lean norms and checkpointing on the trainer's model per its GRPOConfig; returns the
    checkpointing runtime, None when checkpointing is off or neither offload nor tiling is wanted."""
    args = trainer.args
    model = _base_model(trainer.model)
    if getattr(args, "turbo_liger_layers", False):
        install_liger_layers(model)  # its norms save as little as the lean ones: they take their place
    elif getattr(args, "turbo_lean_norms", False):
        install_lean_norms(model)
    offload = bool(getattr(args, "turbo_offload_checkpoints", False))
    tiled = bool(getattr(args, "turbo_tiled_mlp", False))
    if not args.gradient_checkpointing or not (offload or tiled) or multi_process_checkpointing_unsupported(args):
        return None
    offloader = None
    if offload and next(model.parameters()).is_cuda:
        budget_gib = args.turbo_offload_host_budget_gib
        host_bytes = available_host_bytes() * _HOST_BUDGET_FRACTION if budget_gib is None else budget_gib * _GIB
        offloader = CheckpointOffloader(int(host_bytes))
    runtime = CheckpointingRuntime(offloader)
    install_runtime(model, runtime)
    if tiled:
        install_tiled_mlp(model, args.turbo_tiled_mlp_tokens)
    return runtime


def _wrap_training_step(original):
    @functools.wraps(original)
    def training_step(self, *args, **kwargs):
        loss = original(self, *args, **kwargs)
        runtime = getattr(self, "_trl_turbo_checkpointing", None)
        if runtime is not None and runtime.offloader is not None:
            stats = runtime.offloader.take_stats()
            metrics = self._metrics["train"]
            metrics["offload/offloaded_gib"].append(stats.offloaded_bytes / _GIB)
            metrics["offload/kept_on_device_gib"].append(stats.kept_on_device_bytes / _GIB)
            metrics["offload/host_peak_gib"].append(stats.host_bytes_peak / _GIB)
            metrics["offload/copy_wait_s"].append(stats.wait_s)
            metrics["offload/blocking_fetches"].append(float(stats.blocking_fetches))
        generation = getattr(self, "vllm_generation", None)
        if generation is not None:
            from .trl_vllm import drain_metrics

            for name, value in drain_metrics(generation).items():
                self._metrics["train"][name].append(value)
        return loss

    return training_step


def apply() -> None:
    from trl.trainer.grpo_trainer import GRPOTrainer

    registry.set_attr(GRPOTrainer, "training_step", _wrap_training_step(GRPOTrainer.__dict__["training_step"]))
