"""Every refusal of a trl_turbo run, in two phases, before any model loads.

Design decision: a bad setting fails before a model loads, with a message that names the fix, and no check changes
what it checks. `check_config` is the config-time phase (GRPOConfig's `__post_init__`, `trl-turbo plan`): the fields,
their combinations, the distributed strategy read from the launcher's environment and the installed library
versions, pure of any model. `check_trainer` is the trainer-init phase (GRPOTrainer's constructor, before TRL loads
the model): the trainer class that will compute the loss, the model argument, the LoRA config, the quantization and
the device. Decisions that follow from valid settings (which engine mode, which memory features) are not made here:
`trl_turbo.run_plan` makes them once per trainer.
"""

from __future__ import annotations

import functools
import math
import warnings
from typing import Any

import torch

from . import versions
from .config import (
    LOSS_TYPE_SETTINGS,
    MemoryPlanMode,
    SamplingMode,
    Settings,
    _changed,
    check_loss_type_known,
    turbo_loss_settings,
)
from .distributed import (
    CHECKPOINTING_FEATURES,
    Strategy,
    detect_strategy,
    fsdp_offloads_params,
    local_process_count,
    unsupported_features,
)
from .losses import PRODUCT_IS_MODES, TURBO_IS_MODES, validate_loss_options
from .offload import expandable_segments
from .vllm.adapter import adapter_problems
from .vllm.quantized import compute_dtype_warning, quantization_config_dict
from .vllm.sharing import copy_reasons, fallback_warning


# ------------------------------------------------------------------------------------------------ config time
def check_config(args: Any, installed: bool = True) -> None:
    """Raise ValueError for unknown or conflicting trl_turbo settings of `args` (a GRPOConfig after TRL's own
    `__post_init__`, or a namespace with its fields). `installed=False`: skip the checks of this machine's library
    versions (`trl-turbo plan` judges a config for another machine)."""
    settings = Settings.of(args)
    if settings.liger_layers:
        reason = liger_unavailable(args)
        if reason is not None:
            raise ValueError(reason)
    _check_sizes(args, settings)
    _check_allocator(args, settings)
    _check_memory_features_strategy(args, settings)
    _check_optimizer_states(args, settings)
    _check_vllm(args, settings, installed)
    _check_loss(args, settings)


def _check_sizes(args: Any, settings: Settings) -> None:
    if settings.logprob_chunk_tokens is not None and settings.logprob_chunk_tokens < 1:
        raise ValueError(
            f"`turbo_logprob_chunk_tokens` must be a positive number of tokens or None, "
            f"got {settings.logprob_chunk_tokens}."
        )
    if settings.tiled_mlp_tokens < 1:
        raise ValueError(f"`turbo_tiled_mlp_tokens` must be a positive number, got {settings.tiled_mlp_tokens}.")
    if settings.forward_token_budget is not None and settings.forward_token_budget < 1:
        raise ValueError(
            f"`turbo_forward_token_budget` must be a positive number of tokens or None, got "
            f"{settings.forward_token_budget}."
        )
    training_memory = settings.training_memory_gib
    if training_memory is not None:
        if not (math.isfinite(training_memory) and training_memory > 0):
            raise ValueError(f"`turbo_training_memory_gib` must be a finite number of GiB > 0 or None, got "
                             f"{training_memory}.")
        if settings.memory_plan is not MemoryPlanMode.AUTO or not args.gradient_checkpointing:
            setting = (f"`turbo_memory_plan={settings.memory_plan.value!r}`"
                       if settings.memory_plan is not MemoryPlanMode.AUTO else "`gradient_checkpointing=False`")
            raise ValueError(f"`turbo_training_memory_gib` sizes the automatic memory plan; with {setting} nothing "
                             "reads it. Set `turbo_memory_plan='auto'` with `gradient_checkpointing=True`, or remove "
                             "`turbo_training_memory_gib`.")
    budget = settings.offload_host_budget_gib
    if budget is not None and not (math.isfinite(budget) and budget >= 0):
        raise ValueError(f"`turbo_offload_host_budget_gib` must be a finite number of GiB >= 0 or None, got {budget}.")


