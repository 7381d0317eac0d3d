"""A GRPO run's device and host memory per phase (start-up, generation, training), for stock TRL and trl_turbo.

Design decision: the forecast composes the pieces the run itself uses: the training phase from `planning.training`
(the memory planner's own rules), vLLM's KV cache from `vllm.kv_budget` (the automatic budget trl_turbo passes to
vLLM) or from TRL's `vllm_gpu_memory_utilization`, and the weights from the model counted on the meta device. It
reads the same GRPOConfig the run reads, so "what would this config do on that GPU" has one answer per field.
What it does not model: vLLM's CUDA graphs and compile caches (outside torch's allocator), other processes on the
device, and DeepSpeed/FSDP sharding (one process, one device).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from ..config import MemoryPlanMode, SamplingMode, Settings
from ..distributed import Strategy, detect_strategy
from ..offload.memory_plan import gathered_bytes, head_weight_gradient_bytes, sharded_reserve_bytes
from ..run_plan import RunPlan
from ..run_plan import forecast as forecast_plan
from ..vllm.engine_plan import EngineFacts
from ..vllm.kv_budget import (
    auto_kv_cache_bytes,
    expected_seq_len,
    kv_bytes_per_token,
    rank_kv_heads,
    sampling_workspace_bytes,
    useful_kv_cache_bytes,
)
from .model_spec import ModelSpec
from .training import CONTEXT_BYTES, MicroBatch, TrainingForecast, forecast_training, token_groups

# Adam's two fp32 moments per trainable parameter (the gradients are part of the training phase).
OPTIMIZER_BYTES_PER_PARAM = 8
# Device memory vLLM's profiling run keeps out of its KV pool (one scheduler step's activations and what it holds
# per layer), by decoder depth: TRL's 0.3 share of the device less vLLM's weight and KV pools was 1.18-1.27 GiB at
# 32 layers (Llama-3.1-8B, tensor-parallel 1 and 2) and 1.89 GiB at 64 (Qwen2.5-32B, tensor-parallel 2; H200s).
VLLM_PROFILE_BASE_BYTES = int(0.51 * 2**30)
VLLM_PROFILE_BYTES_PER_LAYER = int(21.5 * 2**20)


def vllm_profile_bytes(layers: int) -> int:
    return VLLM_PROFILE_BASE_BYTES + layers * VLLM_PROFILE_BYTES_PER_LAYER

# An engine that samples from bitsandbytes 4-bit weights keeps about this many times one scheduler step's
# workspace (`vllm.kv_budget.sampling_workspace_bytes`: hidden states and logits) more, outside its KV pool
# (dequantized weight tiles, LoRA kernels' buffers): measured 1.52 GiB with Llama-3.1-8B and 0.58 GiB with Qwen2.5-1.5B,
# NF4, shared weights, H200 (e2e-llama-3.1-8b-nf4-cap15gib-20261125-162430,
# e2e-qwen2.5-1.5b-nf4-cap5gib-20261125-163213).
FOUR_BIT_ENGINE_WORKSPACES = 1.5
FP8_BYTES_PER_WEIGHT = 1
COMPLETION_STEP = 256


@dataclass(frozen=True)
class Phase:
    name: str
    device_bytes: int
    host_bytes: int
    parts: dict[str, int] = field(default_factory=dict)  # what the device bytes are made of


@dataclass(frozen=True)
class RunForecast:
    variant: str  # "turbo" or "stock"
    capacity_bytes: int
    host_capacity_bytes: int | None
    completion_tokens: int
    prompt_tokens: int
    phases: tuple[Phase, ...]
    training: TrainingForecast
    error: str | None = None  # why the run cannot start (vLLM's KV cache does not fit)
    plan: RunPlan | None = None  # trl_turbo's decisions (None: stock TRL)
    cast_copy: bool = False  # full fine-tuning over fp32 masters: vLLM's own 16-bit copy, cast into at each sync

    @property
    def peak_bytes(self) -> int:
        """The process's peak as the driver counts it: the largest phase plus the CUDA context."""
        return max(phase.device_bytes for phase in self.phases) + CONTEXT_BYTES

    @property
    def fits(self) -> bool:
        host_ok = self.host_capacity_bytes is None or all(p.host_bytes <= self.host_capacity_bytes for p in self.phases)
        return self.error is None and self.peak_bytes <= self.capacity_bytes and host_ok


