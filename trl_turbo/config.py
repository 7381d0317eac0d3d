"""The GRPOConfig fields trl_turbo adds, their modes, and `Settings`, their typed reading.

Design: the user surface stays TRL's own `GRPOConfig`. `install()` turns the fields below into real dataclass fields
of `trl.GRPOConfig` (and of its subclasses that exist at that moment) in place, keeping class identity, so
`GRPOConfig(turbo_...=...)`, `HfArgumentParser`, `TrlParser` YAML, `trl-turbo grpo --turbo_...`, pickling and
`copy.deepcopy` all work. Every name starts with `turbo_` so it can never collide with a field TRL adds later.
Each default is declared once, here. `Settings.of(config)` is how every decision reads the fields (modes become
StrEnums); the loss spec reads its own fields (`losses.LossSpec.from_trainer`), and the checks of a config live in
`trl_turbo.checks`.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import sys
from dataclasses import dataclass, field
from typing import Any

from .families import LLAMA_NORM_MODEL_TYPES, listed
from .losses import LOSS_TYPES, TURBO_IS_MODES, TURBO_LOSS_TYPES, LossSpec

if sys.version_info >= (3, 11):
    from enum import StrEnum
else:  # Python 3.10

    class StrEnum(str, enum.Enum):
        def __str__(self) -> str:
            return str(self.value)

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


class Share(float):
    """A share between 0 and 1 as a command line, a YAML file or Python give it: a number, or a bool or its text
    (true/false, yes/no: all or none). The range is checked at config time (`state_share`)."""

    README_TYPE = "float or bool"

    def __new__(cls, value: Any = 0.0) -> Share:
        if isinstance(value, str) and value.strip().lower() in _BOOL_TEXT:
            value = _BOOL_TEXT[value.strip().lower()]
        return super().__new__(cls, value)


_BOOL_TEXT = {"true": 1.0, "yes": 1.0, "false": 0.0, "no": 0.0}


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
    turbo_offload_optimizer_states: Share = field(
        default=0.0,
        metadata={
            "help": "Share of the optimizer's states (Adam's two moments, by bytes) kept in pinned host memory between "
            "optimizer steps and streamed through the device at each step, for a copy of that share each way per "
            "step: 0 (default) none, 1 (or true) all. See docs/usage.md#optimizer-states."
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
    turbo_expandable_segments: bool = field(
        default=False,
        metadata={
            "help": "Turn on PyTorch's expandable segments for the training process's CUDA allocations (unless "
            "PYTORCH_CUDA_ALLOC_CONF names them), so blocks freed by tensors of changing sizes merge instead of "
            "staying reserved. See docs/usage.md#expandable-segments."
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
            "help": "Colocated vLLM and the trainer hold one copy of the weights: a LoRA run's frozen base weights "
            "(every weight, with full fine-tuning) become views of vLLM's, per tensor-parallel slice under FSDP2. "
            "Off by default. See docs/usage.md#shared-weights."
        },
    )
    turbo_vllm_sampling: str = field(
        default="auto",
        metadata={
            "help": "How the shared-weight engine samples from the live adapter: 'merged' into the base weights, "
            "'lora' through vLLM's LoRA layers, 'fp8' (opt-in; also with full fine-tuning) from an fp8 copy of the "
            "policy. 'auto' (default): 'merged' where it can serve, else 'lora'. See docs/usage.md#sampling-modes."
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


class MemoryPlanMode(StrEnum):
    AUTO = "auto"
    MIN = "min"
    OFF = "off"


class SamplingMode(StrEnum):
    AUTO = "auto"
    MERGED = "merged"
    FP8 = "fp8"
    LORA = "lora"


class RolloutCheckMode(StrEnum):
    WARN = "warn"
    ERROR = "error"
    OFF = "off"


class KVCacheDtype(StrEnum):
    AUTO = "auto"
    FP8 = "fp8"
    FP8_E4M3 = "fp8_e4m3"
    FP8_E5M2 = "fp8_e5m2"

    @property
    def is_fp8(self) -> bool:
        return self is not KVCacheDtype.AUTO


# The fields whose values are modes -> their StrEnum (the values a field accepts).
MODE_FIELDS: dict[str, type[StrEnum]] = {
    "turbo_memory_plan": MemoryPlanMode,
    "turbo_vllm_sampling": SamplingMode,
    "turbo_rollout_check": RolloutCheckMode,
    "turbo_vllm_kv_cache_dtype": KVCacheDtype,
}


@dataclass(frozen=True)
class Settings:
    """The `turbo_*` fields of a config, typed: modes as StrEnums, every field present. `Settings.of(config)` is the
    one place a config's fields are read; a config built before `import trl_turbo` (or any object without the
    fields) gets the fields' declared defaults."""

    fused_loss: bool
    reuse_policy_logps: bool
    logprob_chunk_tokens: int | None
    dual_clip: float | None
    clip_cov_ratio: float
    clip_cov_lb: float
    clip_cov_ub: float
    kl_cov_ratio: float
    kl_cov_coef: float
    memory_plan: MemoryPlanMode
    training_memory_gib: float | None
    offload_checkpoints: bool
    offload_host_budget_gib: float | None
    offload_optimizer_states: float  # the share of the states on the host (0: none)
    tiled_mlp: bool
    tiled_mlp_tokens: int
    forward_token_budget: int | None
    expandable_segments: bool
    lean_norms: bool
    vllm_match_precision: bool
    vllm_shared_weights: bool
    vllm_sampling: SamplingMode
    rollout_check: RolloutCheckMode
    vllm_standby: bool
    vllm_kv_cache_dtype: KVCacheDtype
    liger_layers: bool | None

    @classmethod
    def of(cls, config: Any) -> Settings:
        """The settings of `config` (a GRPOConfig, or any object with some `turbo_*` attributes; None: defaults).
        Raises ValueError for a mode no StrEnum knows, or a share outside [0, 1]."""
        values = {}
        for item in TURBO_FIELDS:
            value = getattr(config, item.name, item.default)
            if item.name in MODE_FIELDS:
                value = mode_value(item.name, value)
            elif item.name == "turbo_offload_optimizer_states":
                value = state_share(value)
            values[item.name.removeprefix("turbo_")] = value
        return cls(**values)


def state_share(value: Any) -> float:
    """`turbo_offload_optimizer_states` as a share in [0, 1] (a bool, or its text: all or none); ValueError
    otherwise."""
    try:
        share = float(Share(value))
    except (TypeError, ValueError):
        share = math.nan
    if not 0.0 <= share <= 1.0:  # NaN fails too
        raise ValueError(f"`turbo_offload_optimizer_states={value!r}` must be a share of the optimizer's states "
                         "between 0 (none on the host) and 1 (all), or a bool.")
    return share


def mode_value(name: str, value: Any) -> StrEnum:
    """`value` of mode field `name` as its StrEnum; ValueError naming the accepted values."""
    modes = MODE_FIELDS[name]
    try:
        return modes(value)
    except ValueError:
        raise ValueError(f"`{name}={value!r}` is not one of {', '.join(m.value for m in modes)}.") from None


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
