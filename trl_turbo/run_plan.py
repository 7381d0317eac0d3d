"""ONE plan per trainer: the resolved settings, the distributed strategy, the engine plan and the memory policy.

Design decision: every decision trl_turbo makes about a run is made once, here or in the pure feature function this
module calls, and read everywhere else from the trainer's `RunPlan`. A run builds it in GRPOTrainer's constructor
(`begin` before TRL's constructor: the trainer-init checks of `trl_turbo.checks`, then the settings; the vLLM seam
adds the engine plan once the policy model is loaded; `finish` adds the strategy and the memory policy once the
trainer's device is known). `trl-turbo plan` builds the same object (`forecast`) from the facts of a model
counted on the meta device, so a forecast and a run read the same decisions. Per-step switches (`turbo_fused_loss`,
`turbo_reuse_policy_logps`, `turbo_forward_token_budget`, ...) are read through `config.Settings.of(trainer.args)`,
so a field changed on `trainer.args` after construction takes effect at the next step, as in stock TRL; the engine
and memory decisions stay those made at construction.
"""

from __future__ import annotations

import dataclasses
import weakref
from dataclasses import dataclass
from typing import Any

from .checks import check_trainer, colocated, liger_unavailable, policy_model_type
from .config import RolloutCheckMode, SamplingMode, Settings
from .distributed import CHECKPOINTING_FEATURES, Strategy, detect_strategy, unsupported_features
from .families import MODEL_TYPES
from .offload.policy import MemoryPolicy, plan_memory
from .sharding.shard_placement import unshared_adapted_weights, unshared_projection_weights
from .vllm.engine_plan import (
    EngineFacts,
    EnginePlan,
    engine_facts,
    generation_footprint,
    plan_engine,
    warn_engine_plan,
)

PLAN_ATTRIBUTE = "_trl_turbo_plan"  # set on the GRPOTrainer by `patches.trl_trainer_init`


@dataclass(frozen=True)
class RunPlan:
    settings: Settings
    strategy: Strategy
    rollout_check: RolloutCheckMode  # as set, or ERROR where the installed vLLM is only checked against its sources
    memory: MemoryPolicy
    engine: EnginePlan | None  # None: no colocated vLLM engine
    reduce_each_micro_batch: bool = False  # FSDP2 full fine-tuning: gradients reduce-scattered after every micro-batch

    def describe(self) -> dict[str, Any]:
        """The plan's decisions as plain values (what a forecast and a run are compared by)."""
        engine = self.engine
        return {
            "strategy": self.strategy.value,
            "rollout_check": self.rollout_check.value,
            "reduce_each_micro_batch": self.reduce_each_micro_batch,
            "memory": {k: (v.value if hasattr(v, "value") else v) for k, v in dataclasses.asdict(self.memory).items()},
            "engine": None if engine is None else {
                "sharing": None if engine.sharing is None else engine.sharing.mode.value,
                "copy_reasons": None if engine.sharing is None else list(engine.sharing.reasons),
                "sampling": None if engine.sampling is None else engine.sampling.value,
                "parks_while_starting": engine.parks_while_starting, "fp8_parks_base": engine.fp8_parks_base,
                "standby": engine.standby, "kv_cache_dtype": engine.kv_cache_dtype.value,
                "kv_cache_bytes": engine.kv_cache_bytes, "full_finetuning": engine.full_finetuning,
                "tp_size": engine.tp_size, "sharded": engine.sharded,
            },
        }


# ---------------------------------------------------------------------------------------------- decisions
def liger_layers_enabled(args: Any) -> bool:
    """`turbo_liger_layers` resolved: as set when True/False; None: on for a one-process CUDA run with liger-kernel
    installed (where its results were checked against stock)."""
    setting = Settings.of(args).liger_layers
    if setting is not None:
        return bool(setting)
    return liger_unavailable(args) is None and detect_strategy(args) is Strategy.SINGLE


def strategy_refusal(args: Any) -> str | None:
    """Why the run's strategy keeps transformers' checkpointing (ZeRO-3, FSDP: parameters are whole only inside
    their module's call, where trl_turbo's checkpoint function and tiled MLP cannot reach them); None: it does not."""
    unsupported = unsupported_features(args, list(CHECKPOINTING_FEATURES))
    return next(iter(unsupported.values()), None)


