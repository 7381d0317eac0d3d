"""A tensor as one rank holds it or as a whole, for plain tensors and FSDP2's DTensors alike: the code that merges,
casts or hands weights over works on both without asking which it has."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import TypeVar

import torch

T = TypeVar("T")


def local_of(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (its storage: writes land in it), or the tensor itself."""
    to_local = getattr(tensor, "to_local", None)
    return to_local() if callable(to_local) else tensor


def with_local(like: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """`local` laid out as `like`: itself where `like` is a plain tensor, else a DTensor of `like`'s mesh,
    placements, shape and stride whose local shard is `local` (the inverse of `local_of`)."""
    if local_of(like) is like:
        return local
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(local, like.device_mesh, like.placements, run_check=False, shape=like.shape,
                              stride=like.stride())


def whole_of(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor gathered whole (collective: every rank of its mesh calls it, in the same order), or the tensor."""
    full_tensor = getattr(tensor, "full_tensor", None)
    return full_tensor() if callable(full_tensor) else tensor


def wholes_of(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """`whole_of` of each tensor, with one all-gather for all the DTensors sharded on dim 0 over the same mesh
    dimension (FSDP2's layout; replicated over the others, as under HSDP) instead of one per tensor; those carry no
    autograd history. Collective: every rank of the mesh calls it with the same tensors in the same order. Other
    DTensors go one at a time."""
    wholes: list[torch.Tensor | None] = [None] * len(tensors)
    groups: dict[tuple, list[int]] = {}
    for index, tensor in enumerate(tensors):
        key = _row_sharded_key(tensor)
        if key is None:
            wholes[index] = whole_of(tensor)
        else:
            groups.setdefault(key, []).append(index)
    for (_, mesh_dim, _, _), indices in groups.items():
        gathered = _gather_row_shards([tensors[i] for i in indices], mesh_dim)
        for index, whole in zip(indices, gathered, strict=True):
            wholes[index] = whole
    return wholes  # type: ignore[return-value]


def byte_runs(items: Sequence[T], nbytes: Callable[[T], int], limit: int) -> list[list[T]]:
    """`items` in order, cut into runs whose `nbytes` reach `limit` (the last one may be smaller): the batches of one
    `wholes_of` call each, which bound what is gathered at once."""
    runs: list[list[T]] = []
    current: list[T] = []
    size = 0
    for item in items:
        current.append(item)
        size += nbytes(item)
        if size >= limit:
            runs.append(current)
            current, size = [], 0
    return runs + [current] if current else runs


def _row_sharded_key(tensor: torch.Tensor) -> tuple | None:
    """(mesh, its sharded dimension, dtype, device) of a DTensor sharded on dim 0 along exactly one mesh dimension and
    replicated along the others; None for anything else."""
    placements = getattr(tensor, "placements", None)
    mesh = getattr(tensor, "device_mesh", None)
    if placements is None or mesh is None or tensor.dim() == 0:
        return None
    shards = [dim for dim, placement in enumerate(placements) if placement.is_shard()]
    if len(shards) != 1 or placements[shards[0]].dim != 0 or \
            not all(p.is_replicate() for i, p in enumerate(placements) if i != shards[0]):
        return None
    return id(mesh), shards[0], tensor.dtype, tensor.device


@torch.no_grad()
def _gather_row_shards(tensors: list[torch.Tensor], mesh_dim: int) -> list[torch.Tensor]:
    """Whole tensors from their dim-0 shards over `mesh_dim`, in one all-gather: each rank's shards are padded to
    the chunk size (the first ranks hold ceil(rows / ranks) rows, as `torch.chunk` splits) and laid end to end."""
    import torch.distributed as dist

    mesh = tensors[0].device_mesh
    ranks = mesh.size(mesh_dim)
    layouts = []  # (rows per chunk, elements per row) of each tensor
    for tensor in tensors:
        rows = tensor.shape[0]
        layouts.append((-(-rows // ranks), math.prod(tensor.shape[1:])))  # (indexing a DTensor would gather it)
    width = sum(chunk * row for chunk, row in layouts)
    local = torch.zeros(width, dtype=tensors[0].dtype, device=local_of(tensors[0]).device)
    offset = 0
    for tensor, (chunk, row) in zip(tensors, layouts, strict=True):
        shard = local_of(tensor).reshape(-1)
        local[offset:offset + shard.numel()] = shard
        offset += chunk * row
    gathered = torch.empty(ranks * width, dtype=local.dtype, device=local.device)
    dist.all_gather_into_tensor(gathered, local, group=mesh.get_group(mesh_dim))
    per_rank = gathered.view(ranks, width)
    wholes, offset = [], 0
    for tensor, (chunk, row) in zip(tensors, layouts, strict=True):
        rows = tensor.shape[0]
        parts = [per_rank[r, offset:offset + max(0, min(chunk, rows - r * chunk)) * row] for r in range(ranks)]
        wholes.append(torch.cat(parts).view(tensor.shape))
        offset += chunk * row
    return wholes


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