def colocated(args: Any) -> bool:
    """Whether `args` run a colocated vLLM engine (TRL's `use_vllm` with `vllm_mode='colocate'`)."""
    return bool(getattr(args, "use_vllm", False)) and getattr(args, "vllm_mode", "colocate") == "colocate"


def _check_allocator(args: Any, settings: Settings) -> None:
    if not settings.expandable_segments:
        return
    if expandable_segments.configured() is False:
        name, conf = expandable_segments.settings_in_force()
        raise ValueError(f"`turbo_expandable_segments=True`, but {name}={conf!r} turns expandable segments off: drop "
                         "one of them.")
    sleeps = settings.vllm_standby or getattr(args, "vllm_enable_sleep_mode", False)
    if colocated(args) and sleeps:
        from .vllm_contract import EXPANDABLE_SEGMENTS, installed_verdict

        engine = installed_verdict()
        lost = engine.why_unavailable(EXPANDABLE_SEGMENTS) if engine.error is None else None
        if lost is not None:
            raise ValueError(f"`turbo_expandable_segments=True` cannot run beside this vLLM's sleep-mode memory pool: "
                             f"{lost}. Set it to False, or install a vLLM that keeps it (`pip install "
                             "'trl-turbo[vllm]'`).")


def _check_loss(args: Any, settings: Settings) -> None:
    if settings.fused_loss and type(args).__name__ == "GRPOConfig":
        check_loss_type_known(args.loss_type)
    _check_vespo_is_mode(args)
    turbo_only = turbo_loss_settings(args)
    if turbo_only and not settings.fused_loss:
        raise ValueError(
            f"{' and '.join(turbo_only)}: only trl_turbo's loss implements this (stock TRL does not know it), and "
            "`turbo_fused_loss=False` switches that loss off. Set `turbo_fused_loss=True`, or remove these settings "
            "and use TRL's values."
        )
    if (
        args.vllm_importance_sampling_mode in TURBO_IS_MODES
        and args.use_vllm
        and args.vllm_importance_sampling_correction
        and not settings.reuse_policy_logps
    ):
        raise ValueError(
            f"`vllm_importance_sampling_mode={args.vllm_importance_sampling_mode!r}` is computed inside trl_turbo's "
            "loss, from the old-policy log-probs where TRL computes them (num_iterations > 1 or generation "
            "misaligned with optimizer steps) and from the training forward otherwise, so it needs "
            "`turbo_reuse_policy_logps=True`."
        )
    if settings.fused_loss:
        validate_loss_options(args)
        _check_loss_type_settings(args)


def _check_loss_type_settings(args: Any) -> None:
    inert = [name for name, loss_types in LOSS_TYPE_SETTINGS.items()
             if args.loss_type not in loss_types and _changed(args, name)]
    if inert:
        acting = sorted({t for name in inert for t in LOSS_TYPE_SETTINGS[name]})
        raise ValueError(
            f"{', '.join(f'`{name}`' for name in inert)} only act with `loss_type` in {acting}; with "
            f"`loss_type={args.loss_type!r}` they would have no effect. Remove them or change `loss_type`."
        )


def _check_vespo_is_mode(args: Any) -> None:
    """TRL's own rule, raised in GRPOTrainer's constructor after the model has loaded: raised here instead."""
    if (
        args.loss_type == "vespo"
        and args.use_vllm
        and args.vllm_importance_sampling_correction
        and args.vllm_importance_sampling_mode not in ("token_truncate", "token_mask")
    ):
        raise ValueError(
            "`loss_type='vespo'` needs a token-level vLLM importance sampling correction: set "
            "`vllm_importance_sampling_mode` to 'token_truncate' or 'token_mask' (got "
            f"{args.vllm_importance_sampling_mode!r}), or `vllm_importance_sampling_correction=False`."
        )


