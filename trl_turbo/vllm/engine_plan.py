"""The colocated engine's plan, decided once per engine before vLLM is built: how it holds the base weights (shared,
or a separate copy), how it samples from the adapter (merged or through LoRA slots), its arguments (precision, LoRA
slots, quantization, KV dtype and budget), and what trl_turbo keeps per engine (`EngineState`, its metrics).

Design decision: this is feature code. It reads the trainer's config and the loaded model, never a host library's
internals; `trl_turbo.patches.trl_vllm` passes it the config TRL does not hand to the engine and applies what it
decides, and `trl_turbo.vllm.engine` is the one module that reaches into vLLM.
"""

from __future__ import annotations

import functools
import math
import warnings
from typing import Any

import torch

from .. import versions
from ..config import TurboFields
from ..device_memory import device_budget
from ..distributed import local_process_count
from ..host_memory import available_host_bytes
from .adapter import adapter_problems, lora_engine_kwargs
from .dequantized import copy_bytes, dequantized_shape
from .fp8 import FP8, Fp8Sampling, quantized_linear_modules
from .kv_budget import (
    auto_kv_cache_bytes,
    expected_seq_len,
    kv_bytes_per_token,
    sampling_workspace_bytes,
    useful_kv_cache_bytes,
)
from .merge import (
    MERGED,
    MergedSampling,
    adapted_weight_bytes,
    choose_sampling,
    host_copy_problem,
    merge_problems,
)
from .quantized import (
    compute_dtype_warning,
    four_bit_weights,
    quantization_config_dict,
    statistics_bytes,
    vllm_quantization_config,
)
from .sharing import COPY, SHARED, Sharing, copy_reasons, fallback_warning, sharing_mode

_DTYPES = {"fp16": "float16", "bf16": "bfloat16"}
FP8_BYTES = 1
_GIB = 2**30


def setting(config: Any, name: str) -> Any:
    """A trl_turbo field of `config`, or its default when `config` lacks it (a config built before the import)."""
    return getattr(config, name, getattr(TurboFields, name))


def vllm_dtype(generation: Any, config: Any) -> str | None:
    """The dtype vLLM should use for a `VLLMGeneration` built by a GRPOTrainer, or None to leave TRL's choice (also
    for a vLLM outside the range precision matching is tested with: a warning, and TRL's own choice)."""
    if not setting(config, "turbo_vllm_match_precision") or generation.mode != "colocate":
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
                         "(vLLM 0.24-0.31 for trl_turbo's engine features), or set `use_vllm=False`.")
    if config is None or not setting(config, "turbo_vllm_shared_weights"):
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
    if setting(config, "turbo_vllm_sampling") == FP8:
        problems = fp8_problems(reasons, adapter, _fp8_capability())
        if problems:
            raise ValueError(f"`turbo_vllm_sampling='fp8'` cannot serve this run: {'; '.join(problems)}. Use "
                             "`turbo_vllm_sampling='merged'` (16-bit models) or 'lora'.")
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


def _fp8_capability() -> tuple[int, int] | None:
    return torch.cuda.get_device_capability() if torch.cuda.is_available() else None


def fp8_problems(copy_reasons: list[str], adapter: Any, capability: tuple[int, int] | None) -> list[str]:
    """Why `turbo_vllm_sampling='fp8'` cannot serve a run (empty: it can), known before the model loads: vLLM's fp8
    layers need an fp8 GPU (compute capability 8.9+); the fp8 copy is written from weights whose layout trl_turbo
    maps (16-bit or bitsandbytes 4-bit: `copy_reasons` must be empty); and the adapter must sit on linear layers vLLM
    quantizes (not embeddings or the LM head, which vLLM keeps in 16 bits)."""
    problems = []
    if capability is None or capability < (8, 9):
        problems.append("vLLM's fp8 layers need a GPU of compute capability 8.9 or newer (Ada, Hopper, Blackwell)"
                        + ("" if capability is None else f"; this one is {capability[0]}.{capability[1]}"))
    problems += copy_reasons
    targets = getattr(adapter, "target_modules", None) or ()
    targets = [targets] if isinstance(targets, str) else list(targets)
    unquantized = sorted({t for t in targets if any(k in t for k in ("embed", "lm_head", "wte"))})
    unquantized += sorted(getattr(adapter, "modules_to_save", None) or ())
    if unquantized:
        problems.append(f"the adapter adapts or trains {unquantized}, which vLLM keeps in 16 bits, unquantized")
    return problems


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
def engine_sharing(generation: Any, config: Any) -> Sharing | None:
    """How this engine holds the base weights (None: TRL's way, without shared weights), decided once per engine."""
    if generation.mode != "colocate" or config is None or not setting(config, "turbo_vllm_shared_weights"):
        return None
    sharing = sharing_mode(generation.model)
    if sharing.unforeseen:  # only a loaded quantized model can show them
        warnings.warn(fallback_warning(sharing.unforeseen, quantized=True), RuntimeWarning, stacklevel=3)
    return sharing