def rollout_check(settings: Settings, *, installed: bool = True) -> RolloutCheckMode:
    """The rollout alarm's mode: a warning becomes an error on a vLLM that is checked against its sources but not
    GPU-verified (a silent mismatch there would otherwise go unnoticed), where the engine features are on
    (`installed=False`, a forecast for another machine: as set)."""
    engine_features = settings.vllm_shared_weights or settings.vllm_standby or settings.vllm_kv_cache_dtype.is_fp8
    if settings.rollout_check is not RolloutCheckMode.WARN or not engine_features or not installed:
        return settings.rollout_check
    from .vllm_contract import installed_verdict

    if installed_verdict().notice is not None:  # None also where no vLLM is installed
        return RolloutCheckMode.ERROR
    return settings.rollout_check


# ------------------------------------------------------------------------------------------------ the run
@dataclass
class PlanInProgress:
    """The plan while GRPOTrainer's constructor runs (visible to the seams of what TRL builds inside it)."""

    config: Any
    settings: Settings
    engine: EnginePlan | None = None
    reduce_each_micro_batch: bool = False  # `reduces_gradients_each_micro_batch`


def begin(trainer_cls: type, config: Any, model: Any, peft_config: Any,
          quantization_config: Any = None) -> PlanInProgress:
    """Before TRL's constructor, from GRPOTrainer's arguments (`config`: the GRPOConfig, or None for TRL's default
    one): the trainer-init checks (`checks.check_trainer`) refuse what no engine or loss can serve, then the plan
    starts from the settings."""
    check_trainer(trainer_cls, config, model, peft_config, quantization_config)
    if config is not None and every_parameter_trains_each_step(config, model, peft_config):
        # DDP then needs no search for unused parameters after each backward (transformers turns it on for a PEFT
        # model, whatever its adapter); read by the Trainer's constructor when it builds the accelerator
        config.ddp_find_unused_parameters = False
    reduce_each = config is not None and reduces_gradients_each_micro_batch(config, model, peft_config)
    return PlanInProgress(config, Settings.of(config), reduce_each_micro_batch=reduce_each)


def reduces_gradients_each_micro_batch(config: Any, model: Any, peft_config: Any) -> bool:
    """Whether an FSDP2 run reduce-scatters its gradients after every micro-batch: full fine-tuning (no adapter)
    with gradient accumulation, where the user left accelerate's `sync_each_batch` unset. Under `no_sync` FSDP2
    keeps every trained parameter's whole, unsharded 16-bit gradient until the last micro-batch (2 bytes per
    parameter on every GPU, the largest part of a full fine-tuning's transient memory) and accumulates it in 16 bits;
    reduced each micro-batch, each GPU keeps only its shard, accumulated in the sharded gradient's own dtype (fp32
    under accelerate's mixed precision), at the cost of one reduce-scatter per micro-batch, overlapped with the
    backward."""
    if detect_strategy(config) is not Strategy.FSDP2 or int(getattr(config, "gradient_accumulation_steps", 1)) < 2:
        return False
    if peft_config is not None or getattr(model, "peft_config", None):
        return False
    accelerator_config = getattr(config, "accelerator_config", None)
    kwargs = getattr(accelerator_config, "gradient_accumulation_kwargs", None) or {}
    return accelerator_config is not None and not isinstance(accelerator_config, dict | str) and \
        "sync_each_batch" not in kwargs


def every_parameter_trains_each_step(config: Any, model: Any, peft_config: Any) -> bool:
    """Whether DDP may skip its search for unused parameters: a DDP run that leaves `ddp_find_unused_parameters`
    unset, training a LoRA adapter on the linear layers of a dense decoder family of `families` (every layer, and so
    every adapter, runs in every forward), with no trained module copies and no adapted embeddings or LM head."""
    if getattr(config, "ddp_find_unused_parameters", None) is not None or detect_strategy(config) is not Strategy.DDP:
        return False
    adapter = peft_config if peft_config is not None else getattr(model, "peft_config", {}).get("default")
    if type(adapter).__name__ != "LoraConfig" or getattr(adapter, "modules_to_save", None):
        return False
    targets = adapter.target_modules
    targets = [targets] if isinstance(targets, str) else list(targets or ())
    if any(key in target for target in targets for key in ("embed", "lm_head", "wte")):
        return False
    return policy_model_type(model, config) in MODEL_TYPES


