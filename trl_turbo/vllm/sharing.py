"""Whether vLLM shares the training model's base weights or holds a separate 16-bit copy of them.

Design decision: with `turbo_vllm_shared_weights`, a model whose weights vLLM cannot hold in a layout the training
model could view (a model type whose layout trl_turbo does not map, 8-bit or non-uint8 4-bit bitsandbytes layers,
layers transformers and vLLM would quantize differently, 4-bit weights on a vLLM without its bitsandbytes loader) is
not refused: vLLM holds a separate 16-bit copy of the base weights, made from the training model's own weights
(dequantized where quantized), and the adapter still goes to vLLM as tensors. The reasons the config shows are named
once when the trainer is built, before the model loads (`copy_reasons`, a warning), and the mode is decided once per
engine from the loaded model and its config (`sharing_for`, called by the engine plan), so every rank of a multi-GPU
run decides alike. What a copy cannot serve stays an error: a quantization method other than bitsandbytes
(nothing here can dequantize it).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..config import StrEnum
from ..families import SHARED_WEIGHT_MODEL_TYPES
from ..vllm_contract import SHARED_4BIT, installed_verdict
from .dequantized import unsupported_quantization
from .quantized import layout_problems, quantization_config_dict, sharing_problems


class SharingMode(StrEnum):
    SHARED = "shared"
    COPY = "copy"


SHARED, COPY = SharingMode.SHARED, SharingMode.COPY


@dataclass(frozen=True)
class Sharing:
    """How one engine holds the base weights: shared, or a separate copy when there are `reasons`."""

    reasons: tuple[str, ...] = ()  # why the weights cannot be shared
    unforeseen: tuple[str, ...] = ()  # those only the loaded model shows (config time could not name them)

    @property
    def mode(self) -> SharingMode:
        return COPY if self.reasons else SHARED


def copy_reasons(quantization: Mapping[str, Any] | None, model_type: str | None, *,
                 installed: bool = True) -> list[str]:
    """Why a model of `model_type` quantized with `quantization` (None: 16-bit) cannot share its base weights with
    vLLM (empty: it can), the installed vLLM's abilities included unless `installed=False` (a forecast for another
    machine). Raises ValueError for a model no copy can serve."""
    reasons = []
    if quantization is not None:
        problem = unsupported_quantization(quantization)
        if problem is not None:
            raise ValueError(f"`turbo_vllm_shared_weights=True` can neither share nor copy this model's weights: "
                             f"{problem}; or set `turbo_vllm_shared_weights=False`.")
        reasons += sharing_problems(quantization)
        lost = installed_verdict().why_unavailable(SHARED_4BIT) if installed else None
        if not reasons and lost is not None:
            reasons.append(f"this vLLM cannot load 4-bit weights ({lost})")
    if model_type is not None and model_type not in SHARED_WEIGHT_MODEL_TYPES:
        reasons.append(f"the model type {model_type!r} is not one whose vLLM layout trl_turbo maps "
                       f"({', '.join(SHARED_WEIGHT_MODEL_TYPES)})")
    return reasons


def sharing_mode(model: torch.nn.Module) -> Sharing:
    """The mode of an engine for a loaded model (PEFT-wrapped or not)."""
    quantization = quantization_config_dict(getattr(model.config, "quantization_config", None))
    layout = layout_problems(model) if quantization is not None else []
    return sharing_for(quantization, getattr(model.config, "model_type", None), layout)


def sharing_for(quantization: Mapping[str, Any] | None, model_type: str | None, layout: Sequence[str], *,
                installed: bool = True) -> Sharing:
    """The mode of an engine: what `copy_reasons` names from the config, and `layout`, the 4-bit layers of the loaded
    model that would not line up with vLLM's."""
    foreseen = copy_reasons(quantization, model_type, installed=installed)
    unforeseen = list(layout) if quantization is not None and not foreseen else []
    return Sharing(tuple(foreseen + unforeseen), tuple(unforeseen))


def fallback_warning(reasons: Sequence[str], quantized: bool) -> str:
    """The warning that names why vLLM holds a separate copy, what it costs, and how to get one copy."""
    source = ("dequantized from the training model's own quantized weights, so vLLM samples from exactly the weights "
              "training uses" if quantized else "loaded from the training model's own weights")
    return (f"trl_turbo: `turbo_vllm_shared_weights=True` cannot share the base weights with vLLM here: "
            f"{'; '.join(reasons)}. vLLM will hold a separate 16-bit copy of the base weights instead ({source}), "
            "about 2 bytes per base parameter of extra device memory; the LoRA adapter still goes to vLLM as tensors "
            "(no merge). For one copy: a 16-bit model or a bitsandbytes `load_in_4bit=True` one (uint8 storage, no "
            "fp32 CPU offload, `llm_int8_skip_modules` unset), of a model type among "
            f"{', '.join(SHARED_WEIGHT_MODEL_TYPES)}.")
