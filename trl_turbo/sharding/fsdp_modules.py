"""FSDP2-wrapped modules as the rest of the package sees them: by their own class, and with their shards in place.

Design decision: `fully_shard` swaps a module's class for one it makes (`FSDP<name>`), and between a forward and the
next backward it may leave parameters gathered: the root's always, every layer's under `reshard_after_forward=False`.
Code that matches layers by class name, or that writes into or frees FSDP2's shards, goes through these functions
instead of asking which state the model is in.
"""

from __future__ import annotations

import torch


def own_class_name(module: torch.nn.Module) -> str:
    """The name of `module`'s own class, also once FSDP2's `fully_shard` has wrapped it: that swaps the class for one
    it makes, `FSDP<name>`, deriving from (`FSDPModule`, the module's class)."""
    cls = type(module)
    bases = cls.__bases__
    if cls.__name__.startswith("FSDP") and len(bases) == 2 and bases[0].__name__ == "FSDPModule":
        cls = bases[1]
    return cls.__name__


def reshard_all(model: torch.nn.Module) -> int:
    """Put every FSDP2 module of `model` back on its shards, so that each parameter is the DTensor whose local shard
    is FSDP2's storage. Local to the rank (no collective) and a no-op where already sharded; returns how many FSDP2
    modules there were."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # a torch without FSDP2 shards nothing
        return 0
    modules = [module for module in model.modules() if isinstance(module, FSDPModule)]
    for module in modules:
        module.reshard()
    return len(modules)
