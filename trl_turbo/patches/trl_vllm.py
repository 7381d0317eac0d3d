"""TRL's colocated vLLM engine (`trl.generation.vllm_generation.VLLMGeneration`): precision, shared weights,
adapters as tensors, KV standby.

Seams, all methods of `VLLMGeneration`:
- `_init_vllm`: for the duration of the call, the module attribute `LLM` it constructs from gets extra arguments:
  the training dtype (`turbo_vllm_match_precision`: TRL would leave a bf16 sampler under fp16 training, the
  mismatch arXiv 2510.26788 removes), one LoRA slot and dummy weights (shared weights), CuMem pools and a KV budget
  (standby), the KV dtype. With shared weights the HF model's frozen matrices wait on the host during the call;
  after it they are copied into vLLM once and become views of vLLM's, and the KV cache is released. A 4-bit
  (bitsandbytes) model goes in while the engine is built instead: vLLM is told the HF quantization config and its
  bitsandbytes loader is fed the training model's packed bytes and quantization states. A model that cannot share
  (`trl_turbo.vllm.sharing`) gets a 16-bit engine instead, into which the training model's weights are copied
  (dequantized) once; the training model keeps its own. Where trl_turbo chooses vLLM's quantization (shared 4-bit,
  separate copy), TRL's bitsandbytes probe is switched off for the call: it would choose too, and refuses 8-bit
  models.
- `sync_weights`: with shared weights the base never changes, so TRL's merge → push every weight → unmerge (which
  also drifts bf16 base weights) is replaced by handing vLLM the adapter's tensors ("lora" sampling) or by nothing
  ("merged" sampling merges at generation).
- `generate`: the KV cache is mapped back before and released after TRL's generation. "merged" sampling
  (`trl_turbo.vllm.merge`) merges the live adapter into the shared weights before and restores them bit-exactly
  after, however the generation ends; "lora" sampling makes TRL's `llm.generate` call carry the adapter's
  `LoRARequest`.
Timings and memory go to the trainer's metrics under `vllm/`.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import time
import warnings
from typing import Any

import torch

from ..config import TurboFields
from ..vllm.adapter import adapter_config_dict, adapter_problems, adapter_tensors, lora_engine_kwargs
from ..vllm.dequantized import copy_bytes
from ..vllm.merge import (
    LORA,
    MERGED,
    MergedSampling,
    adapted_weight_bytes,
    available_host_bytes,
    choose_sampling,
    host_copy_problem,
    merge_problems,
)
from ..vllm.kv_budget import (
    auto_kv_cache_bytes,
    expected_seq_len,
    kv_bytes_per_token,
    sampling_workspace_bytes,
    useful_kv_cache_bytes,
)
from ..vllm.quantized import (
    compute_dtype_warning,
    four_bit_weights,
    quantization_config_dict,
    statistics_bytes,
    vllm_quantization_config,
)
from ..vllm.sharing import COPY, SHARED, Sharing, copy_reasons, fallback_warning, sharing_mode
from .. import versions
from . import construction, registry

_DTYPES = {"fp16": "float16", "bf16": "bfloat16"}
_GIB = 2**30


def _setting(config: Any, name: str) -> Any:
    return getattr(config, name, getattr(TurboFields, name))


def vllm_dtype(generation: Any) -> str | None:
    """The dtype vLLM should use for a `VLLMGeneration` built by a GRPOTrainer, or None to leave TRL's choice (also
    for a vLLM outside the range precision matching is tested with: a warning, and TRL's own choice)."""
    config = construction.constructing_config()
    if not _setting(config, "turbo_vllm_match_precision") or generation.mode != "colocate":
        return None
    reason = versions.unsupported_reason({"vllm": versions.SUPPORTED_OPTIONAL["vllm"]})
    if reason is not None:
        warnings.warn(f"trl_turbo: `turbo_vllm_match_precision` is off for this engine: {reason}. vLLM samples in "
                      "the dtype TRL chooses.", RuntimeWarning, stacklevel=2)
        return None
    return _DTYPES.get(str(generation.accelerator.mixed_precision))


