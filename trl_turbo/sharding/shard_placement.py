"""FSDP2's `shard_placement_fn` that makes each rank's shard of a projection its vLLM tensor-parallel slice.

Design: placements are planned once from parameter names and shapes (`plan_placements`, pure; `plan_model` reads a
model), then looked up by parameter identity in the callable `fully_shard` receives (`ShardPlacementFn`), because
FSDP2 passes only the `nn.Parameter`. Rules:

- a weight whose rank-r FSDP2 shard coincides with vLLM's rank-r slice (`tp_layout`) gets that dim: `Shard(0)` for
  q/k/v/gate/up and the embedding / LM head, `Shard(1)` for o_proj/down_proj;
- every other parameter keeps FSDP2's default `Shard(0)`: always legal (FSDP2 pads an uneven dim 0, while a
  nonzero dim must divide evenly or `fully_shard` raises NotImplementedError) and without the extra chunk/cat copy
  FSDP2 makes around its collectives for a nonzero dim. This covers norms (vLLM holds them whole on every rank;
  tiny), replicated KV heads, padded vocabularies, 4-bit weights and anything of another dtype than the engine's;
  these keep a copy of their own in vLLM, and the plan lists them with the bytes that copy costs per rank;
- LoRA factors (and PEFT's other trainable copies) keep `Shard(0)` too. They are small and trainable: accelerate
  upcasts trainable parameters to fp32 masters, which cannot alias bf16 engine memory, and vLLM takes the adapter
  as whole tensors that it slices itself (`slice_lora_a`/`slice_lora_b` of its LoRA layers), so matching vLLM's
  LoRA layout would buy nothing. Replicating them is not offered by `shard_placement_fn` (it returns a `Shard`
  or None up to torch 2.13).

`shard_placement_fn` arrived in torch 2.6 (pytorch#136221/#137496, Oct 2024); trl_turbo needs torch >= 2.8.
"""

from __future__ import annotations

import inspect
import math
import weakref
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .tp_layout import PACKED_MODULES, PROJECTIONS, ModelFacts, Obstacle, TPLayout, check_tp_size, tp_layout

_ADAPTER_MARKERS = (".lora_", "lora_magnitude_vector")
_PEFT_COPIES = ("modules_to_save.", "original_module.")


@dataclass(frozen=True)
class ParamSpec:
    """What the plan needs of a parameter: its shape, dtype, and whether it is bitsandbytes 4-bit storage."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    quantized_4bit: bool = False


@dataclass(frozen=True)
class ParamPlan:
    """One parameter's placement. `kind`: "shared" (FSDP2's shard is the vLLM slice on every rank), "cast" (the
    shard is the slice in another dtype: vLLM keeps its own, written from the shard rank-locally), "own_copy" (vLLM
    keeps its own, laid out otherwise; `vllm_copy_bytes` per rank, the largest over the ranks) or "adapter"."""

    name: str
    hf_name: str
    vllm_name: str
    kind: str
    shard_dim: int
    obstacle: Obstacle | None
    detail: str
    nbytes: int
    vllm_copy_bytes: int
    layouts: tuple[TPLayout, ...] = ()  # rank r's vLLM slice at index r (empty for adapter tensors)


@dataclass(frozen=True)
class PlacementPlan:
    tp_size: int
    params: tuple[ParamPlan, ...]

    def shard_dims(self) -> dict[str, int]:
        return {p.name: p.shard_dim for p in self.params}

    def of_kind(self, kind: str) -> list[ParamPlan]:
        return [p for p in self.params if p.kind == kind]

    @property
    def own_copy_bytes_per_rank(self) -> int:
        """Bytes of vLLM weights per rank held next to FSDP2's shard (own copies and cast copies)."""
        return sum(p.vllm_copy_bytes for p in self.params)

    @property
    def shared_bytes_per_rank(self) -> int:
        """Bytes of vLLM weights per rank that are FSDP2's shards (no second copy)."""
        return sum(math.ceil(p.nbytes / self.tp_size) for p in self.params if p.kind == "shared")

    def describe(self) -> str:
        """A short report: shared bytes, and each weight that keeps its own copy, grouped by reason."""
        lines = [f"T={self.tp_size}: {len(self.of_kind('shared'))} weights shared "
                 f"({_size(self.shared_bytes_per_rank)} per rank), {len(self.of_kind('cast'))} cast into vLLM's "
                 f"slice, {len(self.of_kind('own_copy'))} with a "
                 f"copy of their own in vLLM ({_size(self.own_copy_bytes_per_rank)} per rank), "
                 f"{len(self.of_kind('adapter'))} adapter tensors"]
        by_reason: dict[str, list[ParamPlan]] = {}
        for plan in self.of_kind("own_copy"):
            by_reason.setdefault(plan.obstacle.value if plan.obstacle else "?", []).append(plan)
        for reason, plans in sorted(by_reason.items()):
            total = sum(p.vllm_copy_bytes for p in plans)
            lines.append(f"  {reason}: {len(plans)} weights, {_size(total)} per rank, e.g. {plans[0].name}: "
                         f"{plans[0].detail}")
        return "\n".join(lines)


