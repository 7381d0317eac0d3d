"""The code that reaches into a live in-process `vllm.LLM` (vLLM 0.24-0.31, `versions.VLLM_ENGINE`; what it relies
on is listed per API generation, for checking each version's sources, in `trl_turbo.vllm_contract`; what differs between
generations sits in the `VllmApi` adapters below).

The mechanisms, each on vLLM's own objects rather than re-implemented:
- Weights. The model module comes from the worker (`worker.get_model()`, which unwraps CUDA-graph wrappers); HF
  weights go in through the model's own `load_weights` (it stacks q/k/v and gate/up and pads the vocabulary).
- Adapters from memory. The worker's LoRA manager loads an adapter when a request names an id it does not hold.
  Its `_load_adapter` is wrapped on this engine's instance: ids this module handed out are built from tensors
  (`LoRAModel.from_lora_tensors`, the same constructor vLLM's file loader ends in); others go to the file loader.
  Each push gets a new id and name, so vLLM's adapter cache and prefix cache never serve a stale adapter.
- One copy, also while starting: the training model's frozen matrices wait in host memory while vLLM allocates its
  weights (`ParkedWeights`), are copied in, and come back as views of vLLM's tensors.
- A separate copy, where weights cannot be shared: the training model's weights, dequantized to the engine's dtype
  one matrix at a time, go through the same `load_weights` into a 16-bit engine (`copy_base_weights`).
- 4-bit (bitsandbytes) models. vLLM's bitsandbytes loader is the only way its 4-bit layers get their quantization
  states, and it runs while the engine is built (its profiling run needs them). For that call only, the loader's
  `_get_quantized_weights_iterator` yields the training model's packed bytes and states instead of quantizing a
  checkpoint (`feeding_4bit_weights`); vLLM's own code stacks the shards and binds the states.
- KV standby: `vllm/standby.py`, through this module's `VllmApi` adapters.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import warnings
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch

from .. import registry
from ..device_memory import indexed

ADAPTER_PATH = "trl-turbo://in-memory-adapter"  # never read: ids from `TensorAdapters` are built from tensors


class VllmApi:
    """vLLM 0.24's generation of the internals that differ between versions (`vllm_contract.GENERATIONS`)."""

    def lora_weights_mapper(self, model: Any) -> Any:
        """The name mapper `LoRAModel.from_lora_tensors` gets, as vLLM's own adapter loader passes it."""
        return getattr(model, "hf_to_vllm_mapper", None)

    def mark_mapped(self, allocation: Any, mapped: bool) -> None:
        """Record on a CuMem allocation that standby (un)mapped it, where vLLM tracks that."""

    def after_kv_wake_up(self, model_runner: Any) -> None:
        """What vLLM's own wake-up redoes once the KV cache is mapped back (its runner's hook)."""
        model_runner.post_kv_cache_wake_up()


class VllmApi025(VllmApi):
    """vLLM 0.25 on: the adapter loader unstacks the model's mapper itself (passing it raw would merge q, k and v into
    one entry), and each allocation records whether it is asleep (a wake-up may remap only sleeping ones)."""

    mapper_view = "get_unstacked_mapper"  # the view of the model's mapper vLLM's own adapter loader passes

    def lora_weights_mapper(self, model: Any) -> Any:
        mapper = super().lora_weights_mapper(model)
        return getattr(mapper, self.mapper_view)() if mapper is not None else None

    def mark_mapped(self, allocation: Any, mapped: bool) -> None:
        allocation.is_asleep = not mapped


class VllmApi029(VllmApi025):
    """vLLM 0.29 on: the adapter loader passes a mapper that only renames (stacked q/k/v names kept apart), and the
    runner has no KV wake-up hook (it reset an fp8 KV cache's scales, a no-op for a 16-bit one; the contract takes the
    fp8 KV cache in standby away where the hook is missing)."""

    mapper_view = "get_rename_mapper"

    def after_kv_wake_up(self, model_runner: Any) -> None:
        hook = getattr(model_runner, "post_kv_cache_wake_up", None)
        if hook is not None:
            hook()


