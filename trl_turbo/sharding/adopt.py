"""Make FSDP2's shards of the frozen weights live in an inference engine's tensor-parallel tensors: one copy per GPU.

Design: the engine's own loader decides what each rank holds, never a re-implementation of it. After `fully_shard`
(with `shard_placement.ShardPlacementFn`) every base parameter is gathered whole once, one at a time, and handed to
the engine's loader (`ShardEngine.load`), which narrows it to its rank's slice as it would a checkpoint's tensor;
the engine then holds every weight, those that keep a copy of their own included, except those its sampler writes
itself from the shards (`kept`: an fp8 copy), which are neither loaded nor shared. For each weight the plan shares,
the engine's slice (`ShardEngine.slice_of`) must then equal this rank's FSDP2 shard bit for bit (a shard loaded
into the engine's memory already is copied aside before the loader writes over it, and compared with that copy);
only when that holds on every rank of the world (one all-reduce, so no rank adopts while another refuses) does FSDP2
take the engine's slice as the shard's storage: a DTensor over that view replaces the parameter and FSDP2's own
`FSDPParam.reset_sharded_param()` re-reads it (what it does after `load_state_dict(assign=True)`), keeping the view
when it already has the padded shard size. The freed shard goes back to the allocator. This reads FSDP2 internals
(`_get_fsdp_state`, `FSDPParam`), checked with the torch versions trl_turbo supports, and refuses when they are
missing. The startup gather costs what one stock weight sync costs, once.
"""

from __future__ import annotations

from collections.abc import Collection, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import nn

from ..vllm.weight_views import LayoutMismatch, hf_weight_name
from .dtensor import with_local
from .shard_placement import PlacementPlan, is_adapter_param, is_peft_copy
from .tp_layout import TPLayout


class ShardEngine(Protocol):
    """An inference engine's tensor-parallel rank, as `share_shards` uses it."""

    tp_rank: int

    def load(self, tensors: list[tuple[str, torch.Tensor]]) -> None:
        """Take whole HF tensors, (name, tensor) pairs, into the engine (narrowed to this rank by its own loader)."""

    def slice_of(self, layout: TPLayout) -> torch.Tensor:
        """The engine's tensor region that holds this rank's slice of `layout.hf_name` (a view)."""


@dataclass
class ShardedSharing:
    """What `share_shards` did on this rank."""

    shared_bytes: int = 0  # engine memory that is now also FSDP2's shard (held once)
    shared: list[str] = field(default_factory=list)
    own_copies: dict[str, int] = field(default_factory=dict)  # name -> bytes of the engine's own copy on this rank
    kept: list[str] = field(default_factory=list)  # weights the engine holds in a form its sampler writes (fp8)
    # trained parameters the engine keeps its own copy of: cast into its slice (parameter, slice), or gathered and
    # loaded (HF name, parameter), at each sync
    casts: list[tuple[nn.Parameter, torch.Tensor]] = field(default_factory=list)
    reloads: list[tuple[str, nn.Parameter]] = field(default_factory=list)


def base_parameters(model: nn.Module) -> Iterator[tuple[str, nn.Parameter]]:
    """The model's parameters the engine holds, under their plain HF names: LoRA factors and PEFT's saved-module
    copies left out, tied weights once (TRL's `_iter_fsdp2_params` walks the same)."""
    for name, param in model.named_parameters():
        if is_adapter_param(name) or is_peft_copy(name):
            continue
        yield hf_weight_name(name), param


def fsdp_params(model: nn.Module) -> dict[int, Any]:
    """`id(sharded parameter)` -> its `FSDPParam`, over every module `fully_shard` was applied to."""
    found: dict[int, Any] = {}
    for module in model.modules():
        get_state = getattr(module, "_get_fsdp_state", None)
        if get_state is None:
            continue
        group = getattr(get_state(), "_fsdp_param_group", None)
        for fsdp_param in getattr(group, "fsdp_params", None) or ():
            found[id(fsdp_param.sharded_param)] = fsdp_param
    return found


def adopt_storage(fsdp_param: Any, view: torch.Tensor) -> bool:
    """Make `view` (this rank's shard, of the padded shard size) the storage of `fsdp_param`'s sharded parameter;
    True when FSDP2 kept it (False: FSDP2 copied it into storage of its own)."""
    info = fsdp_param._module_info
    old = getattr(info.module, info.param_name)
    local = with_local(old, view.detach())
    setattr(info.module, info.param_name, nn.Parameter(local, requires_grad=old.requires_grad))
    fsdp_param.reset_sharded_param()
    return fsdp_param._sharded_param_data.untyped_storage().data_ptr() == view.untyped_storage().data_ptr()