def _size(nbytes: int) -> str:
    return f"{nbytes / 2**30:.2f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.2f} MiB"


def is_adapter_param(name: str) -> bool:
    return any(marker in name for marker in _ADAPTER_MARKERS)


def is_peft_copy(name: str) -> bool:
    """A parameter of PEFT's `modules_to_save` (the trained copy, or the original it stands in for)."""
    return any(copy in name for copy in _PEFT_COPIES)


def _vllm_copy_bytes(layouts: Sequence[TPLayout], spec: ParamSpec, itemsize: int) -> int:
    """What vLLM holds for this weight on a rank (the largest over the ranks), in its dtype."""
    numel = math.prod(spec.shape)
    worst = 0
    for layout in layouts:
        slice_ = layout.slice
        if slice_ is None:
            # No layout: vLLM's 4-bit path shards the packed storage; anything else is counted whole.
            elements = numel // layout.tp_size if layout.obstacle == Obstacle.PACKED_4BIT else numel
            worst = max(worst, elements * (spec.dtype.itemsize if spec.quantized_4bit else itemsize))
            continue
        if slice_.dim is None:
            worst = max(worst, numel * itemsize)
            continue
        alone = layout.vllm_name == layout.hf_name  # the vLLM tensor is this weight's (and its vocab padding)
        along = slice_.local_size if alone else slice_.length
        worst = max(worst, along * (numel // spec.shape[slice_.dim]) * itemsize)
    return worst


def plan_placements(params: Mapping[str, ParamSpec], facts: ModelFacts, tp_size: int, *,
                    engine_dtype: torch.dtype | None = None,
                    packed_modules: Mapping[str, Sequence[str]] = PACKED_MODULES) -> PlacementPlan:
    """Plan each parameter's FSDP2 shard dim over a shard group of `tp_size` ranks (= the vLLM TP group).

    `params`: parameter name (as `named_parameters()` gives it, PEFT names included) -> ParamSpec. `engine_dtype`:
    vLLM's weight dtype; a weight of another dtype cannot be its memory (None: not checked). Raises TPSizeError
    when vLLM itself refuses `tp_size` for this model.
    """
    check_tp_size(facts, tp_size)
    plans = []
    for name, spec in params.items():
        nbytes = math.prod(spec.shape) * spec.dtype.itemsize
        if is_adapter_param(name):
            plans.append(ParamPlan(name, name, "", "adapter", 0, None, "LoRA factor: FSDP2's default Shard(0)",
                                   nbytes, 0))
            continue
        layouts = [tp_layout(name, spec.shape, facts, tp_size, rank, packed_modules=packed_modules,
                             quantized_4bit=spec.quantized_4bit) for rank in range(tp_size)]
        first = layouts[0]
        blocked = next((layout for layout in layouts if not layout.coincides), None)
        obstacle, detail = (blocked.obstacle, blocked.detail) if blocked else (None, "")
        if is_peft_copy(name):
            obstacle, detail = Obstacle.UNKNOWN, "PEFT modules_to_save: vLLM gets the trained copy, not this one"
        itemsize = (engine_dtype or spec.dtype).itemsize
        if obstacle is None and engine_dtype is not None and spec.dtype != engine_dtype:
            # the shard is the slice, in another dtype (fp32 masters): cast into vLLM's slice, rank-locally
            plans.append(ParamPlan(name, first.hf_name, first.vllm_name, "cast", first.fsdp_dim, Obstacle.DTYPE,
                                   f"{spec.dtype} here, {engine_dtype} in vLLM", nbytes,
                                   _vllm_copy_bytes(layouts, spec, itemsize), tuple(layouts)))
        elif obstacle is None:
            plans.append(ParamPlan(name, first.hf_name, first.vllm_name, "shared", first.fsdp_dim, None, "",
                                   nbytes, 0, tuple(layouts)))
        else:
            plans.append(ParamPlan(name, first.hf_name, first.vllm_name, "own_copy", 0, obstacle, detail, nbytes,
                                   _vllm_copy_bytes(layouts, spec, itemsize), tuple(layouts)))
    return PlacementPlan(tp_size, tuple(plans))


def _is_4bit(param: torch.Tensor) -> bool:
    return type(param).__name__ == "Params4bit" or getattr(param, "quant_state", None) is not None


def param_specs(model: nn.Module) -> dict[str, ParamSpec]:
    """Name -> ParamSpec for `model.named_parameters()` (a tied weight once, under its first name)."""
    return {name: ParamSpec(tuple(param.shape), param.dtype, _is_4bit(param))
            for name, param in model.named_parameters()}


def model_facts(model: nn.Module) -> ModelFacts:
    """ModelFacts of an HF model or a PEFT model around one."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    config: Any = base.config
    return ModelFacts.from_config(getattr(config, "text_config", None) or config)


def plan_model(model: nn.Module, tp_size: int, *, engine_dtype: torch.dtype | None = None,
               packed_modules: Mapping[str, Sequence[str]] = PACKED_MODULES) -> PlacementPlan:
    """`plan_placements` for a model's parameters and config."""
    return plan_placements(param_specs(model), model_facts(model), tp_size, engine_dtype=engine_dtype,
                           packed_modules=packed_modules)


class ShardPlacementFn:
    """The `shard_placement_fn` for `fully_shard`: the planned `Shard(dim)` of each parameter of `model`.

    FSDP2 calls it with a parameter object only; its name is looked up by identity among the model's parameters
    (weak references, rebuilt when a parameter is not found, e.g. after `model.to("meta")` made new ones). A
    parameter that is not in the plan gets None (FSDP2's default Shard(0)) and is recorded in `unplanned`.
    """

    def __init__(self, model: nn.Module, plan: PlacementPlan) -> None:
        self._model = model
        self.plan = plan
        self._dims = plan.shard_dims()
        self._names: dict[int, tuple[weakref.ref, str]] = {}
        self.unplanned: list[str] = []
        self.calls: dict[str, int] = {}

    def _rebuild(self) -> None:
        self._names = {}
        for name, param in self._model.named_parameters(remove_duplicate=False):
            self._names.setdefault(id(param), (weakref.ref(param), name))

    def _name_of(self, param: nn.Parameter) -> str | None:
        entry = self._names.get(id(param))
        if entry is None or entry[0]() is not param:
            self._rebuild()
            entry = self._names.get(id(param))
        return entry[1] if entry is not None and entry[0]() is param else None

    def __call__(self, param: nn.Parameter) -> Any:
        from torch.distributed.tensor import Shard

        name = self._name_of(param)
        if name is None or name not in self._dims:
            self.unplanned.append(name or f"<unnamed {tuple(param.shape)}>")
            return None
        self.calls[name] = self._dims[name]
        return Shard(self._dims[name])


def shard_placement_fn(model: nn.Module, tp_size: int, *, engine_dtype: torch.dtype | None = None,
                       packed_modules: Mapping[str, Sequence[str]] = PACKED_MODULES) -> ShardPlacementFn:
    """Plan `model` for a shard group of `tp_size` ranks and return the callable for `fully_shard`."""
    return ShardPlacementFn(model, plan_model(model, tp_size, engine_dtype=engine_dtype,
                                              packed_modules=packed_modules))


def unshared_adapted_weights(model: nn.Module, tp_size: int) -> list[str]:
    """The LoRA-adapted base weights of a PEFT `model` whose FSDP2 shard over `tp_size` ranks cannot be vLLM's
    slice (a merge into the shard would not reach the sampler); empty for a model vLLM refuses at `tp_size`."""
    adapted = {name.rpartition(".lora_A.")[0] for name, _ in model.named_parameters() if ".lora_A." in name}
    return sorted(p.hf_name for p in _own_copies(model, tp_size)
                  if any(p.name.startswith(f"{module}.base_layer.") for module in adapted))


def unshared_projection_weights(model: nn.Module, tp_size: int) -> list[str]:
    """The decoder projections (what vLLM's fp8 engine quantizes) whose FSDP2 shard over `tp_size` ranks cannot be
    vLLM's slice: an fp8 copy written per shard would leave their rows unwritten."""
    return sorted(p.hf_name for p in _own_copies(model, tp_size)
                  if p.hf_name.rsplit(".", 2)[-2] in PROJECTIONS)


def _own_copies(model: nn.Module, tp_size: int) -> list[ParamPlan]:
    try:
        plan = plan_model(model, tp_size)
    except ValueError:
        return []
    return plan.of_kind("own_copy")


def fully_shard_takes_placement_fn() -> bool:
    """Whether this torch's `fully_shard` has `shard_placement_fn` (torch >= 2.6)."""
    try:
        from torch.distributed.fsdp import fully_shard
    except ImportError:
        return False
    return "shard_placement_fn" in inspect.signature(getattr(fully_shard, "__wrapped__", fully_shard)).parameters


def applied_shard_dims(model: nn.Module) -> dict[str, int]:
    """After `fully_shard`: each DTensor parameter's FSDP shard dim (the last placement: HSDP's is (Replicate,
    Shard))."""
    dims = {}
    for name, param in model.named_parameters():
        placements: Iterable[Any] = getattr(param, "placements", ())
        shards = [p.dim for p in placements if hasattr(p, "dim")]
        if shards:
            dims[name] = shards[-1]
    return dims
