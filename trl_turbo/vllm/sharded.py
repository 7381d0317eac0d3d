"""Shared weights when FSDP2 shards the training model and vLLM runs tensor-parallel: each rank's frozen shards are
its engine's TP slices.

Design: the engine is built first (TRL builds vLLM in the trainer's constructor, FSDP2 wraps the model only when
training starts), with dummy weights and nothing shared: under FSDP2 the model waits on the host (or, with
`cpu_ram_efficient_loading`, exists only on rank 0), so there is nothing to view yet. The engine leaves a
`ShardedShare` on the policy model; accelerate's FSDP2 preparation (`patches.accelerate_fsdp2`) finds it there and
has `fully_shard` place each projection on vLLM's dimension over a mesh whose shard groups are the TP groups
(`placing`), then fills the engine from the sharded model and adopts its slices (`complete`,
`trl_turbo.sharding.adopt`). With accelerate's memory-efficient loading the shards are written into the engine as
accelerate distributes them (`loading_in_place`), so start-up never holds the shared weights twice. Until then the
engine holds no weights worth sampling from; TRL samples only once training has started. With fp8 sampling the
projections are not shared: vLLM holds them in fp8, written per rank from FSDP2's shards of them (which are its
slices all the same) before each generation (`fp8_on_shards`).
"""

from __future__ import annotations

import functools
import os
import warnings
import weakref
from collections.abc import Callable, Mapping
from typing import Any

import torch

from .. import registry
from ..sharding.adopt import ShardedSharing, ShardEngine, share_shards
from ..sharding.dtensor import with_local
from ..sharding.fsdp_modules import reshard_all
from ..sharding.mesh_shape import device_mesh, hsdp_mesh
from ..sharding.shard_placement import PlacementPlan, ShardPlacementFn, plan_model
from ..sharding.tp_layout import TPLayout
from . import engine as vllm_engine
from .adapter import active_adapter
from .fp8 import Fp8Sampling, Fp8Tensor
from .merge import MergedSampling
from .trained_weights import WeightCopies, release_with_kv
from .weight_views import LayoutMismatch, SharedView, hf_weight_name

PENDING_ATTRIBUTE = "_trl_turbo_sharded_share"  # on the policy model, from engine start until FSDP2 wraps it


class VllmShardEngine:
    """This process's vLLM tensor-parallel rank as `share_shards` uses it: vLLM's own `load_weights` narrows each
    whole tensor to the rank's slice, and `slice_of` reads the region `tp_layout` names."""

    def __init__(self, llm: Any) -> None:
        from vllm.distributed import get_tensor_model_parallel_rank

        self.llm = llm
        self.tp_rank = get_tensor_model_parallel_rank()
        self.params = vllm_engine.vllm_parameters(llm)

    def load(self, tensors: list[tuple[str, torch.Tensor]]) -> None:
        vllm_engine.load_weights(self.llm, tensors)

    def slice_of(self, layout: TPLayout) -> torch.Tensor:
        tensor, slice_ = self.params.get(layout.vllm_name), layout.slice
        if tensor is None or slice_ is None:
            raise LayoutMismatch(f"{layout.hf_name}: vLLM has no parameter {layout.vllm_name}")
        tensor = tensor.detach()
        if slice_.dim is None:
            return tensor
        if tensor.shape[slice_.dim] != slice_.local_size:
            raise LayoutMismatch(f"{layout.hf_name}: vLLM's {layout.vllm_name} on TP rank {self.tp_rank} has "
                                 f"{tensor.shape[slice_.dim]} along dim {slice_.dim}, the layout expects "
                                 f"{slice_.local_size}")
        return tensor.narrow(slice_.dim, slice_.offset, slice_.length)


