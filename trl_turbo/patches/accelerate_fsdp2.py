"""accelerate's FSDP2 preparation (`accelerate.accelerator.fsdp2_prepare_model`): where a shared-weight engine waits
on the policy model, FSDP2 shards it on vLLM's tensor-parallel dimensions and its frozen shards become the engine's.

Seam: the module attribute `fsdp2_prepare_model` that `Accelerator.prepare_model` calls. For that call only,
`torch.distributed.fsdp.fully_shard` (which accelerate imports inside the function) gets the placement and mesh of
the waiting `trl_turbo.vllm.sharded.ShardedShare`, and `fsdp2_load_full_state_dict` (the module attribute accelerate
calls with `cpu_ram_efficient_loading`) writes each shared shard of rank 0's broadcast weights straight into the
engine; once accelerate is done (its fp32 upcast, that broadcast), the share is completed. Every other model is
prepared as accelerate does it.
"""

from __future__ import annotations

import functools

from .. import registry
from ..vllm.sharded import pending_share

__all__ = ["apply"]


def _wrap_fsdp2_prepare_model(original):
    @functools.wraps(original)
    def fsdp2_prepare_model(accelerator, model):
        share = pending_share(model)
        if share is None:
            return original(accelerator, model)
        import accelerate.utils.fsdp_utils as fsdp_utils
        import torch.distributed.fsdp as fsdp

        placing = share.placing(fsdp.fully_shard, model, accelerator.device.type)
        loading = share.loading_in_place(fsdp_utils.fsdp2_load_full_state_dict)
        with (registry.scoped(fsdp, "fully_shard", placing),
              registry.scoped(fsdp_utils, "fsdp2_load_full_state_dict", loading)):
            prepared = original(accelerator, model)
        share.complete(prepared)
        return prepared

    return fsdp2_prepare_model


def apply() -> None:
    import accelerate.accelerator

    registry.set_attr(accelerate.accelerator, "fsdp2_prepare_model",
                      _wrap_fsdp2_prepare_model(accelerate.accelerator.fsdp2_prepare_model))
