"""The colocated engine's plan, decided once per engine before vLLM is built: how it holds the base weights (shared,
or a separate copy), how it samples from the adapter (merged, through LoRA slots, or an fp8 copy), whether the
training model's weights are parked, and the arguments vLLM is built with (precision, LoRA slots, quantization, KV
dtype and budget); and what trl_turbo keeps per engine (`EngineState`, its metrics).

Design decision: the decisions are a pure function (`plan_engine`) of the run's settings and the facts of the policy
model (`EngineFacts`), which a run takes from the loaded model (`engine_facts`) and `trl-turbo plan` from the model's
counted config, so a forecast and a run decide alike. `trl_turbo.run_plan` calls it; the TRL seam
(`patches.trl_vllm`) applies what it decides, and `trl_turbo.vllm.engine` is the one module that reaches into vLLM.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .. import versions
from ..config import KVCacheDtype, SamplingMode, Settings
from ..device_memory import device_budget
from ..distributed import Strategy, detect_strategy, local_process_count
from ..host_memory import available_host_bytes
from .adapter import active_adapter, lora_engine_kwargs
from .dequantized import copy_bytes, dequantized_shape
from .fp8 import Fp8Sampling, quantized_linear_modules
from .kv_budget import (
    auto_kv_cache_bytes,
    expected_seq_len,
    kv_bytes_per_token,
    rank_kv_heads,
    sampling_workspace_bytes,
    useful_kv_cache_bytes,
)
from .merge import (
    MergedSampling,
    adapted_weight_bytes,
    host_copy_problem,
    merge_problems,
)
from .quantized import (
    four_bit_weights,
    layout_problems,
    quantization_config_dict,
    statistics_bytes,
    vllm_quantization_config,
)
from .sharing import COPY, SHARED, Sharing, fallback_warning, sharing_for

_DTYPES = {"fp16": "float16", "bf16": "bfloat16"}
FP8_BYTES = 1
_GIB = 2**30


def vllm_dtype(generation: Any, config: Any) -> str | None:
    """The dtype vLLM should use for a `VLLMGeneration` built by a GRPOTrainer, or None to leave TRL's choice (also
    for a vLLM outside the range precision matching is tested with: a warning, and TRL's own choice)."""
    if not Settings.of(config).vllm_match_precision or generation.mode != "colocate":
        return None
    reason = versions.unsupported_reason({"vllm": versions.SUPPORTED_OPTIONAL["vllm"]})
    if reason is not None:
        warnings.warn(f"trl_turbo: `turbo_vllm_match_precision` is off for this engine: {reason}. vLLM samples in "
                      "the dtype TRL chooses.", RuntimeWarning, stacklevel=2)
        return None
    return _DTYPES.get(str(generation.accelerator.mixed_precision))


# ------------------------------------------------------------------------------------------------- engine
@dataclass(frozen=True)
class EngineFacts:
    """What the engine's plan reads of the policy model and the host: taken from a loaded model (`engine_facts`)
    or, for a forecast, from the model's config (`trl_turbo.planning`)."""

    model_type: str | None
    quantization: Mapping[str, Any] | None  # the policy's quantization config (None: 16-bit)
    four_bit: bool  # packed bitsandbytes 4-bit base weights
    layout_problems: tuple[str, ...]  # 4-bit layers vLLM's would not line up with (only a loaded model shows them)
    merge_problems: tuple[str, ...]  # why the adapter cannot be merged into the base weights
    adapted_weight_bytes: int  # the adapted base matrices (merged sampling's host copy)
    linear_weight_bytes: int  # the 16-bit linear base matrices vLLM quantizes (fp8 sampling parks them)
    processes_on_host: int
    host_bytes: int  # host memory available
    installed_vllm: bool = True  # judge by the installed vLLM's abilities (a forecast for another machine: False)
    has_adapter: bool = True  # a LoRA run (False: full fine-tuning)


