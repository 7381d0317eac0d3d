"""The one table of supported model families: every feature that depends on a model's architecture reads it here.

Design decision: a family is named by its transformers `model_type` and described by the class names its modeling
code uses (matched by name, so no modeling module is imported to read the table) and by what trl_turbo's features
know about it. Adding a family is one row here plus its parity and GPU tests; the help texts, README and the
features derive their lists from this table.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Family:
    model_type: str
    decoder_layer: str  # checkpointed with trl_turbo's checkpoint function; its dense gated MLP tiled
    llama_norm: str | None  # an RMSNorm computing weight * (x.float() * rsqrt(mean(x.float()**2) + eps)).to(x.dtype):
    # lean norms and Liger's RMSNorm/SwiGLU apply (gemma's `1 + weight` form is not one)
    vllm_layout: bool = True  # vLLM stores each HF weight as rows of one tensor: the base weights can be shared
    post_mlp_norm: bool = False  # a norm follows the MLP: a checkpointed layer's recompute needs the MLP's output


FAMILIES: tuple[Family, ...] = (
    Family("llama", "LlamaDecoderLayer", "LlamaRMSNorm"),
    Family("mistral", "MistralDecoderLayer", "MistralRMSNorm"),
    Family("qwen2", "Qwen2DecoderLayer", "Qwen2RMSNorm"),
    Family("qwen3", "Qwen3DecoderLayer", "Qwen3RMSNorm"),
    Family("gemma", "GemmaDecoderLayer", None),
    Family("gemma2", "Gemma2DecoderLayer", None, post_mlp_norm=True),
    Family("gemma3_text", "Gemma3DecoderLayer", None, post_mlp_norm=True),
)

MODEL_TYPES: tuple[str, ...] = tuple(f.model_type for f in FAMILIES)
SHARED_WEIGHT_MODEL_TYPES: tuple[str, ...] = tuple(f.model_type for f in FAMILIES if f.vllm_layout)
LLAMA_NORM_MODEL_TYPES: tuple[str, ...] = tuple(f.model_type for f in FAMILIES if f.llama_norm)
POST_MLP_NORM_MODEL_TYPES: tuple[str, ...] = tuple(f.model_type for f in FAMILIES if f.post_mlp_norm)
DECODER_LAYER_CLASSES: frozenset[str] = frozenset(f.decoder_layer for f in FAMILIES)
LLAMA_NORM_CLASSES: frozenset[str] = frozenset(f.llama_norm for f in FAMILIES if f.llama_norm)


def listed(model_types: tuple[str, ...]) -> str:
    """`a, b and c` for help texts and messages."""
    return model_types[0] if len(model_types) == 1 else f"{', '.join(model_types[:-1])} and {model_types[-1]}"