# ------------------------------------------------------------------------------------------ trainer inputs
def check_trainer_inputs(config: Any, model: Any, peft_config: Any, quantization_config: Any = None) -> None:
    """Before the model loads: refuse a vLLM run without vLLM installed, and a shared-weights run no engine can serve
    (no LoRA adapter, an adapter vLLM cannot take, quantization other than bitsandbytes), and warn when vLLM will
    hold a separate copy."""
    if config is not None and getattr(config, "use_vllm", False) and not versions.importable("vllm"):
        raise ValueError("`use_vllm=True` needs vLLM, which is not installed: `pip install 'trl-turbo[vllm]'` "
                         "(vLLM 0.24 for trl_turbo's engine features), or set `use_vllm=False`.")
    if config is None or not _setting(config, "turbo_vllm_shared_weights"):
        return
    adapter = peft_config
    if adapter is None and hasattr(model, "peft_config"):
        adapter = model.peft_config.get(getattr(model, "active_adapter", "default"))
    if adapter is None:
        raise ValueError("`turbo_vllm_shared_weights=True` shares the frozen base weights of a LoRA run; full "
                         "fine-tuning changes every weight each step. Pass a `peft_config=LoraConfig(...)` to "
                         "GRPOTrainer, or set `turbo_vllm_shared_weights=False`.")
    problems = adapter_problems(adapter)
    if problems:
        raise ValueError(f"`turbo_vllm_shared_weights=True` hands the adapter to vLLM, which cannot take this one: "
                         f"{'; '.join(problems)}. Change the LoraConfig or set `turbo_vllm_shared_weights=False`.")
    quantization = _quantization(model, config, quantization_config)
    reasons = copy_reasons(quantization, _model_type(model, config))
    if reasons:
        warnings.warn(fallback_warning(reasons, quantization is not None), RuntimeWarning, stacklevel=4)
    elif quantization is not None:  # shared 4-bit weights: vLLM's 4-bit layers compute in bf16
        warning = compute_dtype_warning(quantization)
        if warning:
            warnings.warn(warning, RuntimeWarning, stacklevel=4)


def _quantization(model: Any, config: Any, quantization_config: Any = None) -> dict[str, Any] | None:
    """The policy's quantization config as a dict (None: not quantized), known before loading: GRPOTrainer's
    `quantization_config` argument, else `model_init_kwargs`'s, else the checkpoint's own (pre-quantized)."""
    if not isinstance(model, str):
        return quantization_config_dict(getattr(getattr(model, "config", None), "quantization_config", None))
    chosen = quantization_config or (config.model_init_kwargs or {}).get("quantization_config")
    if chosen is not None:
        return quantization_config_dict(chosen)
    return quantization_config_dict(getattr(_hf_config(model, config), "quantization_config", None))


def _model_type(model: Any, config: Any) -> str | None:
    hf_config = _hf_config(model, config) if isinstance(model, str) else getattr(model, "config", None)
    return getattr(hf_config, "model_type", None)


@functools.lru_cache(maxsize=8)
def _checkpoint_config(model: str, trust_remote_code: bool) -> Any:
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(model, trust_remote_code=trust_remote_code)


def _hf_config(model: str, config: Any) -> Any:
    kwargs = config.model_init_kwargs or {}
    return _checkpoint_config(model, bool(kwargs.get("trust_remote_code", False)))


# ------------------------------------------------------------------------------------------------- engine
def _sharing(generation: Any, config: Any) -> Sharing | None:
    """How this engine holds the base weights (None: TRL's way, without shared weights), decided once per engine."""
    if generation.mode != "colocate" or config is None or not _setting(config, "turbo_vllm_shared_weights"):
        return None
    sharing = sharing_mode(generation.model)
    if sharing.unforeseen:  # only a loaded quantized model can show them
        warnings.warn(fallback_warning(sharing.unforeseen, quantized=True), RuntimeWarning, stacklevel=3)
    return sharing