APIS: dict[str, VllmApi] = {"0.24": VllmApi(), "0.25": VllmApi025(), "0.29": VllmApi029()}


@functools.cache
def vllm_api() -> VllmApi:
    """The adapter of the installed vLLM's API generation, selected once."""
    from .. import versions
    from ..vllm_contract import generation_for

    version = versions.installed_version("vllm")
    generation = generation_for(version) if version is not None else None
    return APIS[generation.name if generation is not None else "0.24"]


def driver_worker(llm: Any) -> Any:
    executor = getattr(llm.llm_engine, "model_executor", None)
    if executor is None:
        raise RuntimeError("trl_turbo: vLLM runs its engine in another process; shared weights and standby need it "
                           "in this one (TRL's colocate mode does this through `external_launcher`).")
    worker = executor.driver_worker
    return getattr(worker, "worker", worker)


def driver_model(llm: Any) -> torch.nn.Module:
    return driver_worker(llm).get_model()


def load_weights(llm: Any, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Copy HF-named tensors into vLLM's weights (in place), also into layers vLLM has wrapped for LoRA.

    vLLM loads checkpoints before it wraps layers for LoRA; afterwards a wrapped layer's weight is registered as
    `<module>.base_layer.weight` and its loader no longer finds `<module>.weight`. Names of wrapped modules (and of
    the shards packed into them) therefore get `.base_layer` inserted; the loader's own q/k/v and gate/up renaming
    then lands on the wrapped parameter.
    """
    model = driver_model(llm)
    wrapped = {name.partition(".base_layer.")[0].rpartition(".")[2]
               for name, _ in model.named_parameters(remove_duplicate=False) if ".base_layer." in name}
    for packed, shards in getattr(model, "packed_modules_mapping", {}).items():
        if packed in wrapped:
            wrapped.update(shards)

    def renamed() -> Iterable[tuple[str, torch.Tensor]]:
        for name, tensor in named_tensors:
            module, _, leaf = name.rpartition(".")
            if module.rpartition(".")[2] in wrapped:
                name = f"{module}.base_layer.{leaf}"
            yield name, tensor

    model.load_weights(renamed())


class TensorAdapters:
    """Serves LoRA adapters to one engine from tensors; `push` returns the `LoRARequest` that selects the adapter."""

    _ids = itertools.count(1)

    def __init__(self, llm: Any) -> None:
        from vllm.lora.peft_helper import PEFTHelper

        self._manager = driver_worker(llm).model_runner.lora_manager
        self._peft_helper = PEFTHelper
        self._pending: dict[int, tuple[dict[str, torch.Tensor], dict[str, Any]]] = {}
        file_loader = self._manager._load_adapter

        def load_adapter(lora_request: Any) -> Any:
            entry = self._pending.get(lora_request.lora_int_id)
            return file_loader(lora_request) if entry is None else self._build(lora_request.lora_int_id, *entry)

        registry.set_attr(self._manager, "_load_adapter", load_adapter, weak=True)

    def push(self, tensors: dict[str, torch.Tensor], config: dict[str, Any]) -> Any:
        from vllm.lora.request import LoRARequest

        adapter_id = next(self._ids)
        self._pending = {adapter_id: (tensors, config)}  # only the newest adapter can be (re)loaded
        return LoRARequest(lora_name=f"trl-turbo-policy-{adapter_id}", lora_int_id=adapter_id, lora_path=ADAPTER_PATH)

    def _build(self, adapter_id: int, tensors: dict[str, torch.Tensor], config: dict[str, Any]) -> Any:
        manager = self._manager
        helper = self._peft_helper.from_dict({**config,
                                              "vllm_max_position_embeddings": manager.max_position_embeddings})
        helper.validate_legal(manager.lora_config)
        model = manager._adapter_manager.model
        lora = manager._lora_model_cls.from_lora_tensors(
            lora_model_id=adapter_id, tensors=tensors, peft_helper=helper, device="cpu",
            dtype=manager.lora_config.lora_dtype, model_vocab_size=manager.vocab_size,
            weights_mapper=vllm_api().lora_weights_mapper(model),
            skip_prefixes=getattr(model, "lora_skip_prefixes", None),
        )
        expected = _expected_lora_modules(manager._adapter_manager)
        unmatched = sorted({name for name in lora.loras if name.rpartition(".")[2] not in expected})
        n_sent = sum(name.endswith("lora_A.weight") for name in tensors)
        if unmatched or len(lora.loras) != n_sent:
            raise RuntimeError(f"trl_turbo: vLLM would not apply {n_sent - len(lora.loras) or len(unmatched)} of the "
                               f"adapter's {n_sent} LoRA modules (unmatched: {unmatched[:5]}); refusing to sample "
                               "from a partial adapter.")
        return lora


def _expected_lora_modules(adapter_manager: Any) -> set[str]:
    packed = adapter_manager.packed_modules_mapping
    expected = set()
    for module in adapter_manager.supported_lora_modules:
        expected.update(packed.get(module, [module]))
    return expected


# ------------------------------------------------------------------------------------------------ fp8 weights
def fp8_tensors(llm: Any) -> dict[str, Any]:
    """vLLM's fp8 linear weights (online per-tensor fp8, `quantization="fp8"`) by parameter name, each as an
    `Fp8Tensor` of its [out, in] rows and its one-element scale. Raises LayoutMismatch for any other fp8 layout."""
    from .fp8 import FP8_DTYPE, Fp8Tensor
    from .weight_views import LayoutMismatch, vllm_weight_name

    tensors = {}
    for name, module in driver_model(llm).named_modules():
        weight = module.__dict__.get("_parameters", {}).get("weight")
        if weight is None or weight.dtype != FP8_DTYPE:
            continue
        out_features = getattr(module, "output_size_per_partition", None)
        in_features = getattr(module, "input_size_per_partition", None)
        weight = weight.detach()
        rows = weight.t() if weight.t().is_contiguous() and not weight.is_contiguous() else weight
        scale = getattr(module, "weight_scale", None)
        method = type(getattr(module, "quant_method", None)).__name__
        if (method != "Fp8PerTensorOnlineLinearMethod" or tuple(rows.shape) != (out_features, in_features)
                or not rows.is_contiguous() or scale is None or scale.numel() != 1 or scale.dtype != torch.float32):
            raise LayoutMismatch(
                f"vLLM's fp8 layer {name} ({method}, weight {tuple(weight.shape)} strides {weight.stride()}, scale "
                f"{None if scale is None else tuple(scale.shape)}) is not the per-tensor online fp8 layout "
                "`turbo_vllm_sampling='fp8'` writes; use `turbo_vllm_sampling='merged'`.")
        tensors[vllm_weight_name(f"{name}.weight")] = Fp8Tensor(rows, scale.detach())
    if not tensors:
        raise LayoutMismatch("vLLM built no fp8 linear layers although `quantization='fp8'` was asked for")
    return tensors


# ------------------------------------------------------------------------------------------- shared weights
def frozen_matrix_weights(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    """The frozen Linear/Embedding weights of an HF model (PEFT-wrapped or not), by plain HF name, each once."""
    from .weight_views import hf_weight_name

    weights: dict[str, torch.nn.Parameter] = {}
    seen: set[int] = set()
    for name, module in model.named_modules():
        if "lora_" in name or not isinstance(module, (torch.nn.Linear, torch.nn.Embedding)):
            continue
        weight = module.weight
        if weight.requires_grad or id(weight) in seen:
            continue
        seen.add(id(weight))
        weights[hf_weight_name(f"{name}.weight")] = weight
    return weights


def hf_state_for_vllm(model: torch.nn.Module) -> Iterable[tuple[str, torch.Tensor]]:
    """The base model's tensors under HF checkpoint names, as TRL's weight sync names them (adapter tensors left
    out)."""
    from .weight_views import hf_weight_name

    for name, tensor in model.state_dict().items():
        if "lora_" in name or "original_module" in name or "modules_to_save" in name:
            continue
        yield hf_weight_name(name), tensor.detach()


def engine_dtype(llm: Any) -> torch.dtype:
    """The dtype the engine's model computes and holds its 16-bit weights in."""
    return driver_worker(llm).model_runner.model_config.dtype


def copy_base_weights(llm: Any, peft_model: Any) -> int:
    """Load the training model's base weights into vLLM's own (bitsandbytes layers dequantized to the engine's dtype);
    the training model keeps its weights. Returns the bytes of vLLM's copy."""
    from .dequantized import copy_bytes, dequantized_state

    base = peft_base(peft_model)
    load_weights(llm, dequantized_state(base, hf_state_for_vllm(base), engine_dtype(llm)))
    return copy_bytes(base)


def peft_base(model: Any) -> torch.nn.Module:
    """The model under a PEFT wrapper (the model itself when it has none)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def vllm_parameters(llm: Any) -> dict[str, torch.nn.Parameter]:
    """vLLM's parameters by name, without the `.base_layer` its LoRA wrappers insert."""
    from .weight_views import vllm_weight_name

    return {vllm_weight_name(n): p for n, p in driver_model(llm).named_parameters(remove_duplicate=False)}


def plan_views(llm: Any, base: torch.nn.Module, fp8: Mapping[str, Any] | None = None,
               weights: Mapping[str, torch.Tensor] | None = None) -> tuple[Any, Any, Any]:
    """(the HF weights by name, vLLM's parameters by name, the views from one to the other). `weights`: by default
    the frozen matrices of `base`. vLLM's fp8 weights (`fp8`, name -> `Fp8Tensor`) are planned by their [out, in]
    rows, and 4-bit HF weights then by the matrix they stand for."""
    from .dequantized import dequantized_shape
    from .weight_views import plan_shared_views

    vllm_model = driver_model(llm)
    frozen = frozen_matrix_weights(base) if weights is None else weights
    vllm_params = vllm_parameters(llm)
    shapes = {name: tuple(p.shape) for name, p in vllm_params.items()}
    for name, tensor in (fp8 or {}).items():
        shapes[name] = tuple(tensor.rows.shape)
    shape_of = dequantized_shape if fp8 else (lambda weight: weight.shape)  # shared 4-bit: packed on both sides
    views = plan_shared_views({name: tuple(shape_of(w)) for name, w in frozen.items()}, shapes,
                              getattr(vllm_model, "packed_modules_mapping", {}))
    return frozen, vllm_params, views


# Device memory torch may keep cached but unusable after parking before the model's remaining tensors are compacted
STRANDED_BYTES_LIMIT = 2**30


class ParkedWeights:
    """The frozen matrices of the training model, moved to host memory while vLLM allocates its own weights, so the
    device never holds two copies. `share_base_weights` points them at vLLM's tensors; `unpark` brings back any that
    were not (an error on the way), so the model is never left half on the host.

    The freed memory must reach the driver: vLLM allocates from its own memory pool, which cannot reuse blocks torch's
    default pool keeps cached. transformers loads a model into one large warmed-up allocator segment, so the tensors
    that stay (norms, LoRA weights, 4-bit block scales) pin the segment and `empty_cache` cannot release it (35 GiB
    of a 70B NF4 model's 37 stayed cached, and vLLM ran out of memory). Where more than `STRANDED_BYTES_LIMIT` stays
    cached, the remaining tensors go to the host and back, so they land in fresh small segments and the rest is
    released."""

    def __init__(self, model: Any) -> None:
        self.weights = frozen_matrix_weights(peft_base(model))
        self.home = {name: weight.device for name, weight in self.weights.items()}
        for weight in self.weights.values():
            weight.data = weight.data.to("cpu")
        if torch.cuda.is_available():
            torch.cuda.empty_cache()  # vLLM sizes itself from the driver's free memory
            devices = {device for device in self.home.values() if device.type == "cuda"}
            if stranded_bytes(devices) > STRANDED_BYTES_LIMIT:
                try:
                    compact_device_tensors(model)
                except BaseException:
                    self.unpark()
                    raise
                stranded = stranded_bytes(devices)
                if stranded > STRANDED_BYTES_LIMIT:
                    warnings.warn(
                        f"trl_turbo: {stranded / 2**30:.1f} GiB of device memory stays cached in "
                        "torch's pool after the frozen weights were parked, pinned by tensors outside the model "
                        "(gradients, optimizer states); vLLM cannot use it", RuntimeWarning, stacklevel=2)

    def unpark(self) -> None:
        for name, weight in self.weights.items():
            # Still on the host although its home is a device: not shared (views of vLLM's live on the device)
            if weight.device.type == "cpu" and self.home[name].type != "cpu":
                weight.data = weight.data.to(self.home[name])


def stranded_bytes(devices: Iterable[torch.device]) -> int:
    """What torch's default pool keeps cached on `devices` without holding a tensor there."""
    return sum(torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device) for device in devices)


