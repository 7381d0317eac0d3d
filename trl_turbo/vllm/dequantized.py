"""The training model's base weights as a 16-bit copy for vLLM, where they cannot be shared.

Design decision: the copy is made from the training model's own weights, never from the checkpoint, so vLLM samples
from the weights training uses: every bitsandbytes layer (4-bit of any storage dtype, or 8-bit) is dequantized with
bitsandbytes' own functions, and everything else goes through unchanged. The state is streamed: one dequantized matrix
exists at a time, next to the copy vLLM is filling. Only bitsandbytes layers can be dequantized here; any other
quantization method is named by `unsupported_quantization`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch

from .quantized import quantized_layers, without_statistics

VLLM_COPY_DTYPE_BYTES = 2  # vLLM holds the copy in 16 bits


def unsupported_quantization(config: Mapping[str, Any]) -> str | None:
    """Why vLLM can get no 16-bit copy of a model quantized with `config` (a dict as `quantization_config_dict` gives
    it), or None when it can."""
    method = config.get("quant_method", "bitsandbytes")
    if method == "bitsandbytes":
        return None
    return (f"the model is quantized with {method!r}, and trl_turbo can share or dequantize only bitsandbytes layers; "
            "load it with bitsandbytes (`BitsAndBytesConfig(load_in_4bit=True)`) or in 16 bits")


def dequantized_weight(module: torch.nn.Module, dtype: torch.dtype) -> torch.Tensor:
    """A bitsandbytes layer's weight as the [out, in] matrix it stands for, in `dtype`."""
    from bitsandbytes.functional import dequantize_4bit, int8_vectorwise_dequant

    weight = module.weight
    if getattr(weight, "quant_state", None) is not None:
        return dequantize_4bit(weight.data, weight.quant_state).to(dtype)
    # The row scales sit on the weight until the layer's first forward moves them to its state
    scales = weight.SCB if getattr(weight, "SCB", None) is not None else module.state.SCB
    return int8_vectorwise_dequant(weight.data, scales).to(dtype)


def dequantized_state(model: torch.nn.Module, named_tensors: Iterable[tuple[str, torch.Tensor]],
                      dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    """`named_tensors` (the model's state under HF names) with every bitsandbytes weight dequantized to `dtype` when it
    is reached, and the quantization statistics bitsandbytes adds to the state left out."""
    layers = quantized_layers(model)
    for name, tensor in without_statistics(named_tensors, layers):
        layer = layers.get(name)
        yield name, tensor if layer is None else dequantized_weight(layer, dtype)


def dequantized_shape(weight: torch.Tensor) -> torch.Size:
    """The shape of the matrix a weight stands for (a 4-bit weight's data is packed)."""
    state = getattr(weight, "quant_state", None)
    return weight.shape if state is None else state.shape


def copy_bytes(model: torch.nn.Module) -> int:
    """Device bytes of vLLM's 16-bit copy of the model's frozen weights."""
    return sum(math.prod(dequantized_shape(p)) * VLLM_COPY_DTYPE_BYTES
               for p in model.parameters() if not p.requires_grad)
