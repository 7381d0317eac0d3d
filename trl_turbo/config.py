"""The GRPOConfig fields trl_turbo adds, and their validation.

Design: the user surface stays TRL's own `GRPOConfig`. `install()` turns the fields below into real dataclass fields
of `trl.GRPOConfig` (and of its subclasses that exist at that moment) in place, keeping class identity, so
`GRPOConfig(turbo_...=...)`, `HfArgumentParser`, `TrlParser` YAML, `trl-turbo grpo --turbo_...`, pickling and
`copy.deepcopy` all work. Every name starts with `turbo_` so it can never collide with a field TRL adds later.

Validation lives in one place (`validate`), runs at the end of `GRPOConfig.__post_init__` — before any model is
loaded — and raises `ValueError`s that name the fix.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from dataclasses import dataclass, field
from typing import Any

from .families import LLAMA_NORM_MODEL_TYPES, listed
from .losses import LOSS_TYPES, TURBO_IS_MODES, TURBO_LOSS_TYPES, LossSpec, validate_loss_options

VLLM_KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")
VLLM_SAMPLING_MODES = ("auto", "merged", "fp8", "lora")
ROLLOUT_CHECK_MODES = ("warn", "error", "off")
# The loss spec's defaults are the defaults of the loss fields below (one source).
_LOSS_DEFAULTS = LossSpec()
# Loss fields that act in some loss types only -> those loss types.
LOSS_TYPE_SETTINGS: dict[str, tuple[str, ...]] = {
    "turbo_clip_cov_ratio": ("clip_cov",),
    "turbo_clip_cov_lb": ("clip_cov",),
    "turbo_clip_cov_ub": ("clip_cov",),
    "turbo_kl_cov_ratio": ("kl_cov",),
    "turbo_kl_cov_coef": ("kl_cov",),
}


@dataclass
class TurboFields:
    """The fields added to GRPOConfig (also the source of README's field table)."""

    turbo_fused_loss: bool = field(
        default=True,
        metadata={
            "help": "Compute the per-token log-probs, entropy and GRPO loss with trl_turbo's fused LM-head kernel "
            "(no [B, T, V] logits) and its one loss spec, which reproduces TRL's loss. True (default): on; False: "
            "stock TRL. See docs/usage.md#fused-loss."
        },
    )
    turbo_reuse_policy_logps: bool = field(
        default=True,
        metadata={
            "help": "Where the old-policy log-probs would equal the training forward's (num_iterations=1, generation "
            "aligned with optimizer steps), skip TRL's extra forward for vLLM importance sampling and take the ratio "
            "from the training forward. On by default. See docs/usage.md#fused-loss."
        },
    )
    turbo_logprob_chunk_tokens: int | None = field(
        default=None,
        metadata={
            "help": "Tokens per LM-head tile of the fused kernel (one [tokens, vocab] tile exists at a time). None "
            "(default): tiles of about 256 MiB; a smaller value saves memory and costs speed. "
            "See docs/usage.md#fused-loss."
        },
    )
    turbo_dual_clip: float | None = field(
        default=None,
        metadata={
            "help": "Dual-clip PPO bound c > 1 (the paper uses 3): a token with negative advantage A adds at most "
            "-c*A to the loss, however large its ratio. For loss types with ratio clipping; None (default): off. "
            "See docs/usage.md#loss-options."
        },
    )
    turbo_clip_cov_ratio: float = field(
        default=_LOSS_DEFAULTS.clip_cov_ratio,
        metadata={
            "help": "loss_type='clip_cov': share of the micro-batch's valid tokens whose gradient is detached, drawn "
            "at random among those with covariance in (turbo_clip_cov_lb, turbo_clip_cov_ub). Default: the paper's "
            "2e-4. See docs/usage.md#loss-options."
        },
    )
    turbo_clip_cov_lb: float = field(
        default=_LOSS_DEFAULTS.clip_cov_lb,
        metadata={
            "help": "loss_type='clip_cov': lower covariance bound of the tokens turbo_clip_cov_ratio draws from. "
            "Default: the paper's 1. See docs/usage.md#loss-options."
        },
    )
    turbo_clip_cov_ub: float = field(
        default=_LOSS_DEFAULTS.clip_cov_ub,
        metadata={
            "help": "loss_type='clip_cov': upper covariance bound of the tokens turbo_clip_cov_ratio draws from. "
            "Default: the paper's 5. See docs/usage.md#loss-options."
        },
    )
    turbo_kl_cov_ratio: float = field(
        default=_LOSS_DEFAULTS.kl_cov_ratio,
        metadata={
            "help": "loss_type='kl_cov': share of the micro-batch's valid tokens, those of largest covariance, that "
            "get the penalty turbo_kl_cov_coef*|log r|. Default: the paper's 2e-3 (it uses 2e-4 for 32B models). "
            "See docs/usage.md#loss-options."
        },
    )
    turbo_kl_cov_coef: float = field(
        default=_LOSS_DEFAULTS.kl_cov_coef,
        metadata={
            "help": "loss_type='kl_cov': coefficient of the |log r| penalty on the tokens turbo_kl_cov_ratio selects. "
            "Default: the paper's 1. See docs/usage.md#loss-options."
        },
    )
    turbo_memory_plan: str = field(
        default="auto",
        metadata={
            "help": "How training spends device memory with gradient_checkpointing. 'auto' (default): from one "
            "measured layer, as many layers as fit keep their activations and the rest are checkpointed or "
            "offloaded; 'min': the least memory; 'off': stock. See docs/usage.md#memory-plan."
        },
    )
    turbo_training_memory_gib: float | None = field(
        default=None,
        metadata={
            "help": "Device memory in use (GiB, the whole device's count) up to which the 'auto' plan keeps "
            "activations. None (default): what the last generation used with turbo_vllm_standby, else the whole "
            "device. A larger value buys speed. See docs/usage.md#memory-for-speed."
        },
    )
    turbo_offload_checkpoints: bool = field(
        default=True,
        metadata={
            "help": "With gradient_checkpointing, checkpointed decoder layers send their input to pinned host memory "
            "in the forward pass and fetch it back for the backward pass ('auto': the layers the plan cannot hold "
            "on the device). CUDA only. See docs/usage.md#offloaded-checkpoints."
        },
    )
    turbo_offload_host_budget_gib: float | None = field(
        default=None,
        metadata={
            "help": "Pinned host memory checkpoint offload may hold per training process, in GiB; checkpoints beyond "
            "it stay on the GPU. None (default): 80 percent of the host memory available at start, shared among "
            "the host's training processes. See docs/usage.md#offloaded-checkpoints."
        },
    )
    turbo_tiled_mlp: bool = field(
        default=True,
        metadata={
            "help": "Run each checkpointed decoder layer's MLP over token tiles, so its memory does not grow with the "
            "micro-batch's tokens; layers whose activations the plan keeps run it whole. On by default. "
            "See docs/usage.md#tiled-mlp."
        },
    )
    turbo_tiled_mlp_tokens: int = field(
        default=16384,
        metadata={
            "help": "Tokens per tile of turbo_tiled_mlp (fewer where the device is short of memory); an MLP call of "
            "at most this many tokens runs untiled. See docs/usage.md#tiled-mlp."
        },
    )
    turbo_forward_token_budget: int | None = field(
        default=32768,
        metadata={
            "help": "A training micro-batch of more tokens than this runs forward and backward in groups of whole "
            "sequences of at most this many tokens, the loss normalised over the whole micro-batch. None: never "
            "split. See docs/usage.md#sequence-groups."
        },
    )
    turbo_lean_norms: bool = field(
        default=True,
        metadata={
            "help": "Llama-style RMSNorms (" + listed(LLAMA_NORM_MODEL_TYPES) + ") save only their input and one "
            "fp32 scalar per token for the backward pass, not fp32 copies of the activations. On unless "
            "turbo_memory_plan='off'. See docs/usage.md#lean-norms-and-liger-layers."
        },
    )
    turbo_vllm_match_precision: bool = field(
        default=True,
        metadata={
            "help": "With colocated vLLM and fp16 or bf16 training, vLLM samples in the training dtype (TRL leaves "
            "it to the checkpoint's). On by default. See docs/usage.md#precision-matching."
        },
    )
    turbo_vllm_shared_weights: bool = field(
        default=False,
        metadata={
            "help": "With a LoRA adapter and colocated vLLM, the training model's frozen base weights become views "
            "of vLLM's, so one copy exists; models that cannot share get a separate 16-bit copy in vLLM, with a "
            "warning. Off by default. See docs/usage.md#shared-weights."
        },
    )
    turbo_vllm_sampling: str = field(
        default="auto",
        metadata={
            "help": "How the shared-weight engine samples from the live adapter: 'merged' into the base weights, "
            "'lora' through vLLM's LoRA layers, 'fp8' (opt-in) from an fp8 copy of the merged policy. 'auto' "
            "(default): 'merged' where it can serve, else 'lora'. See docs/usage.md#sampling-modes."
        },
    )
    turbo_rollout_check: str = field(
        default="warn",
        metadata={
            "help": "Alarm for vLLM sampling from other weights than the policy: the sampler/trainer log-prob gap "
            "stays far above its first steps'. 'warn' (default): one warning; 'error': stop the run; 'off'. Needs "
            "vllm_importance_sampling_correction. See docs/usage.md#rollout-check."
        },
    )
    turbo_vllm_standby: bool = field(
        default=False,
        metadata={
            "help": "With colocated vLLM, release only the engine's KV cache while training runs and map it back "
            "before each generation; the weights stay. Its size is automatic unless vllm_gpu_memory_utilization is "
            "set. Off by default. See docs/usage.md#kv-cache-standby-and-dtype."
        },
    )
    turbo_vllm_kv_cache_dtype: str = field(
        default="auto",
        metadata={
            "help": "dtype of the colocated engine's KV cache: 'auto' (default: the model's dtype) or 'fp8', "
            "'fp8_e4m3', 'fp8_e5m2', which halve KV memory at a small cost in sampling precision. "
            "See docs/usage.md#kv-cache-standby-and-dtype."
        },
    )
    turbo_liger_layers: bool | None = field(
        default=None,
        metadata={
            "help": "Run the RMSNorms and gated-SiLU MLPs of " + listed(LLAMA_NORM_MODEL_TYPES) + " through "
            "Liger-Kernel's Triton kernels, in place of the lean norms. None (default): on for a one-process CUDA "
            "run with liger-kernel installed; True needs both. See docs/usage.md#lean-norms-and-liger-layers."
        },
    )


TURBO_FIELDS: tuple[dataclasses.Field, ...] = dataclasses.fields(TurboFields)
MEMORY_PLANS = ("auto", "min", "off")


def memory_plan(args: Any) -> str:
    """The run's `turbo_memory_plan` (the field's default for an object without it)."""
    return getattr(args, "turbo_memory_plan", "auto")


def validate(args: Any, installed: bool = True) -> None:
    """Raise ValueError for unknown or conflicting trl_turbo settings (called in __post_init__). `installed=False`:
    skip the checks of this machine's library versions (`trl-turbo plan` judges a config for another machine)."""
    if args.turbo_liger_layers:
        _validate_liger(args)
    if args.turbo_logprob_chunk_tokens is not None and args.turbo_logprob_chunk_tokens < 1:
        raise ValueError(
            f"`turbo_logprob_chunk_tokens` must be a positive number of tokens or None, "
            f"got {args.turbo_logprob_chunk_tokens}."
        )
    if args.turbo_tiled_mlp_tokens < 1:
        raise ValueError(f"`turbo_tiled_mlp_tokens` must be a positive number, got {args.turbo_tiled_mlp_tokens}.")
    if args.turbo_forward_token_budget is not None and args.turbo_forward_token_budget < 1:
        raise ValueError(
            f"`turbo_forward_token_budget` must be a positive number of tokens or None, got "
            f"{args.turbo_forward_token_budget}."
        )
    if args.turbo_memory_plan not in MEMORY_PLANS:
        raise ValueError(f"`turbo_memory_plan={args.turbo_memory_plan!r}` is not one of {', '.join(MEMORY_PLANS)}.")
    training_memory = args.turbo_training_memory_gib
    if training_memory is not None:
        if not (math.isfinite(training_memory) and training_memory > 0):
            raise ValueError(f"`turbo_training_memory_gib` must be a finite number of GiB > 0 or None, got "
                             f"{training_memory}.")
        if args.turbo_memory_plan != "auto" or not args.gradient_checkpointing:
            setting = (f"`turbo_memory_plan={args.turbo_memory_plan!r}`" if args.turbo_memory_plan != "auto"
                       else "`gradient_checkpointing=False`")
            raise ValueError(f"`turbo_training_memory_gib` sizes the automatic memory plan; with {setting} nothing "
                             "reads it. Set `turbo_memory_plan='auto'` with `gradient_checkpointing=True`, or remove "
                             "`turbo_training_memory_gib`.")
    budget = args.turbo_offload_host_budget_gib
    if budget is not None and not (math.isfinite(budget) and budget >= 0):
        raise ValueError(f"`turbo_offload_host_budget_gib` must be a finite number of GiB >= 0 or None, got {budget}.")
    _check_memory_features_strategy(args)
    _validate_vllm(args, installed)
    if args.turbo_fused_loss and type(args).__name__ == "GRPOConfig":
        check_loss_type_known(args.loss_type)
    _check_vespo_is_mode(args)
    turbo_only = turbo_loss_settings(args)
    if turbo_only and not args.turbo_fused_loss:
        raise ValueError(
            f"{' and '.join(turbo_only)}: only trl_turbo's loss implements this (stock TRL does not know it), and "
            "`turbo_fused_loss=False` switches that loss off. Set `turbo_fused_loss=True`, or remove these settings "
            "and use TRL's values."
        )
    if (
        args.vllm_importance_sampling_mode in TURBO_IS_MODES
        and args.use_vllm
        and args.vllm_importance_sampling_correction
        and not args.turbo_reuse_policy_logps
    ):
        raise ValueError(
            f"`vllm_importance_sampling_mode={args.vllm_importance_sampling_mode!r}` is computed inside trl_turbo's "
            "loss, from the old-policy log-probs where TRL computes them (num_iterations > 1 or generation "
            "misaligned with optimizer steps) and from the training forward otherwise, so it needs "
            "`turbo_reuse_policy_logps=True`."
        )
    if args.turbo_fused_loss:
        validate_loss_options(args)
        _check_loss_type_settings(args)


def check_loss_type_known(loss_type: str) -> None:
    """Raise for a `loss_type` trl_turbo's fused loss does not implement."""
    if loss_type not in LOSS_TYPES:
        raise ValueError(
            f"Unknown `loss_type={loss_type!r}`. trl_turbo's fused loss supports: {', '.join(LOSS_TYPES)}. "
            "Pick one of these, or set `turbo_fused_loss=False` to hand the value to stock TRL."
        )


def turbo_loss_settings(args: Any, *, with_loss_type: bool = True) -> list[str]:
    """The settings of `args` that only trl_turbo's loss implements (TRL's own loss would reject or ignore them):
    its loss types (unless `with_loss_type=False`) and IS modes, and its loss fields where they differ from their
    defaults."""
    settings = [
        f"`{name}={value!r}`"
        for name, value, known in (
            ("loss_type", args.loss_type, TURBO_LOSS_TYPES if with_loss_type else ()),
            ("vllm_importance_sampling_mode", args.vllm_importance_sampling_mode, TURBO_IS_MODES),
        )
        if value in known
    ]
    if args.turbo_dual_clip is not None:
        settings.append(f"`turbo_dual_clip={args.turbo_dual_clip!r}`")
    settings += [f"`{name}={getattr(args, name)!r}`" for name in LOSS_TYPE_SETTINGS if _changed(args, name)]
    return settings


def _changed(args: Any, name: str) -> bool:
    return getattr(args, name) != getattr(_LOSS_DEFAULTS, name.removeprefix("turbo_"))


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


def _check_memory_features_strategy(args: Any) -> None:
    """Offloaded checkpointing and the tiled MLP need whole parameters per rank; elsewhere the run keeps
    transformers' checkpointing and the plain MLP (the same on every rank: the strategy is read from the config and
    the launcher's environment), and says so."""
    from .distributed import CHECKPOINTING_FEATURES, unsupported_features

    if not args.gradient_checkpointing:
        return
    wanted = [name for name in CHECKPOINTING_FEATURES if getattr(args, name)]
    unsupported = unsupported_features(args, wanted)
    if unsupported:
        names = " and ".join(f"`{name}`" for name in unsupported)
        warnings.warn(
            f"trl_turbo: {names} stay off in this run: {next(iter(unsupported.values()))}. This run keeps "
            "transformers' gradient checkpointing and the plain MLP; every other trl_turbo feature stays on. "
            "Alternatives: DDP or ZeRO-1/2 keep these features; under ZeRO-3, DeepSpeed's `offload_param_device: "
            "cpu` moves weights to the host; under FSDP, `fsdp_offload_params`. Set them to False to silence this.",
            RuntimeWarning,
            stacklevel=4,
        )


def liger_layers_enabled(args: Any) -> bool:
    """`turbo_liger_layers` resolved: as set when True/False; None: on for a one-process CUDA run with liger-kernel
    installed."""
    from .distributed import Strategy, detect_strategy

    setting = getattr(args, "turbo_liger_layers", None)
    if setting is not None:
        return bool(setting)
    return _liger_unavailable(args) is None and detect_strategy(args) is Strategy.SINGLE


def _liger_unavailable(args: Any) -> str | None:
    """Why Liger's layers cannot run in this run (None: they can)."""
    import importlib.util

    import torch

    if importlib.util.find_spec("liger_kernel") is None:
        return ("`turbo_liger_layers=True` needs Liger-Kernel: `pip install 'trl-turbo[liger]'`, or set "
                "`turbo_liger_layers=False`.")
    if getattr(args, "use_cpu", False) or not torch.cuda.is_available():
        return ("`turbo_liger_layers=True` runs Liger's Triton kernels, which need a CUDA GPU; set "
                "`turbo_liger_layers=False` on this machine.")
    return None


def _validate_liger(args: Any) -> None:
    reason = _liger_unavailable(args)
    if reason is not None:
        raise ValueError(reason)


_noticed: set[str] = set()


def _notice_once(message: str) -> None:
    if message not in _noticed:
        _noticed.add(message)
        warnings.warn(f"trl_turbo: {message}", UserWarning, stacklevel=4)


def _validate_vllm(args: Any, installed: bool = True) -> None:
    if args.turbo_vllm_kv_cache_dtype not in VLLM_KV_CACHE_DTYPES:
        raise ValueError(f"`turbo_vllm_kv_cache_dtype={args.turbo_vllm_kv_cache_dtype!r}` is not one of "
                         f"{', '.join(VLLM_KV_CACHE_DTYPES)}.")
    if args.turbo_rollout_check not in ROLLOUT_CHECK_MODES:
        raise ValueError(f"`turbo_rollout_check={args.turbo_rollout_check!r}` is not one of "
                         f"{', '.join(ROLLOUT_CHECK_MODES)}.")
    if args.turbo_vllm_sampling not in VLLM_SAMPLING_MODES:
        raise ValueError(f"`turbo_vllm_sampling={args.turbo_vllm_sampling!r}` is not one of "
                         f"{', '.join(VLLM_SAMPLING_MODES)}.")
    if args.turbo_vllm_sampling == "fp8" and not args.vllm_importance_sampling_correction:
        raise ValueError("`turbo_vllm_sampling='fp8'` samples from an fp8-quantized policy; the trainer must correct "
                         "for the gap with importance sampling: set `vllm_importance_sampling_correction=True` (TRL's "
                         "default), or use `turbo_vllm_sampling='merged'`.")
    if args.turbo_vllm_sampling != "auto" and not args.turbo_vllm_shared_weights:
        raise ValueError(f"`turbo_vllm_sampling={args.turbo_vllm_sampling!r}` chooses how the shared-weight engine "
                         "samples; set `turbo_vllm_shared_weights=True` with it, or leave it at 'auto'.")
    memory_features = [name for name in ("turbo_vllm_shared_weights", "turbo_vllm_standby") if getattr(args, name)]
    engine_features = memory_features + (["turbo_vllm_kv_cache_dtype"] if args.turbo_vllm_kv_cache_dtype != "auto"
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
    if memory_features and args.vllm_tensor_parallel_size != 1:
        raise ValueError(f"{' and '.join(memory_features)} manage one whole engine per training process: set "
                         f"`vllm_tensor_parallel_size=1` (got {args.vllm_tensor_parallel_size}).")
    if args.turbo_vllm_shared_weights:
        from .distributed import unsupported_features

        reason = unsupported_features(args, ["turbo_vllm_shared_weights"]).get("turbo_vllm_shared_weights")
        if reason is not None:
            raise ValueError(f"`turbo_vllm_shared_weights=True` cannot work here: {reason}. Train with DDP "
                             "(TRL's multi_gpu.yaml) or DeepSpeed ZeRO-1/2 to share weights, or set it to False "
                             "(`turbo_vllm_standby=True` still releases the KV cache while training runs).")
    if not installed:
        return
    from .versions import SUPPORTED_OPTIONAL, unsupported_reason
    from .vllm_contract import FP8_KV_STANDBY, FP8_SAMPLING, installed_verdict

    engine = installed_verdict()
    if engine.error is not None:
        raise ValueError(f"{wanted} cannot run on this vLLM: {engine.error}. Install a supported vLLM "
                         "(`pip install 'trl-turbo[vllm]'`), or set them off.")
    if engine.notice is not None:
        _notice_once(engine.notice)
        if args.turbo_rollout_check == "warn":
            args.turbo_rollout_check = "error"
    lost = engine.why_unavailable(FP8_SAMPLING)
    if args.turbo_vllm_sampling == "fp8" and lost is not None:
        raise ValueError(f"`turbo_vllm_sampling='fp8'` cannot run on this vLLM: {lost}. Use "
                         "`turbo_vllm_sampling='merged'` or 'lora', or install a vLLM that keeps fp8 sampling "
                         "(`pip install 'trl-turbo[vllm]'`).")
    lost = engine.why_unavailable(FP8_KV_STANDBY)
    if args.turbo_vllm_kv_cache_dtype == "fp8" and args.turbo_vllm_standby and lost is not None:
        raise ValueError(f"`turbo_vllm_kv_cache_dtype='fp8'` with `turbo_vllm_standby=True` cannot run on this vLLM: "
                         f"{lost}. Keep the KV cache 16-bit (`turbo_vllm_kv_cache_dtype='auto'`), or install a vLLM "
                         "that keeps it (`pip install 'trl-turbo[vllm]'`).")
    reason = unsupported_reason({"peft": SUPPORTED_OPTIONAL["peft"]}) if args.turbo_vllm_shared_weights else None
    if reason is not None:
        raise ValueError(f"`turbo_vllm_shared_weights=True` reads the PEFT adapter's layers, tested with peft in "
                         f"its supported range: {reason}. Install a supported peft, or set it to False.")