def _check_memory_features_strategy(args: Any, settings: Settings) -> None:
    """Offloaded checkpointing and the tiled MLP need whole parameters per rank; elsewhere the run keeps
    transformers' checkpointing and the plain MLP (the same on every rank: the strategy is read from the config and
    the launcher's environment), and says so."""
    if not args.gradient_checkpointing:
        return
    wanted = [name for name in CHECKPOINTING_FEATURES if getattr(settings, name.removeprefix("turbo_"))]
    unsupported = unsupported_features(args, wanted)
    if unsupported:
        names = " and ".join(f"`{name}`" for name in unsupported)
        warnings.warn(
            f"trl_turbo: {names} stay off in this run: {next(iter(unsupported.values()))}. This run keeps "
            "transformers' gradient checkpointing and the plain MLP; every other trl_turbo feature stays on. "
            "Alternatives: DDP, ZeRO-1/2 and FSDP2 (with transformers >= 5.23) keep these features; under ZeRO-3, "
            "DeepSpeed's `offload_param_device: cpu` moves weights to the host; under FSDP1, `fsdp_offload_params`. "
            "Set them to False to silence this.",
            RuntimeWarning,
            stacklevel=4,
        )


def _check_optimizer_states(args: Any, settings: Settings) -> None:
    """Offloading the optimizer's states needs the torch optimizer the Trainer steps: not DeepSpeed's own, and not
    under FSDP's parameter offload, which keeps them on the host already."""
    if not settings.offload_optimizer_states:
        return
    reason = unsupported_features(args, ["turbo_offload_optimizer_states"]).get("turbo_offload_optimizer_states")
    if reason is not None:
        raise ValueError(f"`turbo_offload_optimizer_states` cannot work here: {reason}. Or set it to 0.")
    if detect_strategy(args) in (Strategy.FSDP1, Strategy.FSDP2) and fsdp_offloads_params():
        raise ValueError("`turbo_offload_optimizer_states` with `fsdp_offload_params: true`: FSDP keeps the "
                         "parameters and the optimizer's states on the host already; set one of them off.")


def liger_unavailable(args: Any) -> str | None:
    """Why Liger's layers cannot run in this run (None: they can)."""
    import importlib.util

    if importlib.util.find_spec("liger_kernel") is None:
        return ("`turbo_liger_layers=True` needs Liger-Kernel: `pip install 'trl-turbo[liger]'`, or set "
                "`turbo_liger_layers=False`.")
    if getattr(args, "use_cpu", False) or not torch.cuda.is_available():
        return ("`turbo_liger_layers=True` runs Liger's Triton kernels, which need a CUDA GPU; set "
                "`turbo_liger_layers=False` on this machine.")
    return None


_noticed: set[str] = set()


def _notice_once(message: str) -> None:
    if message not in _noticed:
        _noticed.add(message)
        warnings.warn(f"trl_turbo: {message}", UserWarning, stacklevel=5)


def _check_vllm(args: Any, settings: Settings, installed: bool) -> None:
    if settings.vllm_sampling is SamplingMode.FP8 and not args.vllm_importance_sampling_correction:
        raise ValueError("`turbo_vllm_sampling='fp8'` samples from an fp8-quantized policy; the trainer must correct "
                         "for the gap with importance sampling: set `vllm_importance_sampling_correction=True` (TRL's "
                         "default), or use `turbo_vllm_sampling='merged'`.")
    if settings.vllm_sampling is not SamplingMode.AUTO and not settings.vllm_shared_weights:
        raise ValueError(f"`turbo_vllm_sampling={settings.vllm_sampling.value!r}` chooses how the shared-weight "
                         "engine samples; set `turbo_vllm_shared_weights=True` with it, or leave it at 'auto'.")
    if settings.vllm_sampling is SamplingMode.FP8 and args.vllm_importance_sampling_mode in PRODUCT_IS_MODES:
        mode = args.vllm_importance_sampling_mode
        raise ValueError(f"`turbo_vllm_sampling='fp8'` with `vllm_importance_sampling_mode={mode!r}`"
                         f"{' (TRL default)' if mode == 'sequence_mask' else ''} weighs each completion by the product "
                         "of its tokens' sampler/trainer ratios, which the fp8 policy's gap drives to almost zero for "
                         "all but a few completions of a batch. Set `vllm_importance_sampling_mode='token_truncate'` "
                         "(or 'sequence_geometric_mask'), or use `turbo_vllm_sampling='merged'`. "
                         "See docs/usage.md#fp8-and-importance-sampling.")
    memory_features = [name for name, on in (("turbo_vllm_shared_weights", settings.vllm_shared_weights),
                                             ("turbo_vllm_standby", settings.vllm_standby)) if on]
    engine_features = memory_features + (["turbo_vllm_kv_cache_dtype"] if settings.vllm_kv_cache_dtype.is_fp8
                                         else [])
    if not engine_features:
        return
    wanted = " and ".join(f"`{name}`" for name in engine_features)
    if not args.use_vllm or args.vllm_mode != "colocate":
        raise ValueError(f"{wanted} configure the colocated vLLM engine: set `use_vllm=True` and "
                         f"`vllm_mode='colocate'` (got use_vllm={args.use_vllm}, vllm_mode={args.vllm_mode!r}).")
    if memory_features and args.vllm_enable_sleep_mode:
        raise ValueError(f"{' and '.join(memory_features)} keep vLLM's weights in place, which TRL's "
                         "`vllm_enable_sleep_mode=True` would drop; set `vllm_enable_sleep_mode=False` "
                         "(`turbo_vllm_standby=True` releases the KV cache instead).")
    if settings.vllm_shared_weights:
        reason = unsupported_features(args, ["turbo_vllm_shared_weights"]).get("turbo_vllm_shared_weights")
        if reason is not None:
            raise ValueError(f"`turbo_vllm_shared_weights=True` cannot work here: {reason}. Train with DDP "
                             "(TRL's multi_gpu.yaml), DeepSpeed ZeRO-1/2 or FSDP2 (TRL's fsdp2.yaml) to share "
                             "weights, or set it to False (`turbo_vllm_standby=True` still releases the KV cache "
                             "while training runs).")
        _check_sharded_sharing(args, settings)
    if installed:
        _check_installed_vllm(settings, wanted)


