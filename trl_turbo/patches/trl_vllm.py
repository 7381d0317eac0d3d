"""TRL's colocated vLLM engine (`trl.generation.vllm_generation.VLLMGeneration`): precision, shared weights, the
sampling modes, KV standby. What each seam decides or does lives in `trl_turbo.vllm` (`engine_plan`: the engine's
plan; `session`: setting it up and ordering each generation; `engine`: the one module that reaches into vLLM).

Seams, all methods of `VLLMGeneration`:
- `_init_vllm`: for the duration of the call, TRL's module attribute `LLM` gets the plan's extra arguments (dtype,
  dummy weights, LoRA slots only for "lora" sampling, online fp8 for "fp8", CuMem pools and a KV budget, the KV
  dtype); where trl_turbo chooses vLLM's quantization, TRL's bitsandbytes probe is switched off for the call (it
  would choose too, and refuses 8-bit models). With shared weights the training model's frozen matrices wait on the
  host while vLLM starts (one copy on the device even then); a shared 4-bit model's bytes go in through vLLM's
  bitsandbytes loader while it is built. Afterwards `session.start_engine` shares or copies the weights and sets up
  the sampling mode and standby.
- `sync_weights`: with shared weights the base never changes, so TRL's merge → push every weight → unmerge (which
  also drifts bf16 base weights) is replaced by handing vLLM the adapter's tensors ("lora" sampling) or by nothing
  ("merged" and "fp8" sampling read the live adapter at each generation); under full fine-tuning by casting the
  trained parameters vLLM keeps a copy of (none where they are its weights) and resetting the prefix cache.
- `generate`: runs inside `session.generating` (adapter merged or quantized in, KV cache mapped, all put back however
  the generation ends); for "lora" sampling TRL's `llm.generate` call carries the adapter's `LoRARequest`.
Timings and memory go to the trainer's metrics under `vllm/`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import sys
import time
from typing import Any

from .. import registry, run_plan
from ..vllm import engine as vllm_engine
from ..vllm import session as engine_session
from ..vllm.adapter import adapter_config_dict, adapter_tensors
from ..vllm.engine_plan import ENGINE_STATE_ATTRIBUTE, engine_kwargs, engine_state
from . import construction

__all__ = ["apply"]


def _wrap_init_vllm(original):
    @functools.wraps(original)
    def _init_vllm(self):
        progress = construction.constructing_plan()
        config = construction.constructing_config()
        plan = run_plan.plan_engine_for(config, self)
        parked = vllm_engine.ParkedWeights(self.model) if plan.parks_while_starting else None
        try:  # one copy on the device even while vLLM starts
            kwargs = engine_kwargs(self, config, plan.sharing, plan.sampling, plan.sharded)
            plan = dataclasses.replace(plan, engine_kwargs=dict(kwargs))
            record = progress is not None and self.mode == "colocate"
            if record:
                progress.engine = plan
            module = sys.modules[original.__module__]
            llm_cls = getattr(module, "LLM", None)
            if not kwargs or llm_cls is None:
                return original(self)

            def llm_with_turbo_arguments(*args, **llm_kwargs):
                return llm_cls(*args, **{**llm_kwargs, **kwargs})

            feeding = contextlib.nullcontext()
            if plan.sharing is not None and kwargs.get("quantization") == "bitsandbytes":
                feeding = vllm_engine.feeding_4bit_weights(self.model)
            with feeding, _module_attributes(module, _trl_attributes(llm_with_turbo_arguments, kwargs)):
                result = original(self)
            if plan.sharing is not None or plan.standby:
                state, plan = engine_session.start_engine(self, plan, parked)
                setattr(self, ENGINE_STATE_ATTRIBUTE, state)
                if record:
                    progress.engine = plan  # with the fp8 parking decided once the engine exists
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


# ------------------------------------------------------------------------------------------ sync / generate
def _wrap_sync_weights(original):
    @functools.wraps(original)
    def sync_weights(self):
        state = engine_state(self)
        start = time.perf_counter()
        if state is not None and state.full_finetuning:
            # the trained parameters are vLLM's weights; those it keeps a copy of are cast (or loaded) in place (an
            # fp8 copy is written from them at the generation)
            engine_session.sync_trained_weights(state)
            if state.standby is None or not state.standby.released:  # a released standby resets it as it maps back
                self.llm.reset_prefix_cache()
            result = None
        elif state is not None and (state.merged is not None or state.fp8 is not None):
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
        state = engine_state(self)
        if state is None:
            return original(self, *args, **kwargs)
        with engine_session.generating(self.llm, state, self.accelerator.device):
            if state.lora_request is None:
                return original(self, *args, **kwargs)
            # "lora" sampling: TRL's `llm.generate` call carries the adapter
            with registry.scoped(self.llm, "generate",
                                 functools.partial(self.llm.generate, lora_request=state.lora_request)):
                return original(self, *args, **kwargs)

    return generate


def apply() -> None:
    from trl.generation.vllm_generation import VLLMGeneration

    for name, wrap in (("_init_vllm", _wrap_init_vllm), ("sync_weights", _wrap_sync_weights),
                       ("generate", _wrap_generate)):
        registry.set_attr(VLLMGeneration, name, wrap(VLLMGeneration.__dict__[name]))