def compact_device_tensors(model: torch.nn.Module) -> None:
    """Move every CUDA tensor of `model` (parameters, buffers, bitsandbytes quantization states) to the host, release
    torch's cache, and move them back: the same tensors (`.data` swapped) in newly allocated segments."""
    tensors: dict[int, torch.Tensor] = {}
    for tensor in [*model.parameters(), *model.buffers()]:
        if tensor.is_cuda:
            tensors.setdefault(id(tensor), tensor)
    states = {id(s): s for p in model.parameters() if (s := getattr(p, "quant_state", None)) is not None
              and getattr(s, "absmax", None) is not None and s.absmax.is_cuda}
    homes = {key: tensor.device for key, tensor in tensors.items()}
    state_homes = {key: state.absmax.device for key, state in states.items()}
    try:
        for tensor in tensors.values():
            tensor.data = tensor.data.to("cpu")
        for state in states.values():
            state.to("cpu")
        torch.cuda.empty_cache()
    finally:  # back home whatever happened, every one tried, so the model is never left half on the host
        failure: BaseException | None = None  # the first, re-raised once the others moved
        for key, tensor in tensors.items():
            try:
                tensor.data = tensor.data.to(homes[key])
            except BaseException as exc:  # noqa: BLE001
                failure = failure or exc
        for key, state in states.items():
            try:
                state.to(state_homes[key])
            except BaseException as exc:  # noqa: BLE001
                failure = failure or exc
        if failure is not None:
            raise failure