def _sampling(generation: Any, config: Any, sharing: Sharing | None) -> str | None:
    """How an engine with shared weights (or a separate copy) samples from the adapter, decided once per engine:
    "merged" where it can serve, else "lora" (with a warning naming why when "merged" was asked for)."""
    if sharing is None:
        return None
    requested = _setting(config, "turbo_vllm_sampling")
    model = generation.model
    adapter = model.active_adapter
    problems = []
    if sharing.mode != SHARED:
        problems.append("vLLM holds a separate copy of the base weights")
    elif four_bit_weights(model):
        problems.append("the base weights are bitsandbytes 4-bit, which cannot hold a merged adapter")
    else:
        problems += merge_problems(model, adapter)
        processes = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
        host = host_copy_problem(adapted_weight_bytes(model, adapter), processes, available_host_bytes())
        if host is not None:
            problems.append(host)
    mode = choose_sampling(requested, problems)
    if requested == MERGED and mode != MERGED:
        warnings.warn(f"trl_turbo: `turbo_vllm_sampling='merged'` cannot serve this run: {'; '.join(problems)}. vLLM "
                      "samples through its LoRA layers instead (`turbo_vllm_sampling='lora'`, about 1.2x slower "
                      "generation).", RuntimeWarning, stacklevel=3)
    return mode


def _engine_kwargs(generation: Any, config: Any, sharing: Sharing | None, sampling: str | None = None
                   ) -> dict[str, Any]:
    kwargs: dict[str, Any] = {}
    dtype = vllm_dtype(generation)
    if dtype is not None:
        kwargs["dtype"] = dtype
    if generation.mode != "colocate" or config is None:
        return kwargs
    if _setting(config, "turbo_vllm_kv_cache_dtype") != "auto":
        kwargs["kv_cache_dtype"] = config.turbo_vllm_kv_cache_dtype
    if sharing is not None:
        peft_model = generation.model
        if sampling != MERGED:  # merged sampling runs vLLM's plain layers: no LoRA slots, no LoRA ops in its graphs
            kwargs.update(lora_engine_kwargs(peft_model.peft_config[peft_model.active_adapter]))
        quantization = quantization_config_dict(getattr(peft_model.config, "quantization_config", None))
        if sharing.mode == SHARED and four_bit_weights(peft_model):
            # vLLM's bitsandbytes loader takes the training model's 4-bit weights (`feeding_4bit_weights`); the HF
            # quantization config tells vLLM how they are quantized
            kwargs["quantization"] = "bitsandbytes"
            kwargs["hf_overrides"] = {
                "quantization_config": vllm_quantization_config(quantization or {"load_in_4bit": True})}
        else:
            kwargs["load_format"] = "dummy"  # the HF weights are copied in once the engine exists
        if sharing.mode == COPY:
            kwargs["dtype"] = dtype or _sixteen_bit(peft_model.dtype)
            kwargs["quantization"] = None  # TRL passes "bitsandbytes" for a 4-bit model
            if quantization is not None:
                # vLLM reads a quantized checkpoint's own quantization config when `quantization` is None
                kwargs["hf_overrides"] = {"quantization_config": None}
    if _setting(config, "turbo_vllm_standby"):
        kwargs["enable_sleep_mode"] = True  # vLLM's tagged CuMem pools: the KV cache can be unmapped alone
        if config.vllm_gpu_memory_utilization == _trl_default(config, "vllm_gpu_memory_utilization"):
            kwargs["kv_cache_memory_bytes"] = _kv_budget(generation, sharing,
                                                         _setting(config, "turbo_vllm_kv_cache_dtype"))
    return kwargs


def _sixteen_bit(dtype: torch.dtype) -> str:
    """The engine dtype of a separate copy: the training model's, unless that is not 16-bit."""
    return "float16" if dtype == torch.float16 else "bfloat16"


def _trl_default(config: Any, name: str) -> Any:
    """The default TRL's config class declares for field `name` (a value left at it counts as not chosen)."""
    return type(config).__dataclass_fields__[name].default


def _kv_budget(generation: Any, sharing: Sharing | None, kv_cache_dtype: str) -> int:
    model = generation.model
    free, total = torch.cuda.mem_get_info(generation.accelerator.device)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    text = model.config.get_text_config()
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    per_token = kv_bytes_per_token(
        layers=text.num_hidden_layers, kv_heads=getattr(text, "num_key_value_heads", None) or text.num_attention_heads,
        head_dim=head_dim, dtype_bytes=1 if kv_cache_dtype.startswith("fp8") else 2,
    )
    useful = useful_kv_cache_bytes(
        max_num_seqs=generation.max_num_seqs or 256,
        seq_len=expected_seq_len(max_model_length=generation.max_model_length,
                                 max_completion_length=generation.max_completion_length),
        max_model_len=generation.max_model_length or text.max_position_embeddings,
        per_token_bytes=per_token,
    )
    return auto_kv_cache_bytes(
        free_bytes=free, total_bytes=total, vllm_weight_bytes=_vllm_weight_bytes(model, sharing),
        trainable_params=trainable,
        sampling_workspace_bytes=sampling_workspace_bytes(4096, text.vocab_size, text.hidden_size),
        useful_bytes=useful,
    )


