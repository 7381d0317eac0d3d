"""`GRPOTrainer.__init__`: the one wrapper around TRL's constructor, where the trainer's run plan is built.

Before TRL's constructor the plan is begun (`run_plan.begin`), whose trainer-init checks refuse what the trainer
class or the colocated engine cannot serve, so no model loads for a run that would fail. While TRL's constructor
runs, the plan in progress is visible through `construction.constructing_plan()`: the vLLM seam records the engine
plan in it; the allocator's expandable segments, where asked for, are on before it starts. After the constructor the
plan is finished and kept on the trainer (`run_plan.of(trainer)`), and the model-side features of its memory policy
are installed (`patches.trl_checkpointing`).
"""

from __future__ import annotations

import functools
import inspect

from .. import registry, run_plan
from ..offload import expandable_segments
from . import trl_checkpointing
from .construction import constructing


def _wrap_init(original):
    signature = inspect.signature(original)

    @functools.wraps(original)
    def __init__(self, *args, **kwargs):
        bound = signature.bind_partial(self, *args, **kwargs).arguments
        progress = run_plan.begin(type(self), bound.get("args"), bound.get("model"), bound.get("peft_config"),
                                  bound.get("quantization_config"))
        if progress.settings.expandable_segments:  # before TRL's constructor builds the engine and moves the model
            expandable_segments.enable()
        with constructing(progress):
            original(self, *args, **kwargs)
        plan = run_plan.finish(progress, self)
        self.__dict__[run_plan.PLAN_ATTRIBUTE] = plan
        trl_checkpointing.configure(self, plan)

    return __init__


def apply() -> None:
    from trl.trainer.grpo_trainer import GRPOTrainer

    registry.set_attr(GRPOTrainer, "__init__", _wrap_init(GRPOTrainer.__dict__["__init__"]))