def engine_sampling(generation: Any, config: Any, sharing: Sharing | None) -> str | None:
    """How an engine with shared weights (or a separate copy) samples from the adapter, decided once per engine:
    "merged" where it can serve, else "lora" (with a warning naming why when "merged" was asked for)."""
    if sharing is None:
        return None
    requested = setting(config, "turbo_vllm_sampling")
    if requested == FP8:  # refused before the model loaded where it cannot serve (`check_trainer_inputs`)
        return FP8
    model = generation.model
    adapter = model.active_adapter
    problems = []
    if sharing.mode != SHARED:
        problems.append("vLLM holds a separate copy of the base weights")
    elif four_bit_weights(model):
        problems.append("the base weights are bitsandbytes 4-bit, which cannot hold a merged adapter")
    else:
        problems += merge_problems(model, adapter)
        host = host_copy_problem(adapted_weight_bytes(model, adapter), local_process_count(), available_host_bytes())
        if host is not None:
            problems.append(host)
    mode = choose_sampling(requested, problems)
    if requested == MERGED and mode != MERGED:
        warnings.warn(f"trl_turbo: `turbo_vllm_sampling='merged'` cannot serve this run: {'; '.join(problems)}. vLLM "
                      "samples through its LoRA layers instead (`turbo_vllm_sampling='lora'`, about 1.2x slower "
                      "generation).", RuntimeWarning, stacklevel=3)
    return mode


def fp8_parks_base(model: Any) -> bool:
    """Whether fp8 sampling moves the training model's 16-bit linear weights to the host while vLLM samples: yes,
    unless they are 4-bit (little to gain) or the pinned host copy does not fit (then a warning names why)."""
    if four_bit_weights(model):
        return False
    weight_bytes = sum(m.weight.numel() * m.weight.element_size() for m in quantized_linear_modules(model))
    problem = host_copy_problem(weight_bytes, local_process_count(), available_host_bytes())
    if problem is not None:
        warnings.warn(f"trl_turbo: fp8 sampling keeps the 16-bit base weights on the device while vLLM samples "
                      f"(about 2 bytes per linear weight more in the generation phase): {problem}.", RuntimeWarning,
                      stacklevel=3)
        return False
    return True


def engine_kwargs(generation: Any, config: Any, sharing: Sharing | None,
                  sampling: str | None = None) -> dict[str, Any]:
    kwargs: dict[str, Any] = {}
    dtype = vllm_dtype(generation, config)
    if dtype is not None:
        kwargs["dtype"] = dtype
    if generation.mode != "colocate" or config is None:
        return kwargs
    if setting(config, "turbo_vllm_kv_cache_dtype") != "auto":
        kwargs["kv_cache_dtype"] = config.turbo_vllm_kv_cache_dtype
    if sharing is not None:
        peft_model = generation.model
        if sampling not in (MERGED, FP8):  # vLLM's plain (or fp8) layers: no LoRA slots, no LoRA ops in its graphs
            kwargs.update(lora_engine_kwargs(peft_model.peft_config[peft_model.active_adapter]))
        quantization = quantization_config_dict(getattr(peft_model.config, "quantization_config", None))
        if sampling == FP8:
            # vLLM quantizes its linear layers to fp8 online (dummy values first; `Fp8Sampling` writes them)
            kwargs.update(load_format="dummy", quantization="fp8")
            kwargs.setdefault("dtype", _sixteen_bit(_compute_dtype(peft_model)))
            if quantization is not None:  # never the checkpoint's own quantization config
                kwargs["hf_overrides"] = {"quantization_config": None}
        elif sharing.mode == SHARED and four_bit_weights(peft_model):
            # vLLM's bitsandbytes loader takes the training model's 4-bit weights (`feeding_4bit_weights`); the HF
            # quantization config tells vLLM how they are quantized
            kwargs["quantization"] = "bitsandbytes"
            kwargs["hf_overrides"] = {
                "quantization_config": vllm_quantization_config(quantization or {"load_in_4bit": True})}
        else:
            kwargs["load_format"] = "dummy"  # the HF weights are copied in once the engine exists
        if sharing.mode == COPY and sampling != FP8:
            kwargs["dtype"] = dtype or _sixteen_bit(peft_model.dtype)
            kwargs["quantization"] = None  # TRL passes "bitsandbytes" for a 4-bit model
            if quantization is not None:
                # vLLM reads a quantized checkpoint's own quantization config when `quantization` is None
                kwargs["hf_overrides"] = {"quantization_config": None}
    if setting(config, "turbo_vllm_standby"):
        kwargs["enable_sleep_mode"] = True  # vLLM's tagged CuMem pools: the KV cache can be unmapped alone
        if config.vllm_gpu_memory_utilization == _trl_default(config, "vllm_gpu_memory_utilization"):
            kwargs["kv_cache_memory_bytes"] = kv_budget(generation, sharing, setting(config, "turbo_vllm_kv_cache_dtype"),
                                                         sampling)
    return kwargs


def _compute_dtype(model: Any) -> torch.dtype:
    """The dtype a (possibly 4-bit) model computes in: its first floating-point parameter's."""
    return next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.bfloat16)


