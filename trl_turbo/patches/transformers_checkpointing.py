"""Patches of transformers' gradient checkpointing: trl_turbo's checkpoint function stays in place, no hook leaks.

Seams:
- `PreTrainedModel._set_gradient_checkpointing` is where every enable lands. That includes `Trainer.train()` and
  the re-enables TRL performs around each generation and no-grad pass (with raw kwargs that break transformers'
  own `offload` option). After the original, a model that carries a `CheckpointingRuntime` (attached by the
  GRPOTrainer patch through `offload.install`) gets trl_turbo's checkpoint function back on each decoder layer of the
  tested dense families.
- `PreTrainedModel.enable_input_require_grads` registers a new embedding hook on every call and forgets the old
  handles, so TRL's re-enables pile up one hook per generation. The wrapper removes the previous hooks first.
On unpatch, every model configured through `offload.install` is detached (its installations undone).
"""

from __future__ import annotations

import functools

from .. import registry
from ..offload.install import detach_all_models, runtime_of, use_runtime_in_layers


def _wrap_set_gradient_checkpointing(original):
    @functools.wraps(original)
    def _set_gradient_checkpointing(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        runtime = runtime_of(self)
        if runtime is not None:
            use_runtime_in_layers(self, runtime)
        return result

    return _set_gradient_checkpointing


def _wrap_enable_input_require_grads(original):
    @functools.wraps(original)
    def enable_input_require_grads(self):
        self.disable_input_require_grads()
        return original(self)

    return enable_input_require_grads


def apply() -> None:
    from transformers import PreTrainedModel

    registry.set_attr(
        PreTrainedModel, "_set_gradient_checkpointing",
        _wrap_set_gradient_checkpointing(PreTrainedModel.__dict__["_set_gradient_checkpointing"]),
    )
    registry.set_attr(
        PreTrainedModel, "enable_input_require_grads",
        _wrap_enable_input_require_grads(PreTrainedModel.__dict__["enable_input_require_grads"]),
    )
    registry.on_restore(detach_all_models)