def finish(progress: PlanInProgress, trainer: Any) -> RunPlan:
    """After TRL's constructor: the memory policy from the trainer's device and engine, and the whole plan."""
    args = trainer.args  # TRL's default config where none was passed
    settings = progress.settings if progress.config is not None else Settings.of(args)
    device = getattr(getattr(trainer, "accelerator", None), "device", None)
    has_engine = getattr(trainer, "vllm_generation", None) is not None
    if progress.reduce_each_micro_batch:
        # what the Trainer's loop reads on every micro-batch (set on the accelerator it built, not in the user's
        # config: transformers writes into that dict, and a config may build more than one trainer)
        trainer.accelerator.gradient_state.plugin_kwargs["sync_each_batch"] = True
    plan = _plan(args, settings, progress.engine if has_engine else None,
                 cuda_device=getattr(device, "type", None) == "cuda", liger_enabled=liger_layers_enabled(args))
    return dataclasses.replace(plan, reduce_each_micro_batch=progress.reduce_each_micro_batch)


def plan_engine_for(config: Any, generation: Any) -> EnginePlan:
    """The plan of the engine TRL builds (a `VLLMGeneration`) for the trainer of `config` (None: TRL's default config),
    from the loaded policy model; the run's warnings about it are given here."""
    settings = Settings.of(config)
    colocate = generation.mode == "colocate"
    facts = engine_facts(generation.model) if colocate and settings.vllm_shared_weights else None
    fsdp2 = config is not None and detect_strategy(config) is Strategy.FSDP2
    tp_size = getattr(generation, "tensor_parallel_size", 1)
    sharded = fsdp2 and facts is not None
    unshared = unshared_adapted_weights(generation.model, tp_size) if sharded else []
    projections = (unshared_projection_weights(generation.model, tp_size)
                   if sharded and settings.vllm_sampling is SamplingMode.FP8 else [])
    plan = plan_engine(settings, facts, colocate=colocate, tp_size=tp_size, fsdp2=fsdp2, unshared_adapted=unshared,
                       unshared_projections=projections)
    warn_engine_plan(plan, settings)
    return plan


def footprint_of(trainer: Any):
    """The ceiling function of a standby engine: the device memory its last generation used (None once gone)."""
    generation_ref = weakref.ref(trainer.vllm_generation)
    return lambda: generation_footprint(generation_ref())


def of(trainer: Any) -> RunPlan:
    """The trainer's plan. Its settings follow `trainer.args` (a field changed after construction takes effect, as
    the per-step switches read it); the engine and memory decisions stay those made at construction. A trainer
    constructed without trl_turbo's constructor gets one from its config alone (no engine plan, no device)."""
    plan = trainer.__dict__.get(PLAN_ATTRIBUTE) if hasattr(trainer, "__dict__") else None
    settings = Settings.of(trainer.args)
    if plan is None:
        return _plan(trainer.args, settings, None, cuda_device=False, liger_enabled=False)
    if settings != plan.settings:
        return dataclasses.replace(plan, settings=settings, rollout_check=rollout_check(settings))
    return plan


def _plan(args: Any, settings: Settings, engine: EnginePlan | None, *, cuda_device: bool,
          liger_enabled: bool, installed: bool = True) -> RunPlan:
    memory = plan_memory(
        settings, gradient_checkpointing=bool(getattr(args, "gradient_checkpointing", True)),
        strategy_refusal=strategy_refusal(args), cuda_device=cuda_device, liger_enabled=liger_enabled,
        standby_engine=engine is not None and engine.standby)
    return RunPlan(settings, detect_strategy(args), rollout_check(settings, installed=installed), memory, engine)


# ------------------------------------------------------------------------------------------------ forecast
def forecast(args: Any, *, engine_facts: EngineFacts | None, cuda_device: bool = True,
             liger_enabled: bool = False) -> RunPlan:
    """The plan of the run `args` describes, from facts instead of a loaded model and a trainer (`trl-turbo plan`;
    `engine_facts`: the policy model's, needed with shared weights; judged by the installed vLLM as the facts say).
    Liger's layers are not forecast."""
    settings = Settings.of(args)
    engine = plan_engine(settings, engine_facts, tp_size=int(getattr(args, "vllm_tensor_parallel_size", 1) or 1),
                         fsdp2=detect_strategy(args) is Strategy.FSDP2) if colocated(args) else None
    installed = engine_facts.installed_vllm if engine_facts is not None else True
    return _plan(args, settings, engine, cuda_device=cuda_device, liger_enabled=liger_enabled, installed=installed)