def _sixteen_bit(dtype: torch.dtype) -> str:
    """The engine dtype of a separate copy: the training model's, unless that is not 16-bit."""
    return "float16" if dtype == torch.float16 else "bfloat16"


def _trl_default(config: Any, name: str) -> Any:
    """The default TRL's config class declares for field `name` (a value left at it counts as not chosen)."""
    return type(config).__dataclass_fields__[name].default


def kv_budget(generation: Any, sharing: Sharing | None, kv_cache_dtype: str, sampling: str | None = None) -> int:
    model = generation.model
    free, _, total = device_budget(generation.accelerator.device)  # within a per-process cap, if one is set
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    text = model.config.get_text_config()
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    per_token = kv_bytes_per_token(
        layers=text.num_hidden_layers, kv_heads=getattr(text, "num_key_value_heads", None) or text.num_attention_heads,
        head_dim=head_dim, dtype_bytes=1 if kv_cache_dtype.startswith("fp8") else 2,
    )
    max_num_seqs = generation.max_num_seqs or 256
    useful = useful_kv_cache_bytes(
        max_num_seqs=max_num_seqs,
        seq_len=expected_seq_len(max_model_length=generation.max_model_length,
                                 max_completion_length=generation.max_completion_length),
        max_model_len=generation.max_model_length or text.max_position_embeddings,
        per_token_bytes=per_token,
    )
    return auto_kv_cache_bytes(
        free_bytes=free, total_bytes=total, vllm_weight_bytes=_vllm_weight_bytes(model, sharing, sampling),
        trainable_params=trainable,
        sampling_workspace_bytes=sampling_workspace_bytes(max_num_seqs, text.vocab_size, text.hidden_size),
        useful_bytes=useful,
    )


def _vllm_weight_bytes(model: Any, sharing: Sharing | None, sampling: str | None = None) -> int:
    """The device memory vLLM's weights will take beyond what is in use when the KV budget is computed."""
    if sharing is not None and sharing.mode == COPY:  # next to the training model's weights, which stay
        return copy_bytes(model)
    if sampling == FP8:  # 1 byte per linear weight, plus every frozen weight parked on the host meanwhile: the 16-bit
        # embeddings and LM head come back as vLLM's (shared), the linear weights as the training model's own
        fp8_bytes = sum(math.prod(dequantized_shape(m.weight)) * FP8_BYTES for m in quantized_linear_modules(model))
        return fp8_bytes + sum(p.numel() * p.element_size() for p in model.parameters() if not p.requires_grad)
    # Shared: in place of the training model's frozen weights (parked on the host meanwhile). Standby alone: TRL's
    # engine loads its own copy of the same storage (a 4-bit model is quantized by vLLM too) next to them. Both add
    # vLLM's own fp32 block scales: shared, of double-quantized 4-bit weights; its own copy, of every 4-bit weight.
    frozen = sum(p.numel() * p.element_size() for p in model.parameters() if not p.requires_grad)
    return frozen + statistics_bytes(model, shared=sharing is not None and sharing.mode == SHARED)


class EngineState:
    """What trl_turbo keeps per engine: the adapter channel, the standby, the current request, pending metrics."""

    def __init__(self) -> None:
        self.adapters: Any = None
        self.merged: MergedSampling | None = None
        self.fp8: Fp8Sampling | None = None
        self.standby: Any = None
        self.lora_request: Any = None
        self.shared_bytes = 0
        self.copy_bytes = 0
        self.metrics: dict[str, float] = {}


ENGINE_STATE_ATTRIBUTE = "_trl_turbo_engine"  # set on TRL's `VLLMGeneration` by `patches.trl_vllm`


def engine_state(generation: Any) -> EngineState | None:
    """What trl_turbo keeps for a `VLLMGeneration`'s engine (None: TRL's own engine, no trl_turbo features)."""
    return getattr(generation, ENGINE_STATE_ATTRIBUTE, None)


def generation_footprint(generation: Any) -> int | None:
    """Device memory in use when the engine's last generation ended (None: no engine, no standby, or no generation
    yet): with the KV cache released during training, the training phase can use up to this without raising the
    step's peak."""
    state = engine_state(generation)
    standby = state.standby if state is not None else None
    return standby.generation_in_use_bytes if standby is not None else None


def drain_metrics(generation: Any) -> dict[str, float]:
    """The engine metrics gathered since the last call (empty without trl_turbo's engine features)."""
    state = engine_state(generation)
    if state is None:
        return {}
    metrics, state.metrics = state.metrics, {}
    if state.fp8 is not None:
        metrics.update(state.fp8.take_metrics())
        if state.standby is not None:
            metrics["vllm/fp8_resident_gib"] = state.standby.resident_bytes / _GIB
    if state.merged is not None:
        metrics.update(state.merged.take_metrics())
        metrics["vllm/merged_host_copy_gib"] = state.merged.host_bytes / _GIB
    if state.shared_bytes:
        metrics["vllm/shared_weights_gib"] = state.shared_bytes / _GIB
    if state.copy_bytes:
        metrics["vllm/separate_copy_gib"] = state.copy_bytes / _GIB
    return metrics
