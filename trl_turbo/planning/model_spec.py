"""What the memory forecast needs to know about a model, read from its config on the meta device (no weights).

Design decision: the numbers come from instantiating the model class with `torch.device("meta")`, so every family
transformers knows is counted exactly (tied embeddings, extra norms, biases), and the shape-level quantities the
activation model uses (hidden size, attention and MLP widths, norms per layer) are read from the same instance.
A config is found from a bench shape name, a local directory or `config.json`, or a hub id (which needs network).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

# bitsandbytes 4-bit storage per weight: 4 bits and a block scale per 64 weights, fp32 or, double-quantized
# (`use_bnb_nested_quant`), 8-bit with an fp32 scale of those per 256 blocks. vLLM undoes double quantization: its
# copy of each block scale is fp32 (`vllm.quantized.statistics_bytes`).
FP32_SCALE_BYTES_PER_WEIGHT = 4 / 64
NESTED_SCALE_BYTES_PER_WEIGHT = 1 / 64 + 4 / (64 * 256)


def four_bit_bytes_per_weight(nested: bool) -> float:
    return 0.5 + (NESTED_SCALE_BYTES_PER_WEIGHT if nested else FP32_SCALE_BYTES_PER_WEIGHT)


@dataclass(frozen=True)
class ModelSpec:
    model_type: str
    hidden_size: int
    layers: int
    intermediate_size: int
    vocab_size: int
    query_width: int  # attention heads x head dim
    key_value_width: int  # key/value heads x head dim
    norms_per_layer: int  # hidden-size norms in one decoder layer
    parameters: int
    layer_linear_parameters: int  # weights of the decoder layers' linear modules (what 4-bit loading quantizes)
    lora_parameters: int  # trainable adapter parameters (0 without an adapter)
    adapted_parameters: int  # weights of the linear modules the adapter is on
    head_dim: int
    key_value_heads: int
    max_position_embeddings: int
    root_parameters: int = 0  # outside every layer stack: embeddings, an untied LM head, final norms (FSDP2's root)

    def weight_bytes(self, quantized_4bit: bool, nested_4bit: bool = True) -> int:
        """The frozen base weights in 16-bit, or with the layers' linear weights in 4-bit (`nested_4bit`: their block
        scales double-quantized)."""
        if not quantized_4bit:
            return 2 * self.parameters
        rest = self.parameters - self.layer_linear_parameters
        return int(2 * rest + four_bit_bytes_per_weight(nested_4bit) * self.layer_linear_parameters)

    def vllm_undone_scale_bytes(self) -> int:
        """The fp32 block scales vLLM computes beside packed 4-bit bytes it shares when they are double-quantized."""
        return int(FP32_SCALE_BYTES_PER_WEIGHT * self.layer_linear_parameters)


def load_config(model: str) -> Any:
    """A transformers config from a bench shape name, a directory or config.json path, or a hub id."""
    from transformers import AutoConfig

    from .shapes import SHAPES, build_config

    if model in SHAPES:
        return build_config(model)
    path = Path(model)
    if path.is_file():
        params = json.loads(path.read_text())
        return AutoConfig.for_model(params.pop("model_type"), **params)
    return AutoConfig.from_pretrained(model)


def _matches(name: str, targets: str | list[str] | None) -> bool:
    if targets in (None, "all-linear"):
        return True
    if isinstance(targets, str):
        import re

        return re.fullmatch(targets, name) is not None
    return name.split(".")[-1] in targets


def model_spec(config: Any, lora_r: int | None = None,
               lora_targets: str | list[str] | None = "all-linear") -> ModelSpec:
    """Count the model of `config` on the meta device; `lora_r` adapters on the decoder layers' linear modules that
    `lora_targets` names ("all-linear", a list of module names, or a regex), as PEFT would attach them."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    text = config.get_text_config()
    layers = next(m for m in model.modules() if isinstance(m, torch.nn.ModuleList))
    layer_linear = lora = adapted = 0
    for layer in layers:
        for name, module in layer.named_modules():
            if isinstance(module, torch.nn.Linear):
                layer_linear += module.weight.numel()
                if lora_r and _matches(name, lora_targets):
                    lora += lora_r * (module.in_features + module.out_features)
                    adapted += module.weight.numel()
    stacked = {id(p) for stack in model.modules() if isinstance(stack, torch.nn.ModuleList)
               for p in stack.parameters()}
    hidden = text.hidden_size
    norms = sum(1 for m in layers[0].modules()
                if "norm" in type(m).__name__.lower() and getattr(m, "weight", None) is not None
                and m.weight.numel() == hidden)
    head_dim = getattr(text, "head_dim", None) or hidden // text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    return ModelSpec(
        model_type=text.model_type, hidden_size=hidden, layers=len(layers), intermediate_size=text.intermediate_size,
        vocab_size=text.vocab_size, query_width=text.num_attention_heads * head_dim,
        key_value_width=kv_heads * head_dim,
        norms_per_layer=norms, parameters=sum(p.numel() for p in model.parameters()),
        layer_linear_parameters=layer_linear, lora_parameters=lora, adapted_parameters=adapted, head_dim=head_dim,
        key_value_heads=kv_heads,
        max_position_embeddings=getattr(text, "max_position_embeddings", 0) or 0,
        root_parameters=sum(p.numel() for p in model.parameters() if id(p) not in stacked),
    )