class ShardedShare:
    """The share an engine waits to make until FSDP2 has sharded the policy model."""

    def __init__(self, engine: Callable[[], ShardEngine], engine_dtype: torch.dtype, tp_size: int,
                 state: Any, *, merged: bool = False, fp8: Mapping[str, Fp8Tensor] | None = None,
                 park_fp8_base: bool = False) -> None:
        self.engine, self.engine_dtype, self.tp_size, self.state = engine, engine_dtype, tp_size, state
        self.merged = merged  # merged sampling: set up on the shards once they are the engine's
        self.fp8 = fp8  # fp8 sampling: vLLM's fp8 tensors, written from the shards once FSDP2 has made them
        self.park_fp8_base = park_fp8_base
        self.placement: ShardPlacementFn | None = None
        self.result: ShardedSharing | None = None

    @classmethod
    def of_engine(cls, llm: Any, tp_size: int, state: Any, *, merged: bool = False,
                  fp8: Mapping[str, Fp8Tensor] | None = None, park_fp8_base: bool = False) -> ShardedShare:
        return cls(lambda: VllmShardEngine(llm), vllm_engine.engine_dtype(llm), tp_size, state, merged=merged,
                   fp8=fp8, park_fp8_base=park_fp8_base)

    def placement_for(self, model: torch.nn.Module) -> ShardPlacementFn:
        """The placement of `model` as `fully_shard` first sees it (after accelerate's fp32 upcast of trainable
        parameters), planned once."""
        if self.placement is None:
            self.placement = ShardPlacementFn(model, plan_model(model, self.tp_size, engine_dtype=self.engine_dtype))
        return self.placement

    def mesh(self, device_type: str) -> Any:
        """The mesh whose shard groups are the TP groups: None (FSDP2's default, the whole world) when the world
        is one TP group, else a (replicate, shard) HSDP mesh."""
        import torch.distributed as dist

        world = dist.get_world_size()
        if world == self.tp_size:
            return None
        per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        return device_mesh(hsdp_mesh(world // per_node, per_node, self.tp_size), device_type)

    def placing(self, fully_shard: Any, model: torch.nn.Module, device_type: str) -> Any:
        """`fully_shard` with this share's placement and mesh (a mesh accelerate passes must already shard over
        exactly the TP group)."""
        mesh = self.mesh(device_type)

        @functools.wraps(fully_shard)
        def fully_shard_on_vllm_dims(module: Any, *args: Any, **kwargs: Any) -> Any:
            given = kwargs.get("mesh")
            if given is not None and given.size(given.ndim - 1) != self.tp_size:
                raise ValueError(f"trl_turbo: accelerate's FSDP2 mesh shards over {given.size(given.ndim - 1)} "
                                 f"ranks, but shared weights need the shard group to be vLLM's tensor-parallel "
                                 f"group of {self.tp_size}; remove the parallelism config or make its dp_shard_size "
                                 f"{self.tp_size}.")
            if given is None and mesh is not None:
                kwargs["mesh"] = mesh
            kwargs.setdefault("shard_placement_fn", self.placement_for(model))
            return fully_shard(module, *args, **kwargs)

        return fully_shard_on_vllm_dims

    def loading_in_place(self, load_full_state_dict: Callable[..., Any]) -> Callable[..., Any]:
        """accelerate's `fsdp2_load_full_state_dict` (with `cpu_ram_efficient_loading`: rank 0's weights broadcast,
        each rank keeping its shard of each) with every shard of a shared weight written straight into the engine
        slice that is to hold it. accelerate keeps each new shard until the whole model is loaded, a second copy
        of the weights beside the engine's; here each is dropped as soon as it is in the engine. Shards go in the
        order of `model.state_dict()`, which accelerate walks; a weight whose shard is not exactly its slice (shape,
        dtype) keeps accelerate's own shard, and `complete` then shares, checks and adopts as it would anyway."""

        @functools.wraps(load_full_state_dict)
        def load_into_engine(accelerator: Any, model: torch.nn.Module, full_sd: Any, *args: Any,
                             **kwargs: Any) -> Any:
            import torch.distributed.tensor as dtensor

            targets = iter(self._engine_slices(model))
            distribute_tensor = dtensor.distribute_tensor

            def distribute_into_engine(tensor: torch.Tensor, *d_args: Any, **d_kwargs: Any) -> Any:
                sharded = distribute_tensor(tensor, *d_args, **d_kwargs)
                shape, placements, view = next(targets, (None, None, None))
                local = sharded.to_local()
                if (view is None or tuple(tensor.shape) != shape or tuple(sharded.placements) != placements
                        or local.shape != view.shape or local.dtype != view.dtype):
                    return sharded
                view.copy_(local)
                return with_local(sharded, view)

            with registry.scoped(dtensor, "distribute_tensor", distribute_into_engine):
                return load_full_state_dict(accelerator, model, full_sd, *args, **kwargs)

        return load_into_engine

    def _engine_slices(self, model: torch.nn.Module) -> list[tuple[tuple[int, ...], tuple[Any, ...],
                                                                   torch.Tensor | None]]:
        """Per entry of `model.state_dict()`, in its order: the whole shape, FSDP2's placements and the engine slice
        its shard goes into (None: not a weight the plan shares, one the engine holds in fp8, or one whose slice the
        engine does not lay out so; `complete` checks every shard against the engine's loader either way)."""
        if self.placement is None:
            return []
        engine = self.engine()
        planned = {entry.hf_name: entry for entry in self.placement.plan.params}
        slices = []
        for name, tensor in model.state_dict().items():
            entry = planned.get(hf_weight_name(name))
            view = None
            if (entry is not None and entry.kind == "shared" and entry.layouts
                    and (self.fp8 is None or entry.vllm_name not in self.fp8)):
                try:
                    view = engine.slice_of(entry.layouts[engine.tp_rank])
                except LayoutMismatch:
                    view = None
            slices.append((tuple(tensor.shape), tuple(getattr(tensor, "placements", ())), view))
        return slices

    def complete(self, model: torch.nn.Module) -> ShardedSharing:
        """Fill the engine from the sharded model and adopt its slices as FSDP2's shards (collective)."""
        if self.placement is None:
            raise RuntimeError("trl_turbo: FSDP2 wrapped the policy model without trl_turbo's shard placement")
        engine = self.engine()
        plan = self.placement.plan
        kept = {p.hf_name for p in plan.params if p.vllm_name in self.fp8} if self.fp8 is not None else set()
        result = share_shards(model, plan, engine, kept=kept)
        self.result = result
        model_ref = weakref.ref(model)

        def reshard_before_sampling() -> None:
            live = model_ref()
            if live is not None:
                reshard_all(live)

        self.state.before_sampling = reshard_before_sampling
        self.state.shared_bytes = result.shared_bytes
        if result.casts or result.reloads:  # trained parameters vLLM keeps a copy of: refreshed at each sync
            self.state.weight_copies = WeightCopies(casts=result.casts, reloads=result.reloads, load=engine.load,
                                                    shared_bytes=result.shared_bytes)
            release_with_kv(self.state.weight_copies, self.state.standby)  # the standby came with the engine
        if self.merged:
            self.state.merged = merged_on_shards(model, result)
        if self.fp8 is not None:
            self.state.fp8 = fp8_on_shards(model, plan, self.fp8, engine.tp_rank, self.engine_dtype,
                                           park_base=self.park_fp8_base)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        _warn_own_copies(result)
        return result


def merged_on_shards(model: torch.nn.Module, result: ShardedSharing) -> MergedSampling:
    """Merged sampling over FSDP2's shards, every adapted one of which must be the engine's slice."""
    sampling = MergedSampling(model, model.active_adapter)
    adapted = {hf_weight_name(f"{target.name}.base_layer.weight") for target in sampling.targets}
    unshared = sorted(adapted - set(result.shared))
    if unshared:
        sampling.close()
        raise LayoutMismatch(f"trl_turbo: merged sampling writes the adapter into FSDP2's shards, but {unshared[:3]} "
                             "are not vLLM's memory; set `turbo_vllm_sampling='lora'`.")
    return sampling


def fp8_on_shards(model: torch.nn.Module, plan: PlacementPlan, fp8: Mapping[str, Fp8Tensor], tp_rank: int,
                  compute_dtype: torch.dtype, *, park_base: bool = False) -> Fp8Sampling:
    """fp8 sampling that writes TP rank `tp_rank`'s fp8 tensors from FSDP2's shards: each projection's shard fills
    its slice's rows (a row-parallel slice is every row of the rank's tensor, over its columns)."""
    views = []
    for entry in plan.params:
        if entry.vllm_name not in fp8:
            continue
        slice_ = entry.layouts[tp_rank].slice if entry.layouts else None
        if entry.kind not in ("shared", "cast") or slice_ is None or slice_.dim not in (0, 1):
            raise LayoutMismatch(f"trl_turbo: fp8 sampling writes vLLM's {entry.vllm_name} from FSDP2's shard of "
                                 f"{entry.hf_name}, which is not its tensor-parallel slice "
                                 f"({entry.detail or entry.kind}); set `turbo_vllm_sampling='merged'` or 'lora'.")
        start = slice_.offset if slice_.dim == 0 else 0
        rows = slice_.length if slice_.dim == 0 else fp8[entry.vllm_name].rows.shape[0]
        views.append(SharedView(entry.hf_name, entry.vllm_name, start, start + rows))
    return Fp8Sampling(model, active_adapter(model), fp8, views, compute_dtype, park_base=park_base)


def _warn_own_copies(result: ShardedSharing) -> None:
    copies = {name: size for name, size in result.own_copies.items() if size >= 2**20}
    if not copies or int(os.environ.get("RANK", 0)) != 0:
        return
    named = ", ".join(f"{name} ({size / 2**20:.0f} MiB)" for name, size in sorted(copies.items(), key=lambda i: -i[1]))
    warnings.warn(f"trl_turbo: {len(copies)} weights keep a copy of their own in vLLM next to FSDP2's shard "
                  f"({sum(copies.values()) / 2**30:.2f} GiB per GPU): {named}. Their tensor-parallel layout is not "
                  "FSDP2's (a padded vocabulary, KV heads fewer than the TP size, a dimension it does not divide).",
                  RuntimeWarning, stacklevel=2)


def await_sharding(model: Any, share: ShardedShare) -> None:
    """Leave `share` on `model` until FSDP2's preparation completes it (through the registry: `trl_turbo.unpatch()`
    takes it off)."""
    registry.replace_attr(model, PENDING_ATTRIBUTE, share, weak=True)


def pending_share(model: Any) -> ShardedShare | None:
    """The share an engine left on `model` (PEFT-wrapped or not) for FSDP2's preparation, if any."""
    return getattr(model, PENDING_ATTRIBUTE, None)