def share_base_weights(llm: Any, peft_model: Any, parked: ParkedWeights | None = None,
                       training_device: torch.device | None = None,
                       fp8: Mapping[str, Any] | None = None) -> int:
    """Load the HF weights into vLLM, then make the HF model's frozen matrices views of vLLM's tensors (checked
    equal first). With `parked` weights (on the host for now) the views must sit on their home device. A model still
    on the host (DeepSpeed and FSDP move it to `training_device` only when training starts) gets views on
    `training_device`; the move then leaves them in place. With `fp8` (vLLM's fp8 weights, `fp8_tensors`) the HF
    matrices that fill them are neither loaded nor shared: the training model keeps them, and `Fp8Sampling` writes
    vLLM's fp8 copy from them. Returns the bytes now held once instead of twice."""
    from .quantized import four_bit_weights
    from .weight_views import LayoutMismatch, view_of

    base = peft_base(peft_model)
    frozen, vllm_params, views = plan_views(llm, base, fp8)
    kept = {view.hf_name for view in views if fp8 and view.vllm_name in fp8}
    views = [view for view in views if view.hf_name not in kept]
    packed = {} if fp8 else four_bit_weights(base)
    if not packed:  # 4-bit weights went in while the engine was built (`feeding_4bit_weights`)
        # (a kept 4-bit weight's quantization statistics, `<module>.weight.absmax` etc., stay out with it)
        load_weights(llm, ((name, t) for name, t in hf_state_for_vllm(base)
                           if name.partition(".weight")[0] + ".weight" not in kept))
    home = parked.home if parked is not None else {name: weight.device for name, weight in frozen.items()}
    targets = []
    for view in views:
        weight, target = frozen[view.hf_name], view_of(vllm_params[view.vllm_name], view)
        expected = home[view.hf_name]
        if expected.type == "cpu" and training_device is not None:
            expected = indexed(training_device)
        if target.dtype != weight.dtype or target.device != expected:
            raise LayoutMismatch(
                f"{view.hf_name} is {weight.dtype} on {expected} in the training model but vLLM holds it as "
                f"{target.dtype} on {target.device}; load the model in the training precision (e.g. "
                "`model_init_kwargs={'dtype': 'bfloat16'}` with bf16=True) to share weights.")
        if not torch.equal(target, weight.detach().to(target.device)):
            raise LayoutMismatch(f"{view.hf_name}: vLLM's rows [{view.start}, {view.stop}) of {view.vllm_name} differ "
                                 "from the HF weight after loading; refusing to share a layout that does not match.")
        if view.hf_name in packed:
            _check_4bit_state(view, weight, vllm_params[view.vllm_name])
        targets.append((weight, target))
    shared = 0
    for weight, target in targets:
        weight.data = target
        shared += target.numel() * target.element_size()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return shared