def engine_facts(model: Any, host_bytes: int | None = None) -> EngineFacts:
    """The facts of a loaded PEFT policy model (`host_bytes`: the host memory to plan with; default: available now)."""
    quantization = quantization_config_dict(getattr(model.config, "quantization_config", None))
    adapter = active_adapter(model)
    four_bit = bool(four_bit_weights(model))
    return EngineFacts(
        model_type=getattr(model.config, "model_type", None),
        quantization=quantization,
        four_bit=four_bit,
        layout_problems=tuple(layout_problems(model)) if quantization is not None else (),
        merge_problems=tuple(merge_problems(model, adapter)) if adapter is not None else (),
        adapted_weight_bytes=adapted_weight_bytes(model, adapter) if adapter is not None else 0,
        linear_weight_bytes=0 if four_bit else sum(m.weight.numel() * m.weight.element_size()
                                                   for m in quantized_linear_modules(model)),
        processes_on_host=local_process_count(),
        host_bytes=available_host_bytes() if host_bytes is None else host_bytes,
        has_adapter=adapter is not None,
    )


@dataclass(frozen=True)
class EnginePlan:
    """How one colocated engine runs, decided once before vLLM is built."""

    sharing: Sharing | None  # None: TRL's way (no shared weights, no separate copy made by trl_turbo)
    sampling: SamplingMode | None  # how the adapter reaches the sampler (None without `sharing`)
    sampling_problems: tuple[str, ...]  # why "merged" cannot serve (empty where it can)
    parks_while_starting: bool  # the training model's frozen weights wait on the host while vLLM starts
    # fp8 sampling moves the 16-bit linear weights to the host while vLLM samples (decided again, from the host
    # memory available then, once the engine has started: `fp8_parking`)
    fp8_parks_base: bool
    fp8_park_problem: str | None  # why they stay on the device
    standby: bool
    kv_cache_dtype: KVCacheDtype
    # what the run passed to vLLM's `LLM` (trl_turbo's arguments; a forecast has none)
    engine_kwargs: Mapping[str, Any] | None = None
    # full fine-tuning: the trained parameters are vLLM's weights (or cast into them at each sync); no adapter
    full_finetuning: bool = False
    tp_size: int = 1  # vLLM's tensor-parallel size
    # FSDP2 shards the training model: the shared weights are each rank's tensor-parallel slices, adopted when FSDP2
    # wraps the model (`trl_turbo.vllm.sharded`)
    sharded: bool = False

    @property
    def shares_weights(self) -> bool:
        """The training model's base weights are vLLM's (not TRL's own engine, not a separate copy)."""
        return self.sharing is not None and self.sharing.mode == SHARED

    @property
    def kv_cache_bytes(self) -> int | None:
        """The automatic KV budget passed to vLLM (None: vLLM sizes its cache from TRL's memory utilization)."""
        return (self.engine_kwargs or {}).get("kv_cache_memory_bytes")


