"""The GRPOConfig fields trl_turbo adds, their modes, and `Settings`, their typed reading.

Design: the user surface stays TRL's own `GRPOConfig`. `install()` turns the fields below into real dataclass fields
of `trl.GRPOConfig` (and of its subclasses that exist at that moment) in place, keeping class identity, so
`GRPOConfig(turbo_...=...)`, `HfArgumentParser`, `TrlParser` YAML, `trl-turbo grpo --turbo_...`, pickling and
`copy.deepcopy` all work. Every name starts with `turbo_` so it can never collide with a field TRL adds later.
Each default is declared once, here; `Settings.of(config)` is the one place the fields are read (modes become
StrEnums), and the checks of a config live in `trl_turbo.checks`.
"""

from __future__ import annotations

import dataclasses
import enum
import sys
from dataclasses import dataclass, field
from typing import Any

from .families import LLAMA_NORM_MODEL_TYPES, MODEL_TYPES, SHARED_WEIGHT_MODEL_TYPES, listed
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


@dataclass
class TurboFields:
    """The fields added to GRPOConfig (also the source of README's field table)."""

    turbo_fused_loss: bool = field(
        default=True,
        metadata={
            "help": "Compute GRPOTrainer's per-token log-probs and entropy with trl_turbo's fused LM-head kernel "
            "(hidden states + LM-head weight, never [B,T,V] logits; the hidden-state gradient is assembled in the "
            "forward pass, so the backward needs no recompute GEMM) and the loss with trl_turbo's single loss spec "
            "(`trl_turbo.losses`), which reproduces TRL's `_compute_loss` for every loss option. Set False for "
            "stock TRL."
        },
    )
    turbo_reuse_policy_logps: bool = field(
        default=True,
        metadata={
            "help": "When the old-policy log-probs are provably the training forward's own detached log-probs "
            "(num_iterations == 1 and generation aligned with the optimizer step), skip TRL's extra no-grad forward "
            "that computes them for vLLM importance-sampling correction, and compute the IS ratio inside the loss "
            "from the training forward. Needs turbo_fused_loss."
        },
    )
    turbo_logprob_chunk_tokens: int | None = field(
        default=None,
        metadata={
            "help": "Tokens per LM-head tile in the fused kernel (one [tokens, vocab] tile lives at a time). None "
            "picks ~256 MiB tiles. Lower it to trade speed for memory."
        },
    )
    turbo_dual_clip: float | None = field(
        default=None,
        metadata={
            "help": "Dual-clip PPO (Ye et al., arXiv 1912.09729): for tokens with A < 0 the clipped objective is "
            "bounded by c*A, i.e. loss = min(max(-r*A, -clip(r)*A), -c*A), so a huge ratio on a bad token cannot "
            "dominate the update. c > 1 (the paper uses 3). Only for loss types with PPO-style ratio clipping "
            "(grpo, bnpo, dr_grpo, dapo, luspo, gppo, clip_cov). None disables it."
        },
    )
    turbo_clip_cov_ratio: float = field(
        default=_LOSS_DEFAULTS.clip_cov_ratio,
        metadata={
            "help": "loss_type='clip_cov' (Clip-Cov, Cui et al., arXiv 2505.22617): fraction of the micro-batch's "
            "valid tokens whose gradient is detached, drawn at random (seeded by the run seed and step) among the "
            "tokens with covariance (A - mean A)*(logp - mean logp) in (turbo_clip_cov_lb, turbo_clip_cov_ub). "
            "Paper default 2e-4."
        },
    )
    turbo_clip_cov_lb: float = field(
        default=_LOSS_DEFAULTS.clip_cov_lb,
        metadata={"help": "loss_type='clip_cov' (arXiv 2505.22617): lower covariance bound of the candidates (1)."},
    )
    turbo_clip_cov_ub: float = field(
        default=_LOSS_DEFAULTS.clip_cov_ub,
        metadata={"help": "loss_type='clip_cov' (arXiv 2505.22617): upper covariance bound of the candidates (5)."},
    )
    turbo_kl_cov_ratio: float = field(
        default=_LOSS_DEFAULTS.kl_cov_ratio,
        metadata={
            "help": "loss_type='kl_cov' (KL-Cov, Cui et al., arXiv 2505.22617): fraction of the micro-batch's valid "
            "tokens, those of largest covariance (A - mean A)*(logp - mean logp), that get the penalty "
            "turbo_kl_cov_coef*|log r| added to the unclipped -r*A. Paper default 2e-3 (2e-4 for 32B models)."
        },
    )
    turbo_kl_cov_coef: float = field(
        default=_LOSS_DEFAULTS.kl_cov_coef,
        metadata={"help": "loss_type='kl_cov' (arXiv 2505.22617): coefficient of the |log r| penalty (paper: 1)."},
    )
    turbo_memory_plan: str = field(
        default="auto",
        metadata={
            "help": "How the training phase spends device memory, with gradient_checkpointing (TRL's default). "
            "'auto' (default): at each training forward the first decoder layer keeps its activations while their "
            "size is measured, and the other layers are planned from the device memory free at that moment (with "
            "turbo_vllm_standby: at most what the last generation used, so the step's peak does not rise): as many "
            "layers as fit keep their activations (no recompute; each value stored once, the MLP's activation output "
            "and product rebuilt from gate and up), then checkpoint their input on the device, the "
            "rest offload it to host memory (turbo_offload_checkpoints). Later micro-batches are split into the "
            "sequence groups the plan prices fastest from the same measurement: smaller groups keep more layers but "
            "cost more per token (within turbo_forward_token_budget, at least 4096 tokens). A peak above the prediction "
            "re-plans later micro-batches with more reserve. The plan is printed once and logged as memory_plan/* "
            "metrics. 'min': the most frugal plan (every layer "
            "checkpointed and, on a CUDA device, offloaded). 'off': stock behaviour (transformers' checkpointing, no "
            "tiled MLP, lean norms or sequence groups). Decoder layers of " + listed(MODEL_TYPES) + "; other layers "
            "keep transformers' checkpointing. Gradients equal plain checkpointing's up to float reassociation."
        },
    )
    turbo_training_memory_gib: float | None = field(
        default=None,
        metadata={
            "help": "turbo_memory_plan='auto' with gradient_checkpointing: the device memory in use (GiB, the "
            "device's whole count) up to which the plan lets decoder layers keep their activations, less its margin. "
            "None (default): with turbo_vllm_standby, what the last generation used, so the step's peak does not "
            "rise; without it, the whole device. A value replaces that ceiling: a larger one buys speed with memory "
            "(more layers keep their activations, or micro-batches are trained in sequence groups that keep them "
            "all, so fewer layers are recomputed). Within the device and any per-process memory fraction."
        },
    )
    turbo_offload_checkpoints: bool = field(
        default=True,
        metadata={
            "help": "With gradient_checkpointing: a checkpointed decoder layer's input goes to pinned CPU memory on "
            "a side stream during the forward pass and is prefetched back one layer ahead during the backward "
            "pass ('min': every layer; 'auto': the layers the memory plan cannot hold on the device; False: none). "
            "Gradients are bitwise those of plain checkpointing. Inert without a CUDA device. Decoder layers "
            "of " + listed(MODEL_TYPES) + "; other layers (MoE, other families) keep transformers' checkpointing. One process, DDP or DeepSpeed ZeRO-1/2 (under ZeRO-3 or FSDP it stays "
            "off, with a warning)."
        },
    )
    turbo_offload_host_budget_gib: float | None = field(
        default=None,
        metadata={
            "help": "Pinned host memory the checkpoint offload may hold, in GiB. Checkpoints beyond it stay on the "
            "GPU (per training process). None: 80 percent of the host memory available when training starts, divided "
            "among the training processes of the host."
        },
    )
    turbo_tiled_mlp: bool = field(
        default=True,
        metadata={
            "help": "Compute each checkpointed decoder layer's MLP over token tiles (recomputed per tile in the "
            "backward pass; layers whose activations the memory plan keeps run it untiled), "
            "so its working set does not grow with the micro-batch's token count. Gradients equal plain MLP's up "
            "to float reassociation; micro-batches of at most turbo_tiled_mlp_tokens tokens are untouched, and so "
            "are MLPs with active dropout (lora_dropout > 0). The dense MLPs of the families "
            "turbo_offload_checkpoints covers. One process, DDP or DeepSpeed ZeRO-1/2 (under ZeRO-3 or FSDP it stays "
            "off, with a warning)."
        },
    )
    turbo_tiled_mlp_tokens: int = field(
        default=16384,
        metadata={"help": "Tokens per tile for turbo_tiled_mlp."},
    )
    turbo_forward_token_budget: int | None = field(
        default=32768,
        metadata={
            "help": "A training micro-batch with more tokens than this is forwarded and backpropagated in groups of "
            "whole sequences of at most this many tokens (at least one sequence), with the loss normalised over the "
            "whole micro-batch, so activation memory follows one group. Gradients equal the unsplit pass up to float "
            "reassociation; per-step metrics are averaged over groups as TRL averages micro-batches. Not applied "
            "with top_entropy_quantile < 1, clip_cov/kl_cov, adaptive entropy, MoE aux losses, DeepSpeed or image "
            "inputs, or with turbo_memory_plan='off'. turbo_memory_plan='auto' may split into smaller groups, "
            "within this budget. None: never split."
        },
    )
    turbo_lean_norms: bool = field(
        default=True,
        metadata={
            "help": "Llama-style RMSNorms (" + listed(LLAMA_NORM_MODEL_TYPES) + ") keep only their input and one fp32 scalar "
            "per token for the backward pass instead of fp32 copies of the activations; the forward output is "
            "bitwise the same, gradients equal up to rounding. Off with turbo_memory_plan='off'."
        },
    )
    turbo_vllm_match_precision: bool = field(
        default=True,
        metadata={
            "help": "With use_vllm in colocate mode and fp16 or bf16 training, the vLLM engine samples in that same "
            "dtype (TRL leaves it to the checkpoint's, e.g. a bf16 sampler for fp16 training: the train-inference "
            "mismatch that fp16 RL removes, arXiv 2510.26788)."
        },
    )
    turbo_vllm_shared_weights: bool = field(
        default=False,
        metadata={
            "help": "With a PEFT LoRA adapter, use_vllm=True and vllm_mode='colocate': the training model's frozen "
            "base weights become views of the vLLM engine's weights, so one copy exists (vLLM starts with dummy "
            "weights and receives the HF weights once), and each generation samples from the live adapter, merged "
            "into the shared weights or through vLLM's LoRA layers (turbo_vllm_sampling), never by pushing every "
            "weight or writing files. bitsandbytes 4-bit "
            "models share their packed 4-bit weights (vLLM's bitsandbytes loader gets the training model's bytes "
            "and quantization states). Shared for model types " + listed(SHARED_WEIGHT_MODEL_TYPES) + " in 16 "
            "bits or bitsandbytes 4-bit with uint8 storage. Any other model (another type, 8-bit, other 4-bit "
            "storage, fp32 CPU offload, llm_int8_skip_modules beyond lm_head) falls back, with a warning at config "
            "time, to a separate 16-bit copy in vLLM, loaded once from the training model's own weights (dequantized "
            "where quantized): about 2 bytes per base parameter of extra device memory, the adapter handed over as "
            "tensors. Quantization other than bitsandbytes is refused. One process, DDP or DeepSpeed ZeRO-1/2 "
            "(every rank with its own engine), vllm_tensor_parallel_size=1."
        },
    )
    turbo_vllm_sampling: str = field(
        default="auto",
        metadata={
            "help": "How the colocated engine with turbo_vllm_shared_weights samples from the live adapter. "
            "'merged': before each generation the adapter is merged into the shared base weights in place "
            "(W + scaling*B@A summed in fp32, rounded once), vLLM samples with its plain layers (no LoRA slots, "
            "about 1.2x faster than 'lora'), and the base weights are restored bit-exactly from a host copy taken "
            "once (2 bytes per adapted base parameter of host memory per process) before anything reads them; every "
            "way out of a generation restores first, so training, evaluation and saving never see merged weights. "
            "'lora': vLLM's LoRA layers apply the adapter unmerged, handed over as tensors. 'auto' (default): "
            "'merged' for 16-bit models whose adapter is on linear layers and whose host copy fits in half the "
            "host's available memory (over all processes of the host), else 'lora'. Asking for 'merged' where it "
            "cannot serve (4-bit or separately copied weights, adapted embeddings or tied layers, host memory) "
            "samples with 'lora' and warns with the reason. 'fp8' (opt-in, Hopper or newer): vLLM's linear layers "
            "hold an fp8 (e4m3, one scale per tensor) copy of W + scaling*B@A, written before each generation by "
            "one Triton kernel from the training model's base weights (16-bit, or bitsandbytes 4-bit dequantized "
            "one matrix at a time) and the live adapter; the training model's weights are only read, and with "
            "turbo_vllm_standby the fp8 copy is unmapped with the KV cache while training runs; while vLLM samples, "
            "a 16-bit model's linear weights wait in pinned host memory (a copy taken once, 2 bytes per linear "
            "weight per process; kept on the device, with a warning, when the host cannot hold it). It samples from "
            "a quantized policy, so it requires vllm_importance_sampling_correction=True; combine with "
            "turbo_vllm_kv_cache_dtype='fp8'. Where 'fp8' cannot serve (no GPU of compute capability 8.9+, an "
            "adapter on embeddings or the LM head or modules_to_save, 8-bit models and others vLLM would need a "
            "separate copy of) the run is refused before the model loads."
        },
    )
    turbo_rollout_check: str = field(
        default="warn",
        metadata={
            "help": "Rollout sanity alarm, with use_vllm and vllm_importance_sampling_correction (which make TRL "
            "compute the sampler/trainer log-prob gap): when the mean gap per token stays above max(4x, +0.02 nats) "
            "the gap of the first two steps for two steps in a row, vLLM is sampling from other weights than the "
            "policy being trained (a stale or missing adapter, unrestored weights). 'warn' (default): one warning "
            "naming the figures; 'error': raise, stopping the run; 'off'."
        },
    )
    turbo_vllm_standby: bool = field(
        default=False,
        metadata={
            "help": "With use_vllm=True and vllm_mode='colocate': release only vLLM's KV cache while training runs "
            "and map it back before the next generation; vLLM's weights stay in place (TRL's "
            "vllm_enable_sleep_mode drops and re-pushes them). Unless vllm_gpu_memory_utilization is changed from "
            "TRL's default, the KV cache takes the device memory left (within torch's per-process memory fraction, "
            "if one is set) after the weights, the trainable parameters with their optimizer states, vLLM's "
            "sampling workspace and a margin (5 percent of the device, at least 2 GiB or 10 percent of it, the "
            "smaller), never more than its sequences can fill. Under a memory fraction the unmapped KV cache is lent "
            "to it while training runs. With several processes each releases its own engine's KV cache; "
            "vllm_tensor_parallel_size=1."
        },
    )
    turbo_vllm_kv_cache_dtype: str = field(
        default="auto",
        metadata={
            "help": "dtype of the colocated vLLM engine's KV cache: 'auto' (the model dtype) or an fp8 format "
            "('fp8', 'fp8_e4m3', 'fp8_e5m2'), which halves KV memory at a small cost in sampling precision."
        },
    )
    turbo_liger_layers: bool | None = field(
        default=None,
        metadata={
            "help": "Route the RMSNorms and gated-SiLU MLPs of " + listed(LLAMA_NORM_MODEL_TYPES) + " models through "
            "Liger-Kernel's fused Triton kernels (in place of the lean norms; the tiled MLP tiles Liger's MLP, and "
            "layers the memory plan keeps compute the gated product in torch, as the modeling code does, so it can "
            "be rebuilt instead of stored). "
            "None (default): on for a one-process run on a CUDA GPU with liger-kernel installed (where its "
            "results were checked against stock), else off. True needs liger-kernel and a CUDA GPU."
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
    tiled_mlp: bool
    tiled_mlp_tokens: int
    forward_token_budget: int | None
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
        Raises ValueError for a mode no StrEnum knows."""
        values = {}
        for item in TURBO_FIELDS:
            value = getattr(config, item.name, item.default)
            if item.name in MODE_FIELDS:
                value = mode_value(item.name, value)
            values[item.name.removeprefix("turbo_")] = value
        return cls(**values)


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
