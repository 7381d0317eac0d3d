"""TRL's colocated vLLM engine (`trl.generation.vllm_generation.VLLMGeneration`): precision, shared weights,
adapters as tensors, KV standby.

Seams, all methods of `VLLMGeneration`:
- `_init_vllm`: for the duration of the call, the module attribute `LLM` it constructs from gets extra arguments:
  the training dtype (`turbo_vllm_match_precision`: TRL would leave a bf16 sampler under fp16 training, the
  mismatch arXiv 2510.26788 removes), dummy weights (shared weights; one LoRA slot for "lora" sampling, none for
  "merged"), CuMem pools and a KV budget (standby), the KV dtype. With shared weights the HF model's frozen matrices wait on the host during the call;
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
import sys
import time
from typing import Any

import torch

from ..vllm import engine as vllm_engine
from ..vllm.adapter import adapter_config_dict, adapter_tensors
from ..vllm.engine_plan import (
    EngineState,
    drain_metrics,
    engine_kwargs,
    engine_sampling,
    engine_sharing,
    fp8_parks_base,
    setting,
)
from ..vllm.fp8 import FP8, Fp8Sampling
from ..vllm.merge import MERGED, MergedSampling
from ..vllm.sharing import SHARED, Sharing
from .. import registry
from . import construction

_GIB = 2**30
__all__ = ["apply", "drain_metrics"]  # drain_metrics: read by the step-metrics seam


def _wrap_init_vllm(original):
    @functools.wraps(original)
    def _init_vllm(self):
        config = construction.constructing_config()
        sharing = engine_sharing(self, config)
        sampling = engine_sampling(self, config, sharing)
        parked = None
        if sharing is not None and (sharing.mode == SHARED or sampling == FP8):
            parked = vllm_engine.ParkedWeights(self.model)  # one copy on the device even while vLLM starts
        try:
            kwargs = engine_kwargs(self, config, sharing, sampling)
            module = sys.modules[original.__module__]
            llm_cls = getattr(module, "LLM", None)
            if not kwargs or llm_cls is None:
                return original(self)

            def llm_with_turbo_arguments(*args, **llm_kwargs):
                return llm_cls(*args, **{**llm_kwargs, **kwargs})

            feeding = contextlib.nullcontext()
            if sharing is not None and kwargs.get("quantization") == "bitsandbytes":
                feeding = vllm_engine.feeding_4bit_weights(self.model)
            with feeding, _module_attributes(module, _trl_attributes(llm_with_turbo_arguments, kwargs)):
                result = original(self)
            if sharing is not None or setting(config, "turbo_vllm_standby"):
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
    """Replace `module`'s attributes for the block (scoped registry patches); the originals come back however it
    ends."""
    with contextlib.ExitStack() as stack:
        for name, value in attributes.items():
            stack.enter_context(registry.scoped(module, name, value))
        yield


def _start_engine_features(generation: Any, config: Any, parked: Any, sharing: Sharing | None,
                           sampling: str | None) -> None:
    state = EngineState()
    release_with_kv = []
    if sampling == FP8:
        model = generation.model
        fp8 = vllm_engine.fp8_tensors(generation.llm)
        state.shared_bytes = vllm_engine.share_base_weights(generation.llm, model, parked,
                                                            generation.accelerator.device, fp8=fp8)
        views = vllm_engine.plan_views(generation.llm, model.get_base_model(), fp8)[2]
        release_with_kv = [tensor.rows for tensor in fp8.values()]
    elif sharing is not None:
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
        state.standby = vllm_engine.KVStandby(generation.llm, also_release=release_with_kv)
        state.standby.release()
    if sampling == FP8:
        # The matrices the fp8 copy is written from come back to the device only now, after the KV cache and the
        # fp8 copy went: the engine started while they waited on the host
        if parked is not None:
            parked.unpark()
        state.fp8 = Fp8Sampling(model, model.active_adapter, fp8, views, vllm_engine.engine_dtype(generation.llm),
                                park_base=fp8_parks_base(model))
    generation._trl_turbo_engine = state


# ------------------------------------------------------------------------------------------ sync / generate
def _wrap_sync_weights(original):
    @functools.wraps(original)
    def sync_weights(self):
        state = getattr(self, "_trl_turbo_engine", None)
        start = time.perf_counter()
        if state is not None and (state.merged is not None or state.fp8 is not None):
            result = None  # the base never changes; the adapter is merged (or quantized in) at each generation
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
            if state.fp8 is not None:
                if state.standby is not None:
                    state.standby.restore_weights()  # the fp8 copy's memory only (empty): written before the KV cache
                state.fp8.write()  # parks the training model's 16-bit linear weights on the host as it goes
                torch.cuda.empty_cache()
                if state.standby is None:
                    self.llm.reset_prefix_cache()  # cached blocks were computed with the previous copy
            if state.standby is not None:
                state.metrics["vllm/kv_restored_gib"] = state.standby.restore() / _GIB  # also resets the prefix cache
            adapter = contextlib.nullcontext()
            if state.lora_request is not None:  # TRL's `llm.generate` call carries the adapter
                adapter = registry.scoped(self.llm, "generate",
                                          functools.partial(self.llm.generate, lora_request=state.lora_request))
            try:
                with adapter:
                    return original(self, *args, **kwargs)
            finally:
                free, total = torch.cuda.mem_get_info(device)
                state.metrics["vllm/generation_used_gib"] = (total - free) / _GIB
                if state.standby is not None:
                    state.metrics["vllm/kv_released_gib"] = state.standby.release() / _GIB
        finally:
            if merged is not None:
                merged.restore()  # first thing after vLLM is done with the weights, on every way out
            if state.fp8 is not None:
                state.fp8.unpark()  # after the KV cache and the fp8 copy are released
            state.metrics["vllm/generation_s"] = time.perf_counter() - start
            torch.cuda.reset_peak_memory_stats(device)

    return generate


def apply() -> None:
    from trl.generation.vllm_generation import VLLMGeneration

    for name, wrap in (("_init_vllm", _wrap_init_vllm), ("sync_weights", _wrap_sync_weights),
                       ("generate", _wrap_generate)):
        registry.set_attr(VLLMGeneration, name, wrap(VLLMGeneration.__dict__[name]))
