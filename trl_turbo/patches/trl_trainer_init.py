"""`GRPOTrainer.__init__`: the one wrapper around TRL's constructor.

While TRL's constructor runs, the trainer's GRPOConfig is visible through `construction.constructing_config()`.
Objects TRL builds inside it never receive the config, the vLLM engine among them, and this lets their patches read
it. After the
constructor, the model-side features are installed: lean norms, the checkpointing runtime, tiled MLPs. Before it,
loss settings the trainer class would ignore or not know and inputs that the shared-weights engine cannot serve are
refused, so no model loads for a run that would fail.
"""

from __future__ import annotations

import functools
import inspect

from .. import registry
from ..vllm.engine_plan import check_trainer_inputs
from . import trl_checkpointing
from .construction import constructing
from .trl_trainer import check_loss_owner


def _wrap_init(original):
    signature = inspect.signature(original)

    @functools.wraps(original)
    def __init__(self, *args, **kwargs):
        bound = signature.bind_partial(self, *args, **kwargs).arguments
        config = bound.get("args")
        check_loss_owner(type(self), config)
        check_trainer_inputs(config, bound.get("model"), bound.get("peft_config"), bound.get("quantization_config"))
        with constructing(config):
            original(self, *args, **kwargs)
        self._trl_turbo_checkpointing = trl_checkpointing.configure(self)

    return __init__


def apply() -> None:
    from trl.trainer.grpo_trainer import GRPOTrainer

    registry.set_attr(GRPOTrainer, "__init__", _wrap_init(GRPOTrainer.__dict__["__init__"]))