def _check_sharded_sharing(args: Any, settings: Settings) -> None:
    """Shared weights over several ranks: whole weights under DDP and ZeRO-1/2 (one engine per rank), the
    tensor-parallel slices FSDP2 shards on under FSDP2 (its shard group is the TP group)."""
    tp = args.vllm_tensor_parallel_size
    strategy = detect_strategy(args)
    fsdp2 = strategy is Strategy.FSDP2
    if tp != 1 and not fsdp2:
        raise ValueError(f"`turbo_vllm_shared_weights=True` with `vllm_tensor_parallel_size={tp}`: under "
                         f"{strategy.value} every rank trains on whole weights, which a tensor-parallel "
                         "engine does not hold. Set `vllm_tensor_parallel_size=1`, or train with FSDP2 (TRL's "
                         "fsdp2.yaml), whose shards are then vLLM's tensor-parallel slices.")
    if not fsdp2:
        return
    world, per_node = getattr(args, "world_size", 1), local_process_count()
    if world % tp or per_node % tp:
        raise ValueError(f"`vllm_tensor_parallel_size={tp}` must divide the {per_node} processes per node (and the "
                         f"world of {world}): with shared weights each tensor-parallel group is also an FSDP2 shard "
                         f"group within one node. Sizes that fit: {[t for t in (1, 2, 4, 8) if per_node % t == 0]}.")
    if fsdp_offloads_params():
        raise ValueError("`turbo_vllm_shared_weights=True` keeps FSDP2's shards in vLLM's device memory, which "
                         "`fsdp_offload_params: true` would move to the host; set it to false in the accelerate "
                         "config, or set `turbo_vllm_shared_weights=False`.")