def quantization_of(quantized_4bit: bool, nested_4bit: bool) -> dict[str, Any] | None:
    """The bitsandbytes config `trl grpo --load_in_4bit` builds (None: 16-bit weights)."""
    if not quantized_4bit:
        return None
    return {"quant_method": "bitsandbytes", "load_in_4bit": True, "bnb_4bit_quant_type": "nf4",
            "bnb_4bit_use_double_quant": nested_4bit, "bnb_4bit_quant_storage": "uint8"}


def spec_engine_facts(spec: ModelSpec, *, quantized_4bit: bool, nested_4bit: bool,
                      host_capacity_bytes: int | None, processes_on_host: int = 1) -> EngineFacts:
    """What the engine's plan reads of the policy model, from its counted config instead of a loaded model (an
    unknown host counts as large enough)."""
    return EngineFacts(
        model_type=spec.model_type, quantization=quantization_of(quantized_4bit, nested_4bit),
        four_bit=quantized_4bit, layout_problems=(), merge_problems=(),
        adapted_weight_bytes=2 * spec.adapted_parameters, has_adapter=bool(spec.lora_parameters),
        linear_weight_bytes=0 if quantized_4bit else 2 * spec.layer_linear_parameters,
        processes_on_host=processes_on_host,
        host_bytes=host_capacity_bytes if host_capacity_bytes is not None else 2**62,
        installed_vllm=False)


def run_plan_of(args: Any, spec: ModelSpec, *, quantized_4bit: bool = False, nested_4bit: bool = True,
                host_capacity_bytes: int | None = None) -> RunPlan:
    """The run plan of `args` (a GRPOConfig's fields) for the model `spec` counts, as a trainer on a CUDA device
    would resolve it; refused as the trainer would refuse it."""
    if quantized_4bit and not spec.lora_parameters:
        raise ValueError("full fine-tuning of 4-bit weights: transformers' Trainer refuses to train a purely "
                         "quantized model; add a LoRA adapter (`use_peft: true`) or load the model in 16 bits.")
    facts = spec_engine_facts(spec, quantized_4bit=quantized_4bit, nested_4bit=nested_4bit,
                              host_capacity_bytes=host_capacity_bytes,
                              processes_on_host=getattr(args, "world_size", 1))  # the forecast is of one node
    return forecast_plan(args, engine_facts=facts)


def _trl_default(name: str) -> Any:
    from trl import GRPOConfig

    return GRPOConfig.__dataclass_fields__[name].default


def _field(args: Any, name: str) -> Any:
    """A TRL field of `args`, or TRL's default where `args` (a partial namespace) lacks it."""
    return getattr(args, name, _trl_default(name))


@dataclass(frozen=True)
class _EngineMemory:
    weights: int  # beyond what the trainer holds (fp8 copy, vLLM's fp32 block scales, or a separate copy)
    kv_cache: int
    workspace: int
    error: str | None = None

    @property
    def total(self) -> int:
        return self.weights + self.kv_cache + self.workspace


