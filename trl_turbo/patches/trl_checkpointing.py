"""GRPOTrainer side of offloaded checkpointing and tiled MLPs: set them up on the model.

Seam: `configure` runs after TRL's `GRPOTrainer.__init__` (see `trl_trainer_init`): the model gets its
`CheckpointingRuntime`, Liger's layers or lean norms, and tiled MLPs, and transformers' patched
`_set_gradient_checkpointing` keeps trl_turbo's checkpoint function in place across every later enable. The offload
statistics reach TRL's metrics through `trl_step_metrics`.
"""

from __future__ import annotations

import logging
import weakref
from typing import Any

import torch

from ..config import liger_layers_enabled, memory_plan
from ..distributed import CHECKPOINTING_FEATURES, unsupported_features
from ..host_memory import offload_budget_bytes
from ..offload import CheckpointOffloader
from ..offload.install import (
    CheckpointingRuntime,
    detach_model,
    install_lean_norms,
    install_liger_layers,
    install_runtime,
    install_tiled_mlp,
    memory_planner,
)
from ..vllm.engine_plan import generation_footprint

_logger = logging.getLogger("trl_turbo")
_said_without_cuda: list[bool] = [False]


def say_what_auto_means_without_cuda(args: Any, device: torch.device) -> str | None:
    """Once per process, at INFO level: on a device without CUDA the automatic plan has nothing to save memory for,
    so it keeps every activation and offloads nothing. Returns the message
    the first time (None after, or where it does not apply)."""
    if device.type == "cuda" or memory_plan(args) != "auto" or not args.gradient_checkpointing or _said_without_cuda[0]:
        return None
    _said_without_cuda[0] = True
    message = (f"trl_turbo: no CUDA device ({device.type}): turbo_memory_plan='auto' keeps every layer's activations "
               "(no recompute, as without gradient_checkpointing) and offloads nothing; the loss and norm "
               "features keep their settings.")
    _logger.info(message)
    return message


def strategy_keeps_stock_checkpointing(args: Any) -> bool:
    """Under ZeRO-3 and FSDP, parameters are whole only inside their module's call, where trl_turbo's checkpoint
    function and tiled MLP cannot reach them; those runs keep transformers' checkpointing (config.validate warns)."""
    return bool(unsupported_features(args, list(CHECKPOINTING_FEATURES)))


def _base_model(model: torch.nn.Module) -> torch.nn.Module:
    get_base_model = getattr(model, "get_base_model", None)
    return get_base_model() if callable(get_base_model) else model


def configure(trainer: Any) -> CheckpointingRuntime | None:
    """Install trl_turbo's lean norms and checkpointing on the trainer's model per its GRPOConfig; returns the
    checkpointing runtime, None when checkpointing is off, `turbo_memory_plan='off'`, or there is nothing to install
    (no plan, offload or tiling)."""
    args = trainer.args
    model = _base_model(trainer.model)
    if model is not None:  # what an earlier trainer on this model installed: this one installs what its config asks
        detach_model(model)
    plan = memory_plan(args)
    if liger_layers_enabled(args):
        install_liger_layers(model)  # its norms save as little as the lean ones: they take their place
    elif getattr(args, "turbo_lean_norms", False) and plan != "off":
        install_lean_norms(model)
    offload = bool(getattr(args, "turbo_offload_checkpoints", False))
    tiled = bool(getattr(args, "turbo_tiled_mlp", False))
    if (plan == "off" or not args.gradient_checkpointing or not (plan == "auto" or offload or tiled)
            or strategy_keeps_stock_checkpointing(args)):
        return None
    say_what_auto_means_without_cuda(args, trainer.accelerator.device)
    offloader = None
    # The accelerator's device, not the parameters': DeepSpeed and FSDP move the model there only when training
    # starts, after this runs.
    if offload and trainer.accelerator.device.type == "cuda":
        offloader = CheckpointOffloader(offload_budget_bytes(args.turbo_offload_host_budget_gib))
    planner = memory_planner(model, can_offload=offloader is not None) if plan == "auto" else None
    generation = getattr(trainer, "vllm_generation", None)
    training_memory = getattr(args, "turbo_training_memory_gib", None)
    if planner is not None and training_memory is not None:
        planner.ceiling = lambda: int(training_memory * 2**30)  # the user's budget for the training phase
    elif planner is not None and generation is not None:
        # A colocated engine in standby: training grows back at most to what the last generation used
        generation_ref = weakref.ref(generation)
        planner.ceiling = lambda: generation_footprint(generation_ref())  # None once the engine is gone
    runtime = CheckpointingRuntime(offloader, planner)
    install_runtime(model, runtime)
    if tiled or planner is not None:  # without tiles: the lean gated product of the layers the plan keeps
        install_tiled_mlp(model, args.turbo_tiled_mlp_tokens if tiled else None,
                          untile_post_norm=planner.keeps_layers if planner is not None else None)
    return runtime
