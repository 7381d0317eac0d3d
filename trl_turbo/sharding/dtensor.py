"""A tensor as one rank holds it or as a whole, for plain tensors and FSDP2's DTensors alike: the code that merges,
casts or hands weights over works on both without asking which it has."""

from __future__ import annotations

import torch


def local_of(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (its storage: writes land in it), or the tensor itself."""
    to_local = getattr(tensor, "to_local", None)
    return to_local() if callable(to_local) else tensor


def whole_of(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor gathered whole (collective: every rank of its mesh calls it, in the same order), or the tensor."""
    full_tensor = getattr(tensor, "full_tensor", None)
    return full_tensor() if callable(full_tensor) else tensor


def shard_group_size(tensor: torch.Tensor) -> int:
    """How many ranks a DTensor's shards are spread over (the product of its mesh's sizes along its `Shard`
    placements; 1 for a replicated DTensor); 0 for a plain tensor."""
    placements = getattr(tensor, "placements", None)
    mesh = getattr(tensor, "device_mesh", None)
    if placements is None or mesh is None:
        return 0
    size = 1
    for dim, placement in enumerate(placements):
        if placement.is_shard():
            size *= mesh.size(dim)
    return size