def sampling_from(requested: SamplingMode, sharing: Sharing, facts: EngineFacts,
                  shards: int = 1) -> tuple[SamplingMode, list[str]]:
    """The sampling mode of an engine with shared weights (or a separate copy), and why "merged" cannot serve:
    "merged" where nothing stands against merging, else "lora"; "fp8" as asked (refused before the model loaded
    where it cannot serve). `shards`: the adapted matrices are split over that many ranks (FSDP2 shards that are
    tensor-parallel slices), each keeping the host copy of its own slices only."""
    if requested is SamplingMode.FP8:
        return SamplingMode.FP8, []
    problems = []
    if sharing.mode != SHARED:
        problems.append("vLLM holds a separate copy of the base weights")
    elif facts.four_bit:
        problems.append("the base weights are bitsandbytes 4-bit, which cannot hold a merged adapter")
    else:
        problems += facts.merge_problems
        host = host_copy_problem(facts.adapted_weight_bytes // shards, facts.processes_on_host, facts.host_bytes)
        if host is not None:
            problems.append(host)
    if requested is SamplingMode.LORA or problems:
        return SamplingMode.LORA, problems
    return SamplingMode.MERGED, problems


def fp8_parking(facts: EngineFacts, shards: int = 1) -> tuple[bool, str | None]:
    """Whether fp8 sampling moves the training model's 16-bit linear weights to the host while vLLM samples: yes,
    unless they are trained (full fine-tuning: they change every step, a copy taken once would be stale), 4-bit
    (little to gain), or the pinned host copy does not fit (the reason). `shards`: each process holds 1/shards of them
    (FSDP2's shards that are tensor-parallel slices)."""
    if facts.four_bit or not facts.has_adapter:
        return False, None
    problem = host_copy_problem(facts.linear_weight_bytes // shards, facts.processes_on_host, facts.host_bytes)
    return problem is None, problem


def plan_engine(settings: Settings, facts: EngineFacts | None, *, colocate: bool = True, tp_size: int = 1,
                fsdp2: bool = False, unshared_adapted: Sequence[str] = (),
                unshared_projections: Sequence[str] = ()) -> EnginePlan:
    """The plan of an engine for a run with `settings` (`facts`: needed with shared weights); `tp_size`: vLLM's
    tensor-parallel size; `fsdp2`: FSDP2 shards the training model; `unshared_adapted` / `unshared_projections`: the
    adapted weights / decoder projections whose FSDP2 shard cannot be vLLM's slice (merging into them would not reach
    the sampler; an fp8 copy written per shard would miss their rows)."""
    sharing = sampling = None
    problems: list[str] = []
    sharded = colocate and settings.vllm_shared_weights and fsdp2
    shards = tp_size if sharded else 1  # each rank holds 1/shards of the weights it samples from
    if colocate and settings.vllm_shared_weights:
        if facts is None:
            raise ValueError("the engine plan of shared weights needs the policy model's facts")
        sharing = sharing_for(facts.quantization, facts.model_type, facts.layout_problems,
                              installed=facts.installed_vllm)
        if sharded and sharing.mode != SHARED:
            raise ValueError(f"`turbo_vllm_shared_weights=True` under FSDP2 shares tensor-parallel slices of 16-bit "
                             f"weights only, and this model cannot share them: {'; '.join(sharing.reasons)}. Set "
                             "`turbo_vllm_shared_weights=False` (TRL's weight sync), or train with DDP.")
        if facts.has_adapter:
            sampling, problems = sampling_from(settings.vllm_sampling, sharing, facts, shards=shards)
        elif settings.vllm_sampling is SamplingMode.FP8:  # full fine-tuning: an fp8 copy of the trained weights
            sampling = SamplingMode.FP8
        if sharded and sampling is SamplingMode.MERGED and unshared_adapted:
            sampling, problems = SamplingMode.LORA, [*problems, f"{len(unshared_adapted)} adapted weights keep a "
                                                     f"copy of their own in vLLM (e.g. {unshared_adapted[0]}), which "
                                                     "a merge into FSDP2's shards would not reach"]
    fp8 = sampling is SamplingMode.FP8
    if sharded and fp8 and unshared_projections:
        raise ValueError(f"`turbo_vllm_sampling='fp8'` under FSDP2 writes each rank's fp8 copy from its own shards, "
                         f"but {len(unshared_projections)} projections are laid out otherwise in vLLM (e.g. "
                         f"{unshared_projections[0]}: KV heads fewer than `vllm_tensor_parallel_size={tp_size}`, or a "
                         "dimension it does not divide). Use `turbo_vllm_sampling='merged'` or 'lora', or a "
                         "tensor-parallel size that divides the KV heads.")
    parks, park_problem = fp8_parking(facts, shards=shards) if fp8 else (False, None)
    return EnginePlan(
        sharing=sharing, sampling=sampling, sampling_problems=tuple(problems),
        # under FSDP2 the model waits on the host until training starts, and full fine-tuning parks nothing (no
        # frozen weights): nothing to park
        parks_while_starting=sharing is not None and (sharing.mode == SHARED or fp8) and not sharded
        and facts.has_adapter,
        fp8_parks_base=parks, fp8_park_problem=park_problem,
        standby=colocate and settings.vllm_standby, kv_cache_dtype=settings.vllm_kv_cache_dtype,
        full_finetuning=sharing is not None and not facts.has_adapter, tp_size=tp_size, sharded=sharded,
    )


def warn_engine_plan(plan: EnginePlan, settings: Settings) -> None:
    """The run's warnings about its engine plan before vLLM starts: a separate copy only the loaded model showed,
    "merged" asked for where it cannot serve."""
    if plan.sharing is not None and plan.sharing.unforeseen:
        warnings.warn(fallback_warning(plan.sharing.unforeseen, quantized=True), RuntimeWarning, stacklevel=4)
    if settings.vllm_sampling is SamplingMode.MERGED and plan.sampling is not SamplingMode.MERGED:
        warnings.warn(f"trl_turbo: `turbo_vllm_sampling='merged'` cannot serve this run: "
                      f"{'; '.join(plan.sampling_problems)}. vLLM samples through its LoRA layers instead "
                      "(`turbo_vllm_sampling='lora'`, about 1.2x slower generation).", RuntimeWarning, stacklevel=4)


def warn_fp8_parking(problem: str | None) -> None:
    if problem is not None:
        warnings.warn(f"trl_turbo: fp8 sampling keeps the 16-bit base weights on the device while vLLM samples "
                      f"(about 2 bytes per linear weight more in the generation phase): {problem}.", RuntimeWarning,
                      stacklevel=4)


def engine_kwargs(generation: Any, config: Any, sharing: Sharing | None,
                  sampling: str | None = None, sharded: bool = False) -> dict[str, Any]:
    kwargs: dict[str, Any] = {}
    dtype = vllm_dtype(generation, config)
    if dtype is not None:
        kwargs["dtype"] = dtype
    if generation.mode != "colocate" or config is None:
        return kwargs
    settings = Settings.of(config)
    if settings.vllm_kv_cache_dtype.is_fp8:
        kwargs["kv_cache_dtype"] = settings.vllm_kv_cache_dtype.value
    if sharing is not None:
        peft_model = generation.model
        # LoRA slots only where vLLM samples through its LoRA layers
        if sampling == SamplingMode.LORA:
            kwargs.update(lora_engine_kwargs(peft_model.peft_config[peft_model.active_adapter]))
        quantization = quantization_config_dict(getattr(peft_model.config, "quantization_config", None))
        if sampling == SamplingMode.FP8:
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
        if sharing.mode == COPY and sampling != SamplingMode.FP8:
            kwargs["dtype"] = dtype or _sixteen_bit(peft_model.dtype)
            kwargs["quantization"] = None  # TRL passes "bitsandbytes" for a 4-bit model
            if quantization is not None:
                # vLLM reads a quantized checkpoint's own quantization config when `quantization` is None
                kwargs["hf_overrides"] = {"quantization_config": None}
    if settings.vllm_standby:
        kwargs["enable_sleep_mode"] = True  # vLLM's tagged CuMem pools: the KV cache can be unmapped alone
        if config.vllm_gpu_memory_utilization == _trl_default(config, "vllm_gpu_memory_utilization"):
            fsdp = detect_strategy(config) in (Strategy.FSDP1, Strategy.FSDP2)
            kwargs["kv_cache_memory_bytes"] = kv_budget(generation, sharing, settings.vllm_kv_cache_dtype,
                                                         sampling, sharded, fsdp,
                                                         sequences_per_generation(generation, config),
                                                         states_on_host=settings.offload_optimizer_states)
    return kwargs


def sequences_per_generation(generation: Any, config: Any) -> int | None:
    """The sequences one generation hands the engine: a rank's share of TRL's `generation_batch_size` (global),
    times the ranks of its tensor-parallel group, whose prompts TRL gathers (None: not known)."""
    batch = getattr(config, "generation_batch_size", None)
    if not isinstance(batch, int) or batch < 1:
        return None
    world = max(1, int(getattr(generation.accelerator, "num_processes", 1)))
    tp = max(1, int(getattr(generation, "tensor_parallel_size", 1) or 1))
    return max(1, batch * tp // world)


def _compute_dtype(model: Any) -> torch.dtype:
    """The dtype a (possibly 4-bit) model computes in: its first floating-point parameter's."""
    return next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.bfloat16)


def _sixteen_bit(dtype: torch.dtype) -> str:
    """The engine dtype of a separate copy: the training model's, unless that is not 16-bit."""
    return "float16" if dtype == torch.float16 else "bfloat16"


def _trl_default(config: Any, name: str) -> Any:
    """The default TRL's config class declares for field `name` (a value left at it counts as not chosen)."""
    return type(config).__dataclass_fields__[name].default


def kv_budget(generation: Any, sharing: Sharing | None, kv_cache_dtype: str, sampling: str | None = None,
              sharded: bool = False, fsdp: bool = False, sequences: int | None = None, *,
              states_on_host: float = 0.0) -> int:
    """vLLM's KV cache budget for this engine (`sharded`: FSDP2's frozen shards will be vLLM's slices; `fsdp`: the
    training model is sharded by FSDP and still on the host; `sequences`: the most a generation submits to it;
    `states_on_host`: the share of the optimizer's states that waits on the host between steps)."""
    model = generation.model
    free, _, total = device_budget(generation.accelerator.device)  # within a per-process cap, if one is set
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    weight_bytes = _vllm_weight_bytes(model, sharing, sampling)
    tp = max(1, int(getattr(generation, "tensor_parallel_size", 1) or 1))
    if tp > 1 or fsdp:
        # vLLM holds 1/T of the weights; under FSDP the model reaches the device only when training starts, as
        # 1/world of its trainable state and of its frozen weights (none of those: they become vLLM's slices)
        world = max(1, int(getattr(generation.accelerator, "num_processes", 1)))
        frozen = sum(p.numel() * p.element_size() for p in model.parameters() if not p.requires_grad)
        weight_bytes = weight_bytes // tp + (0 if not fsdp or sharded else frozen // world)
        if fsdp:  # the trainable parameters themselves arrive with FSDP2, as fp32 shards
            weight_bytes += trainable * 4 // world
            trainable = -(-trainable // world)
    text = model.config.get_text_config()
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    per_token = kv_bytes_per_token(
        layers=text.num_hidden_layers, kv_heads=rank_kv_heads(kv_heads, tp),
        head_dim=head_dim, dtype_bytes=1 if KVCacheDtype(kv_cache_dtype).is_fp8 else 2,
    )
    max_num_seqs = min(generation.max_num_seqs or 256, sequences or 256)
    useful = useful_kv_cache_bytes(
        max_num_seqs=max_num_seqs,
        seq_len=expected_seq_len(max_model_length=generation.max_model_length,
                                 max_completion_length=generation.max_completion_length),
        max_model_len=generation.max_model_length or text.max_position_embeddings,
        per_token_bytes=per_token,
    )
    return auto_kv_cache_bytes(
        free_bytes=free, total_bytes=total, vllm_weight_bytes=weight_bytes,
        trainable_params=trainable, states_on_host=states_on_host,
        sampling_workspace_bytes=sampling_workspace_bytes(max_num_seqs, text.vocab_size, text.hidden_size),
        useful_bytes=useful,
    )


def _vllm_weight_bytes(model: Any, sharing: Sharing | None, sampling: str | None = None) -> int:
    """The device memory vLLM's weights will take beyond what is in use when the KV budget is computed."""
    fp8_weights = (sum(math.prod(dequantized_shape(m.weight)) for m in quantized_linear_modules(model))
                   if sampling == SamplingMode.FP8 else 0)  # the linear weights vLLM holds in fp8
    if active_adapter(model) is None:  # full fine-tuning: vLLM loads a 16-bit copy of every parameter but those
        return sum(p.numel() for p in model.parameters()) * 2 - fp8_weights * (2 - FP8_BYTES)
    if sharing is not None and sharing.mode == COPY:  # next to the training model's weights, which stay
        return copy_bytes(model)
    if sampling == SamplingMode.FP8:
        # 1 byte per linear weight, plus every frozen weight parked on the host meanwhile: the 16-bit embeddings
        # and LM head come back as vLLM's (shared), the linear weights as the training model's own
        return fp8_weights * FP8_BYTES + sum(p.numel() * p.element_size() for p in model.parameters()
                                             if not p.requires_grad)
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
        self.full_finetuning = False  # the trained parameters are vLLM's weights (no adapter to hand over)
        self.weight_copies: Any = None  # full fine-tuning: what a sync refreshes in vLLM (`WeightCopies`)
        self.before_sampling: Any = None  # sharded: puts FSDP2's modules back on their shards (`reshard_all`)
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
    if state.weight_copies is not None and state.weight_copies.released_bytes:
        metrics["vllm/released_copies_gib"] = state.weight_copies.released_bytes / _GIB
    if state.copy_bytes:
        metrics["vllm/separate_copy_gib"] = state.copy_bytes / _GIB
    return metrics