def _check_installed_vllm(settings: Settings, wanted: str) -> None:
    from .vllm_contract import FP8_KV_STANDBY, FP8_SAMPLING, installed_verdict

    engine = installed_verdict()
    if engine.error is not None:
        raise ValueError(f"{wanted} cannot run on this vLLM: {engine.error}. Install a supported vLLM "
                         "(`pip install 'trl-turbo[vllm]'`), or set them off.")
    if engine.notice is not None:
        _notice_once(engine.notice)
    lost = engine.why_unavailable(FP8_SAMPLING)
    if settings.vllm_sampling is SamplingMode.FP8 and lost is not None:
        raise ValueError(f"`turbo_vllm_sampling='fp8'` cannot run on this vLLM: {lost}. Use "
                         "`turbo_vllm_sampling='merged'` or 'lora', or install a vLLM that keeps fp8 sampling "
                         "(`pip install 'trl-turbo[vllm]'`).")
    lost = engine.why_unavailable(FP8_KV_STANDBY)
    if settings.vllm_kv_cache_dtype.is_fp8 and settings.vllm_standby and lost is not None:
        raise ValueError(f"`turbo_vllm_kv_cache_dtype={settings.vllm_kv_cache_dtype.value!r}` with "
                         f"`turbo_vllm_standby=True` cannot run on this vLLM: {lost}. Keep the KV cache 16-bit "
                         "(`turbo_vllm_kv_cache_dtype='auto'`), or install a vLLM that keeps it "
                         "(`pip install 'trl-turbo[vllm]'`).")
    reason = (versions.unsupported_reason({"peft": versions.SUPPORTED_OPTIONAL["peft"]})
              if settings.vllm_shared_weights else None)
    if reason is not None:
        raise ValueError(f"`turbo_vllm_shared_weights=True` reads the PEFT adapter's layers, tested with peft in "
                         f"its supported range: {reason}. Install a supported peft, or set it to False.")


# ----------------------------------------------------------------------------------------------- trainer init


def check_trainer(trainer_cls: type, config: Any, model: Any, peft_config: Any,
                  quantization_config: Any = None) -> None:
    """GRPOTrainer's constructor, before TRL loads the model: the loss settings against the trainer class, and the
    inputs the colocated engine has to serve."""
    check_loss_owner(trainer_cls, config)
    check_trainer_inputs(config, model, peft_config, quantization_config)


def check_loss_owner(trainer_cls: type, config: Any) -> None:
    """trl_turbo's loss settings against the class that will compute the loss. A TRL trainer that overrides
    `_compute_loss` (GMPOTrainer) never runs trl_turbo's loss, so settings only that loss implements would be
    ignored; a GRPOConfig subclass is not checked for unknown loss types at config time (its own trainer may define
    them), so that check happens here, where the trainer is known (and only where both `compute_loss` and
    `_compute_loss` are GRPOTrainer's). A user's override is left alone: it may call trl_turbo's loss through
    `super()`."""
    from trl.trainer.grpo_trainer import GRPOTrainer

    if config is None or not Settings.of(config).fused_loss or not issubclass(trainer_cls, GRPOTrainer):
        return  # the config's own validation refused trl_turbo-only settings

    def owner_of(method: str) -> type:
        return next(cls for cls in trainer_cls.__mro__ if method in cls.__dict__)

    owner = owner_of("_compute_loss")
    if owner is GRPOTrainer:  # its `_compute_loss` is trl_turbo's
        if owner_of("compute_loss") is GRPOTrainer:
            check_loss_type_known(config.loss_type)
        return
    # `loss_type` is not among them: TRL's own trainers with their own loss do not read it
    ignored = turbo_loss_settings(config, with_loss_type=False) if owner.__module__.split(".")[0] == "trl" else []
    if ignored:
        raise ValueError(
            f"{owner.__name__} computes its own loss (it overrides `_compute_loss`), so trl_turbo's loss "
            f"never runs and {' and '.join(ignored)} would have no effect. Remove them, or train with GRPOTrainer."
        )