def _vllm_weight_bytes(model: Any, sharing: Sharing | None) -> int:
    """The device memory vLLM's weights will take beyond what is in use when the KV budget is computed."""
    if sharing is not None and sharing.mode == COPY:  # next to the training model's weights, which stay
        return copy_bytes(model)
    # Shared: in place of the training model's frozen weights (parked on the host meanwhile). Standby alone: TRL's
    # engine loads its own copy of the same storage (a 4-bit model is quantized by vLLM too) next to them. Both add
    # vLLM's own fp32 block scales of double-quantized 4-bit weights.
    frozen = sum(p.numel() * p.element_size() for p in model.parameters() if not p.requires_grad)
    return frozen + statistics_bytes(model)


class _EngineState:
    """What trl_turbo keeps per engine: the adapter channel, the standby, the current request, pending metrics."""

    def __init__(self) -> None:
        self.adapters: Any = None
        self.merged: MergedSampling | None = None
        self.standby: Any = None
        self.lora_request: Any = None
        self.shared_bytes = 0
        self.copy_bytes = 0
        self.metrics: dict[str, float] = {}


def _wrap_init_vllm(original):
    @functools.wraps(original)
    def _init_vllm(self):
        config = construction.constructing_config()
        sharing = _sharing(self, config)
        sampling = _sampling(self, config, sharing)
        parked = None
        if sharing is not None and sharing.mode == SHARED:
            from . import vllm_engine

            parked = vllm_engine.ParkedWeights(self.model)  # one copy on the device even while vLLM starts
        try:
            kwargs = _engine_kwargs(self, config, sharing, sampling)
            module = sys.modules[original.__module__]
            llm_cls = getattr(module, "LLM", None)
            if not kwargs or llm_cls is None:
                return original(self)

            def llm_with_turbo_arguments(*args, **llm_kwargs):
                return llm_cls(*args, **{**llm_kwargs, **kwargs})

            feeding = contextlib.nullcontext()
            if sharing is not None and kwargs.get("quantization") == "bitsandbytes":
                from . import vllm_engine

                feeding = vllm_engine.feeding_4bit_weights(self.model)
            with feeding, _module_attributes(module, _trl_attributes(llm_with_turbo_arguments, kwargs)):
                result = original(self)
            if sharing is not None or _setting(config, "turbo_vllm_standby"):
                _start_engine_features(self, config, parked, sharing, sampling)
            return result
        finally:
            if parked is not None:
                parked.unpark()

    return _init_vllm