def _engine_memory(args: Any, spec: ModelSpec, engine_plan: Any, *, capacity_bytes: int, static_bytes: int,
                   trainable: int, quantized_4bit: bool, nested_4bit: bool, completion: int,
                   max_num_seqs: int, tp_size: int = 1, own_copy: bool = False) -> _EngineMemory:
    """The colocated engine's device memory on one GPU: its weights beyond the trainer's (a 1/`tp_size` slice under
    tensor parallelism; `own_copy`: its own 16-bit copy even with shared weights, as over fp32 masters), its KV
    cache (the automatic budget with shared weights or standby at TRL's default utilization, else TRL's share of the
    device; the rank's KV heads), its workspace."""
    shared = engine_plan is not None and engine_plan.shares_weights and not own_copy
    fp8 = shared and engine_plan.sampling is SamplingMode.FP8
    step_workspace = sampling_workspace_bytes(max_num_seqs, spec.vocab_size, spec.hidden_size)
    workspace = vllm_profile_bytes(spec.layers)
    if quantized_4bit and not fp8:  # vLLM samples from the 4-bit weights (its own copy, or shared)
        workspace += int(FOUR_BIT_ENGINE_WORKSPACES * step_workspace)
    if shared:
        # fp8 sampling: an e4m3 copy of the linear weights beside the 16-bit ones (an upper bound: the base may be
        # parked on the host while the copy samples, which this forecast does not count on)
        weights = (FP8_BYTES_PER_WEIGHT * spec.layer_linear_parameters // tp_size) if fp8 else 0
        if quantized_4bit and nested_4bit and not fp8:  # fp32 scales beside the shared packed bytes
            weights += spec.vllm_undone_scale_bytes()
    else:  # vLLM's own copy, its 4-bit block scales in fp32
        weights = spec.weight_bytes(quantized_4bit, nested_4bit=False) // tp_size
        if own_copy and engine_plan.sampling is SamplingMode.FP8:  # over fp32 masters: its linear weights in fp8
            weights -= (2 - FP8_BYTES_PER_WEIGHT) * spec.layer_linear_parameters // tp_size
    utilization = _field(args, "vllm_gpu_memory_utilization")
    standby = engine_plan is not None and engine_plan.standby
    budgeted = engine_plan is not None and (engine_plan.shares_weights or standby)  # trl_turbo sizes the KV cache
    # full fine-tuning with shared weights: vLLM starts on a 16-bit copy of its own (with fp8 sampling, of all but
    # the fp8 linear weights, counted above), which its budget leaves room for
    start_copy = 0
    if shared and engine_plan.full_finetuning:
        start_copy = spec.weight_bytes(quantized_4bit, nested_4bit=False) // tp_size
        if fp8:
            start_copy -= 2 * spec.layer_linear_parameters // tp_size
    sized_by_trl = not (budgeted and utilization == _trl_default("vllm_gpu_memory_utilization"))
    if sized_by_trl:
        kv_cache = max(0, int(utilization * capacity_bytes) - weights - workspace)
        error = None if kv_cache else (f"vllm_gpu_memory_utilization={utilization} leaves vLLM no KV cache next to "
                                       f"its {weights / 2**30:.1f} GiB of weights")
        return _EngineMemory(weights, kv_cache, workspace, error)
    per_token = kv_bytes_per_token(layers=spec.layers, kv_heads=rank_kv_heads(spec.key_value_heads, tp_size),
                                   head_dim=spec.head_dim, dtype_bytes=1 if engine_plan.kv_cache_dtype.is_fp8 else 2)
    max_model_len = _field(args, "vllm_max_model_length")
    useful = useful_kv_cache_bytes(
        max_num_seqs=max_num_seqs,
        seq_len=expected_seq_len(max_model_length=max_model_len, max_completion_length=completion),
        max_model_len=max_model_len or spec.max_position_embeddings, per_token_bytes=per_token)
    try:
        kv_cache = auto_kv_cache_bytes(
            free_bytes=capacity_bytes - CONTEXT_BYTES - static_bytes, total_bytes=capacity_bytes,
            vllm_weight_bytes=weights + start_copy, trainable_params=trainable, sampling_workspace_bytes=step_workspace,
            useful_bytes=useful, states_on_host=Settings.of(args).offload_optimizer_states)
    except ValueError as exc:
        return _EngineMemory(weights, 0, workspace, str(exc))
    return _EngineMemory(weights, kv_cache, workspace)


def gathered_model_bytes(spec: ModelSpec, quantized_4bit: bool = False, nested_4bit: bool = True) -> int:
    """The whole model as FSDP2 gathers it (`memory_plan.gathered_bytes`): its weights as stored (16-bit, or packed
    4-bit) and its fp32 adapter in 16 bits, what the live planner counts over the sharded model's parameters."""
    return spec.weight_bytes(quantized_4bit, nested_4bit) + gathered_bytes(spec.lora_parameters, 4)


def forecast_run(args: Any, spec: ModelSpec, *, capacity_bytes: int, host_capacity_bytes: int | None = None,
                 quantized_4bit: bool = False, nested_4bit: bool = True, prompt_tokens: int = 256,
                 completion_tokens: int | None = None, stock: bool = False) -> RunForecast:
    """The run `args` (a GRPOConfig) describes, on one device of `capacity_bytes`; `stock=True`: as stock TRL would
    run it (every trl_turbo field off). `nested_4bit`: 4-bit block scales double-quantized. trl_turbo's decisions
    come from the run plan (`run_plan_of`)."""
    plan = None if stock else run_plan_of(args, spec, quantized_4bit=quantized_4bit, nested_4bit=nested_4bit,
                                          host_capacity_bytes=host_capacity_bytes)
    engine_plan = plan.engine if plan is not None else None
    completion = completion_tokens or args.max_completion_length
    weights = spec.weight_bytes(quantized_4bit, nested_4bit)
    adapter = 4 * spec.lora_parameters
    trainable = spec.lora_parameters or spec.parameters
    shared = engine_plan is not None and engine_plan.shares_weights
    processes, tp = fsdp2_layout(args)
    # full fine-tuning trains every weight in its stored dtype (16 bits), except under FSDP2 with mixed precision,
    # where accelerate keeps fp32 masters: vLLM then holds a 16-bit copy of its own, cast into at each sync
    full = not spec.lora_parameters
    master_bytes = 4 if full and detect_strategy(args) is Strategy.FSDP2 and _mixed_precision(args) else 2
    vllm_copy = (full and master_bytes == 4 and engine_plan is not None and engine_plan.full_finetuning
                 and engine_plan.shares_weights)
    if full:
        weights = master_bytes * spec.parameters
    # FSDP2 over `processes` GPUs: each holds 1/shards of the weights and the training state, its shard group being
    # every process, or with shared weights its vLLM tensor-parallel group (HSDP when there are more processes, each
    # shard then a vLLM slice); one layer is gathered whole at a time
    gathered = sharded_reserve = 0
    if processes > 1:
        shards = tp if shared else processes
        root = 2 * spec.root_parameters  # 16-bit whatever the layers' quantization
        layer_bytes = (spec.weight_bytes(quantized_4bit, nested_4bit) - root) // max(1, spec.layers)
        whole = gathered_model_bytes(spec, quantized_4bit, nested_4bit)
        sharded_reserve = sharded_reserve_bytes(whole, spec.layers) if shards > 1 else 0
        weights //= shards
        adapter, trainable = adapter // shards, -(-trainable // shards)
        # the layer computing and the one prefetched, and the root's parameters (embedding, LM head, final norm),
        # which FSDP2 gathers at the root's forward and keeps whole until its backward ends: each gathered tensor is
        # whole beside the rank's shard
        gathered = 2 * layer_bytes + root if shards > 1 else 0
    # Adam's two moments in the trained parameters' dtype (fp32 for adapters and masters); on the host when offloaded
    optimizer = (OPTIMIZER_BYTES_PER_PARAM if not full else 2 * master_bytes) * trainable
    host_optimizer = 0
    if full and plan is not None and plan.memory.optimizer_states_offload:
        # every weight's states are far over `MIN_STATE_BYTES` (an adapter's stay on the device: too small to move);
        # a share moves that share of the parameters' bytes
        host_optimizer = round(plan.memory.optimizer_states_offload * optimizer)
        optimizer -= host_optimizer
    gradients = master_bytes * trainable if full else 0  # an adapter's are part of the training forecast
    static = weights + adapter
    standby = engine_plan is not None and engine_plan.standby
    error = None
    phases: list[Phase] = []
    engine_training = host_engine = 0
    if bool(_field(args, "use_vllm")) and _field(args, "vllm_mode") == "colocate":
        # one generation: the rank's prompts and those of the other ranks of its tensor-parallel group
        max_num_seqs = args.per_device_train_batch_size * (_field(args, "steps_per_generation") or 1) * tp or 256
        engine = _engine_memory(args, spec, engine_plan, capacity_bytes=capacity_bytes, static_bytes=static,
                                trainable=trainable, quantized_4bit=quantized_4bit, nested_4bit=nested_4bit,
                                completion=completion, max_num_seqs=min(max_num_seqs, 256), tp_size=tp,
                                own_copy=vllm_copy)
        error = engine.error
        parts = {"weights": weights, "adapter": adapter, "vLLM weights": engine.weights, "KV cache": engine.kv_cache,
                 "vLLM workspace": engine.workspace}
        phases.append(Phase("start-up", static + engine.total, 0, parts))
        # merged sampling's host copy of the adapted weights: of the rank's slices under tensor parallelism
        merged_host = 2 * spec.adapted_parameters // tp if shared and engine_plan.sampling is SamplingMode.MERGED else 0
        phases.append(Phase("generation", static + optimizer + engine.total, merged_host + host_optimizer,
                            {**parts, "optimizer": optimizer}))
        if standby:  # the KV cache is released, and with it what the sync rewrites whole (fp8, cast copies)
            released = vllm_copy or (shared and engine_plan.sampling is SamplingMode.FP8)
            engine_training = 0 if released else engine.weights
        elif _field(args, "vllm_enable_sleep_mode"):
            host_engine = engine.weights  # level-1 sleep: weights to host, KV cache dropped
        else:
            engine_training = engine.total
    training = _training_phase(args, spec, plan, completion=completion, prompt_tokens=prompt_tokens,
                               capacity_bytes=capacity_bytes,
                               static_bytes=static + optimizer + gradients + engine_training + gathered,
                               quantized_4bit=quantized_4bit,
                               generation_bytes=phases[-1].device_bytes if standby and phases else None,
                               sharded_reserve=sharded_reserve,
                               head_gradient_bytes=head_weight_gradient_bytes(spec.vocab_size, spec.hidden_size)
                               if full else 0)
    phases.append(Phase("training", training.peak_bytes, training.host_bytes + host_engine + host_optimizer,
                        {"weights": weights, "adapter": adapter, "optimizer": optimizer,
                         **({"gradients": gradients} if gradients else {}),
                         "vLLM resident": engine_training, **({"gathered weights": gathered} if gathered else {}),
                         "activations": training.peak_bytes - static - optimizer - gradients - engine_training
                         - gathered}))
    return RunForecast("stock" if stock else "turbo", capacity_bytes, host_capacity_bytes, completion,
                       prompt_tokens, tuple(phases), training, error, plan, cast_copy=vllm_copy and not stock)


def _mixed_precision(args: Any) -> bool:
    """Whether the run trains under bf16 or fp16 mixed precision (accelerate then keeps fp32 FSDP2 masters); TRL's
    unset `bf16` means bf16 unless fp16 is asked for."""
    bf16 = _field(args, "bf16")
    return bool(_field(args, "fp16")) or bf16 is None or bool(bf16)


def fsdp2_layout(args: Any) -> tuple[int, int]:
    """(processes FSDP2 shards the training state over, vLLM's tensor-parallel size) of the run `args` describes;
    (1, T) for a run without FSDP2 (each process holds whole weights)."""
    tp = int(_field(args, "vllm_tensor_parallel_size") or 1)
    if detect_strategy(args) is not Strategy.FSDP2:
        return 1, tp
    return max(1, int(getattr(args, "world_size", 1) or 1)), tp


def _training_phase(args: Any, spec: ModelSpec, plan: RunPlan | None, *, completion: int, prompt_tokens: int,
                    capacity_bytes: int, static_bytes: int, quantized_4bit: bool,
                    generation_bytes: int | None, sharded_reserve: int = 0,
                    head_gradient_bytes: int = 0) -> TrainingForecast:
    """The training phase under the plan's memory policy (stock: `plan` None), its ceiling the user's
    `turbo_training_memory_gib`, else in standby the generation's footprint as the device counts it (the run reads
    it device-wide, its context included)."""
    if plan is not None and plan.memory.ceiling_gib is not None:
        ceiling = int(plan.memory.ceiling_gib * 2**30)
    else:
        ceiling = generation_bytes + CONTEXT_BYTES if generation_bytes is not None else None
    batch = MicroBatch(args.per_device_train_batch_size, prompt_tokens + completion)
    if plan is not None and not plan.memory.checkpointing:
        # trl_turbo's checkpointing is off in this run (the plan says why): transformers' checkpointing (or none)
        # trains each of the micro-batch's sequence groups, as for stock TRL but one group at a time
        rows, groups = token_groups(batch, plan.memory.forward_token_budget)
        group = forecast_training(
            spec, MicroBatch(rows, batch.sequence_tokens), mode=MemoryPlanMode.OFF, capacity_bytes=capacity_bytes,
            static_bytes=static_bytes, quantized_4bit=quantized_4bit,
            gradient_checkpointing=bool(_field(args, "gradient_checkpointing")),
            head_gradient_bytes=head_gradient_bytes)
        return replace(group, group_sequences=rows, groups=groups)
    return forecast_training(
        spec, batch,
        mode=MemoryPlanMode.OFF if plan is None else plan.memory.mode, capacity_bytes=capacity_bytes,
        static_bytes=static_bytes, quantized_4bit=quantized_4bit,
        forward_token_budget=plan.memory.forward_token_budget if plan is not None else None,
        tiled_mlp_tokens=plan.memory.tiled_mlp_tokens if plan is not None else None,
        gradient_checkpointing=bool(_field(args, "gradient_checkpointing")), ceiling_bytes=ceiling,
        sharded_reserve=sharded_reserve, head_gradient_bytes=head_gradient_bytes)


def longest_completion(args: Any, spec: ModelSpec, *, capacity_bytes: int, host_capacity_bytes: int | None = None,
                       quantized_4bit: bool = False, nested_4bit: bool = True, prompt_tokens: int = 256,
                       stock: bool = False) -> int | None:
    """The longest completion (a multiple of 256 tokens, within the model's context) whose run fits; for "auto",
    judged by its most frugal plan, to which it falls back."""
    frugal = args
    if not stock and Settings.of(args).memory_plan is MemoryPlanMode.AUTO:
        frugal = Override(args, turbo_memory_plan="min")

    def fits(tokens: int) -> bool:
        return forecast_run(frugal, spec, capacity_bytes=capacity_bytes, host_capacity_bytes=host_capacity_bytes,
                            quantized_4bit=quantized_4bit, nested_4bit=nested_4bit, prompt_tokens=prompt_tokens,
                            completion_tokens=tokens,
                            stock=stock).fits

    limit = max(COMPLETION_STEP, (spec.max_position_embeddings or 131072) - prompt_tokens) // COMPLETION_STEP
    if not fits(COMPLETION_STEP):
        return None
    low, high = 1, limit  # fits(low * step) holds
    while low < high:
        middle = (low + high + 1) // 2
        if fits(middle * COMPLETION_STEP):
            low = middle
        else:
            high = middle - 1
    return low * COMPLETION_STEP


class Override:
    """`args` with some fields replaced (a GRPOConfig is not copied: its __post_init__ validates and warns)."""

    def __init__(self, args: Any, **fields: Any) -> None:
        self._args, self._fields = args, fields

    def __getattr__(self, name: str) -> Any:
        return self._fields[name] if name in self._fields else getattr(self._args, name)