def check_trainer_inputs(config: Any, model: Any, peft_config: Any, quantization_config: Any = None) -> None:
    """Refuse a vLLM run without vLLM installed, and a shared-weights run no engine can serve (no LoRA adapter, an
    adapter vLLM cannot take, quantization other than bitsandbytes, fp8 sampling where it cannot serve), and warn
    when vLLM will hold a separate copy."""
    if config is not None and getattr(config, "use_vllm", False) and not versions.importable("vllm"):
        raise ValueError("`use_vllm=True` needs vLLM, which is not installed: `pip install 'trl-turbo[vllm]'` "
                         "(vLLM 0.24-0.31 for trl_turbo's engine features), or set `use_vllm=False`.")
    if config is None:
        return
    settings = Settings.of(config)
    if not settings.vllm_shared_weights:
        return
    adapter = peft_config
    if adapter is None and hasattr(model, "peft_config"):
        adapter = model.peft_config.get(getattr(model, "active_adapter", "default"))
    if adapter is None:
        _check_full_finetuning(config, settings, model, quantization_config)
        return
    problems = adapter_problems(adapter)
    if problems:
        raise ValueError(f"`turbo_vllm_shared_weights=True` hands the adapter to vLLM, which cannot take this one: "
                         f"{'; '.join(problems)}. Change the LoraConfig or set `turbo_vllm_shared_weights=False`.")
    quantization = policy_quantization(model, config, quantization_config)
    reasons = copy_reasons(quantization, policy_model_type(model, config))
    if settings.vllm_sampling is SamplingMode.FP8:
        problems = fp8_problems(reasons, adapter, fp8_capability())
        if problems:
            raise ValueError(f"`turbo_vllm_sampling='fp8'` cannot serve this run: {'; '.join(problems)}. Use "
                             "`turbo_vllm_sampling='merged'` (16-bit models) or 'lora'.")
    if reasons:
        warnings.warn(fallback_warning(reasons, quantization is not None), RuntimeWarning, stacklevel=5)
    elif quantization is not None:  # shared 4-bit weights: vLLM's 4-bit layers compute in bf16
        warning = compute_dtype_warning(quantization)
        if warning:
            warnings.warn(warning, RuntimeWarning, stacklevel=5)


def _check_full_finetuning(config: Any, settings: Settings, model: Any, quantization_config: Any) -> None:
    """Shared weights without an adapter: vLLM samples the trained parameters themselves (or an fp8 copy of them),
    which needs a 16-bit model of a family whose layout trl_turbo maps, and no adapter sampling mode."""
    if settings.vllm_sampling in (SamplingMode.MERGED, SamplingMode.LORA):
        raise ValueError(f"`turbo_vllm_sampling={settings.vllm_sampling.value!r}` chooses how a LoRA adapter reaches "
                         "vLLM; this run fine-tunes every weight (no `peft_config`), which vLLM samples directly. "
                         "Leave `turbo_vllm_sampling='auto'` (or 'fp8'), or pass a `peft_config`.")
    quantization = policy_quantization(model, config, quantization_config)
    reasons = copy_reasons(quantization, policy_model_type(model, config))
    if quantization is not None or reasons:
        raise ValueError("`turbo_vllm_shared_weights=True` with full fine-tuning makes the trained parameters vLLM's "
                         f"weights, which needs a 16-bit model of a mapped family: {'; '.join(reasons) or 'quantized'}."
                         " Set `turbo_vllm_shared_weights=False` (TRL's weight sync), or train a LoRA adapter.")
    if settings.vllm_sampling is SamplingMode.FP8:
        problems = fp8_problems([], None, fp8_capability())
        if problems:
            raise ValueError(f"`turbo_vllm_sampling='fp8'` cannot serve this run: {'; '.join(problems)}. Leave "
                             "`turbo_vllm_sampling='auto'` (16-bit sampling of the trained weights).")


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


def fp8_capability() -> tuple[int, int] | None:
    return torch.cuda.get_device_capability() if torch.cuda.is_available() else None


def policy_quantization(model: Any, config: Any, quantization_config: Any = None) -> dict[str, Any] | None:
    """The policy's quantization config as a dict (None: not quantized), known before loading: GRPOTrainer's
    `quantization_config` argument, else `model_init_kwargs`'s, else the checkpoint's own (pre-quantized)."""
    if not isinstance(model, str):
        return quantization_config_dict(getattr(getattr(model, "config", None), "quantization_config", None))
    chosen = quantization_config or (config.model_init_kwargs or {}).get("quantization_config")
    if chosen is not None:
        return quantization_config_dict(chosen)
    return quantization_config_dict(getattr(_hf_config(model, config), "quantization_config", None))


def policy_model_type(model: Any, config: Any) -> str | None:
    hf_config = _hf_config(model, config) if isinstance(model, str) else getattr(model, "config", None)
    return getattr(hf_config, "model_type", None)


@functools.lru_cache(maxsize=8)
def _checkpoint_config(model: str, trust_remote_code: bool) -> Any:
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(model, trust_remote_code=trust_remote_code)


def _hf_config(model: str, config: Any) -> Any:
    kwargs = config.model_init_kwargs or {}
    return _checkpoint_config(model, bool(kwargs.get("trust_remote_code", False)))