def trained_parameters(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    """A model trained whole: its parameters by plain HF name."""
    from .weight_views import hf_weight_name

    return {hf_weight_name(name): param for name, param in model.named_parameters()}


def share_trained_parameters(llm: Any, model: torch.nn.Module, training_device: torch.device | None = None,
                             fp8: Mapping[str, Any] | None = None) -> Any:
    """Full fine-tuning: load every parameter into vLLM, then make each one a view of its vLLM region where the
    dtypes match (else it is cast there at each sync). With `fp8` (vLLM's fp8 weights, `fp8_tensors`) the matrices
    that fill them are neither loaded nor shared: `Fp8Sampling` writes them from the trained weights. Returns the
    `WeightCopies` a sync runs."""
    from .trained_weights import share_trained_weights
    from .weight_views import view_of

    params = trained_parameters(model)
    _, vllm_params, views = plan_views(llm, model, fp8, weights=params)
    kept = {view.hf_name for view in views if fp8 and view.vllm_name in fp8}
    load_weights(llm, ((name, tensor) for name, tensor in hf_state_for_vllm(model) if name not in kept))
    regions = {view.hf_name: view_of(vllm_params[view.vllm_name], view) for view in views if view.hf_name not in kept}
    copies = share_trained_weights([(name, param) for name, param in params.items() if name not in kept], regions,
                                   device=training_device)
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return copies


# -------------------------------------------------------------------------------------------- 4-bit weights
@contextlib.contextmanager
def feeding_4bit_weights(peft_model: Any) -> Iterator[None]:
    """While vLLM builds an engine in this block, its bitsandbytes loader takes the training model's 4-bit bytes and
    quantization states (and its 16-bit tensors) instead of reading and quantizing the checkpoint."""
    from vllm.model_executor.model_loader.bitsandbytes_loader import BitsAndBytesModelLoader

    from .quantized import weights_for_vllm

    base = peft_base(peft_model)

    def training_weights(loader: Any, model_name_or_path: str, revision: Any) -> tuple[Any, dict[str, Any]]:
        tensors, states = weights_for_vllm(base, hf_state_for_vllm(base))
        # vLLM's own iterators key states by the mapped name, and the tensors by the checkpoint name
        return tensors, {loader.weight_mapper(name): state for name, state in states.items()}

    with registry.scoped(BitsAndBytesModelLoader, "_get_quantized_weights_iterator", training_weights):
        yield


def _check_4bit_state(view: Any, weight: torch.Tensor, vllm_param: torch.Tensor) -> None:
    """vLLM's state for the shard `view` names dequantizes to the values of the HF weight's own state."""
    from .quantized import same_quantization
    from .weight_views import LayoutMismatch

    states, offsets = getattr(vllm_param, "bnb_quant_state", None), getattr(vllm_param, "bnb_shard_offsets", None)
    if states is None or offsets is None:
        raise LayoutMismatch(f"{view.vllm_name} has no bitsandbytes quantization state; vLLM did not load it as 4-bit")
    starts = [int(offset) for offset in offsets[:-1]]
    if view.start not in starts or not same_quantization(weight.quant_state, states[starts.index(view.start)]):
        raise LayoutMismatch(f"{view.hf_name}: vLLM's quantization state for rows [{view.start}, {view.stop}) of "
                             f"{view.vllm_name} differs from the HF layer's; refusing to share.")