def _trl_attributes(llm: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
    """The attributes of TRL's module that `_init_vllm` reads, as trl_turbo replaces them for the call: the engine
    class (with trl_turbo's arguments) and, when trl_turbo chooses vLLM's quantization, TRL's bitsandbytes probe
    (it picks a quantization for 4-bit layers and refuses 8-bit ones)."""
    attributes = {"LLM": llm}
    if "quantization" in kwargs:
        attributes["is_bitsandbytes_available"] = lambda: False
    return attributes


@contextlib.contextmanager
def _module_attributes(module: Any, attributes: dict[str, Any]):
    """Replace `module`'s attributes for the block; the originals come back however it ends."""
    originals = {name: getattr(module, name) for name in attributes}
    for name, value in attributes.items():
        setattr(module, name, value)
    try:
        yield
    finally:
        for name, value in originals.items():
            setattr(module, name, value)


def _start_engine_features(generation: Any, config: Any, parked: Any, sharing: Sharing | None,
                           sampling: str | None) -> None:
    from . import vllm_engine

    state = _EngineState()
    if sharing is not None:
        if sharing.mode == SHARED:
            state.shared_bytes = vllm_engine.share_base_weights(generation.llm, generation.model, parked,
                                                                generation.accelerator.device)
        else:
            state.copy_bytes = vllm_engine.copy_base_weights(generation.llm, generation.model)
        if sampling == MERGED:
            model = generation.model
            state.merged = MergedSampling(model, model.active_adapter)
        else:
            state.adapters = vllm_engine.TensorAdapters(generation.llm)
    if config.turbo_vllm_standby:
        state.standby = vllm_engine.KVStandby(generation.llm)
        state.standby.release()
    generation._trl_turbo_engine = state


# ------------------------------------------------------------------------------------------ sync / generate
def _wrap_sync_weights(original):
    @functools.wraps(original)
    def sync_weights(self):
        state = getattr(self, "_trl_turbo_engine", None)
        start = time.perf_counter()
        if state is not None and state.merged is not None:
            result = None  # the base is shared and never changes; the adapter is merged at each generation
        elif state is None or state.adapters is None:
            result = original(self)
        else:
            model = self.model
            adapter = model.peft_config[model.active_adapter]
            tensors = adapter_tensors(model, model.active_adapter)
            state.lora_request = state.adapters.push(tensors, adapter_config_dict(adapter))
            result = None
        if state is not None:
            state.metrics["vllm/weight_sync_s"] = time.perf_counter() - start
        return result

    return sync_weights


def _wrap_generate(original):
    @functools.wraps(original)
    def generate(self, *args, **kwargs):
        state = getattr(self, "_trl_turbo_engine", None)
        if state is None:
            return original(self, *args, **kwargs)
        device = self.accelerator.device
        start = time.perf_counter()
        merged = state.merged
        try:
            if state.standby is not None or merged is not None:
                # The KV cache maps fresh device memory and the merge needs scratch: blocks torch's allocator still
                # caches from training go back to the driver first (stock TRL's sync does the same).
                torch.cuda.empty_cache()
            if merged is not None:
                merged.merge()  # before the KV cache is mapped: its fp32 scratch is freed by then
                torch.cuda.empty_cache()
                if state.standby is None:
                    self.llm.reset_prefix_cache()  # cached blocks were computed with other weights
            if state.standby is not None:
                state.metrics["vllm/kv_restored_gib"] = state.standby.restore() / _GIB  # also resets the prefix cache
            with_adapter = state.lora_request is not None and merged is None
            if with_adapter:
                self.llm.generate = functools.partial(self.llm.generate, lora_request=state.lora_request)
            try:
                return original(self, *args, **kwargs)
            finally:
                if with_adapter:
                    del self.llm.generate  # back to the class's method
                free, total = torch.cuda.mem_get_info(device)
                state.metrics["vllm/generation_used_gib"] = (total - free) / _GIB
                if state.standby is not None:
                    state.metrics["vllm/kv_released_gib"] = state.standby.release() / _GIB
        finally:
            if merged is not None:
                merged.restore()  # first thing after vLLM is done with the weights, on every way out
            state.metrics["vllm/generation_s"] = time.perf_counter() - start
            torch.cuda.reset_peak_memory_stats(device)

    return generate


def drain_metrics(generation: Any) -> dict[str, float]:
    """The engine metrics gathered since the last call (empty without trl_turbo's engine features)."""
    state = getattr(generation, "_trl_turbo_engine", None)
    if state is None:
        return {}
    metrics, state.metrics = state.metrics, {}
    if state.merged is not None:
        metrics.update(state.merged.take_metrics())
        metrics["vllm/merged_host_copy_gib"] = state.merged.host_bytes / _GIB
    if state.shared_bytes:
        metrics["vllm/shared_weights_gib"] = state.shared_bytes / _GIB
    if state.copy_bytes:
        metrics["vllm/separate_copy_gib"] = state.copy_bytes / _GIB
    return metrics


def apply() -> None:
    from trl.generation.vllm_generation import VLLMGeneration

    for name, wrap in (("_init_vllm", _wrap_init_vllm), ("sync_weights", _wrap_sync_weights),
                       ("generate", _wrap_generate)):
        registry.set_attr(VLLMGeneration, name, wrap(VLLMGeneration.__dict__[name]))