def _all_ranks_agree(failures: int, device: torch.device) -> int:
    """The number of failures summed over the world (every rank then takes the same branch)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return failures
    total = torch.tensor([failures], device=device)
    dist.all_reduce(total)
    return int(total.item())


def kept_shard_problem(hf_name: str, param: Any, entry: Any, tp_rank: int) -> str | None:
    """Why FSDP2's shard `param` (a DTensor) of a weight the engine keeps in another form is not vLLM rank `tp_rank`'s
    slice of it, which its sampler writes from that shard: another shape, or another shard index than the rank's
    (None: it is; also where the plan places no slice, which the sampler's own setup refuses)."""
    layout = entry.layouts[tp_rank] if entry is not None and entry.layouts else None
    slice_ = layout.slice if layout is not None else None
    if slice_ is None or slice_.dim is None:
        return None
    if layout.obstacle is not None:
        return f"{hf_name}: FSDP2's shard is not vLLM's slice on tensor-parallel rank {tp_rank} ({layout.obstacle})"
    expected = list(param.shape)
    expected[slice_.dim] = slice_.length
    local = tuple(param.to_local().shape)
    if local != tuple(expected):
        return f"{hf_name}: FSDP2's shard {local}, vLLM's slice {tuple(expected)} on tensor-parallel rank {tp_rank}"
    shard_dims = [dim for dim, placement in enumerate(param.placements) if placement.is_shard()]
    sharded_dim = getattr(param.placements[shard_dims[-1]], "dim", slice_.dim) if shard_dims else slice_.dim
    if sharded_dim != slice_.dim:
        return f"{hf_name}: FSDP2 shards dim {sharded_dim}, vLLM's slice is along dim {slice_.dim}"
    index = param.device_mesh.get_local_rank(shard_dims[-1]) if shard_dims else 0
    if index != tp_rank:
        return f"{hf_name}: FSDP2 holds shard {index} where vLLM's tensor-parallel rank is {tp_rank}"
    return None


def _engine_memory_of(local: torch.Tensor, entry: Any, engine: ShardEngine) -> bool:
    """Whether the shard `local` of a weight the plan shares already lives at its engine slice."""
    if entry is None or entry.kind != "shared" or not entry.layouts:
        return False
    try:
        view = engine.slice_of(entry.layouts[engine.tp_rank])
    except LayoutMismatch:
        return False
    return view.data_ptr() == local.data_ptr() and view.shape == local.shape


def share_shards(model: nn.Module, plan: PlacementPlan, engine: ShardEngine,
                 kept: Collection[str] = ()) -> ShardedSharing:
    """Load every base weight of the FSDP2-sharded `model` into `engine`, then make FSDP2's shards of the weights
    `plan` shares views of the engine's slices (checked equal on every rank first). `kept`: HF names the engine holds
    in another form that its sampler writes from FSDP2's shards (fp8 copies): neither loaded nor shared, only checked
    to be the engine rank's slices (`kept_shard_problem`). Collective:
    every rank of the world calls it with its own engine rank. Raises LayoutMismatch on every rank when any rank's
    slices differ."""
    from torch.distributed.tensor import DTensor

    planned = {p.hf_name: p for p in plan.params}
    by_param = fsdp_params(model)
    result = ShardedSharing()
    adoptions: list[tuple[str, Any, torch.Tensor]] = []
    mismatches: list[str] = []
    device = torch.device("cpu")
    for hf_name, param in base_parameters(model):
        if not isinstance(param, DTensor):
            raise LayoutMismatch(f"{hf_name} is not sharded by FSDP2 (a {type(param).__name__}); the engine's "
                                 "shards can only be shared with a model `fully_shard` has wrapped")
        local = param.to_local()
        device = local.device
        if hf_name in kept:
            problem = kept_shard_problem(hf_name, param, planned.get(hf_name), engine.tp_rank)
            if problem is None:
                result.kept.append(hf_name)
            else:
                mismatches.append(problem)
            continue
        entry = planned.get(hf_name)
        # a shard loaded straight into the engine (`ShardedShare.loading_in_place`) is the engine's memory already:
        # the engine's loader then writes its own idea of the slice over it, checked against the shard's values kept
        # aside, and put back where they differ
        in_place = _engine_memory_of(local, entry, engine)
        kept_aside = local.clone() if in_place else None
        engine.load([(hf_name, param.full_tensor())])  # collective: every rank gathers the same parameter in turn
        if entry is None or entry.kind not in ("shared", "cast"):
            result.own_copies[hf_name] = entry.vllm_copy_bytes if entry is not None else 0
            if param.requires_grad:
                result.reloads.append((hf_name, param))
            continue
        view = engine.slice_of(entry.layouts[engine.tp_rank])
        fsdp_param = by_param.get(id(param))
        cast = entry.kind == "cast"
        if kept_aside is not None and not torch.equal(view, kept_aside):
            mismatches.append(f"{hf_name}: the engine's slice differs from FSDP2's shard on tensor-parallel rank "
                              f"{engine.tp_rank}")
            view.copy_(kept_aside)
        elif fsdp_param is None or view.shape != local.shape or (view.dtype != local.dtype and not cast):
            mismatches.append(f"{hf_name}: FSDP2's shard {tuple(local.shape)} {local.dtype}, engine slice "
                              f"{tuple(view.shape)} {view.dtype}" + ("" if fsdp_param else " (no FSDPParam)"))
        elif not torch.equal(view, local.to(view.dtype)):
            mismatches.append(f"{hf_name}: the engine's slice differs from FSDP2's shard on tensor-parallel rank "
                              f"{engine.tp_rank}")
        elif cast:
            result.own_copies[hf_name] = view.numel() * view.element_size()
            if param.requires_grad:
                result.casts.append((param, view))
        else:
            adoptions.append((hf_name, fsdp_param, view))
    if _all_ranks_agree(len(mismatches), device):
        raise LayoutMismatch("trl_turbo: the engine's tensor-parallel slices do not line up with FSDP2's shards, "
                             f"so nothing is shared: {'; '.join(mismatches[:4]) or 'on another rank'}")
    for hf_name, fsdp_param, view in adoptions:
        if adopt_storage(fsdp_param, view):
            result.shared.append(hf_name)
            result.shared_bytes += view.numel() * view.element_size()
        else:
            result.own_copies[hf_name] = view.numel() * view.element_size()
    return result
