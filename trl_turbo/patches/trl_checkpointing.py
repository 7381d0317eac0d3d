"""GRPOTrainer side of the memory policy: put it on the trainer's model.

Seam: `configure` runs after TRL's `GRPOTrainer.__init__` (see `trl_trainer_init`) and hands the plan's memory
policy to `offload.setup.apply_memory_policy` (Liger's layers or lean norms, the checkpointing runtime, tiled MLPs);
transformers' patched `_set_gradient_checkpointing` keeps trl_turbo's checkpoint function in place across every later
enable. The offload statistics reach TRL's metrics through `trl_step_metrics`.
"""

from __future__ import annotations

from typing import Any

import torch

from ..offload.setup import apply_memory_policy
from ..run_plan import RunPlan, footprint_of


def _base_model(model: torch.nn.Module) -> torch.nn.Module:
    get_base_model = getattr(model, "get_base_model", None)
    return get_base_model() if callable(get_base_model) else model


def configure(trainer: Any, plan: RunPlan) -> None:
    """Install the plan's memory features on the trainer's model (its checkpointing runtime, where one is installed,
    is `offload.install.runtime_of(model)`)."""
    model = _base_model(trainer.model)
    if model is None:
        return
    footprint = footprint_of(trainer) if getattr(trainer, "vllm_generation", None) is not None else None
    # The accelerator's device, not the parameters': DeepSpeed and FSDP move the model there only when training
    # starts, after this runs.
    apply_memory_policy(model, plan.memory, trainer.accelerator.device, plan.settings.offload_host_budget_gib,
                        footprint)
