"""A random-init checkpoint written one decoder layer at a time: 16-bit, or already quantized (bitsandbytes NF4).

Design decision: building the whole model and saving it needs the whole 16-bit model on one device: 141 GB for a
70B shape, more than an H100 holds, and for a 4-bit run more than the GPU machine's disk would take beside it. Here
the model exists only on the meta device; each decoder layer in turn is materialised on the device, initialised by
the model's own `_init_weights` (as `from_config` would), written into the current shard (its linear weights
quantized by bitsandbytes, for a 4-bit checkpoint) and dropped. The files are what transformers' `save_pretrained`
writes (for a 4-bit model: the packed weight plus its quantization state under `<weight>.<key>`, and
`quantization_config` in config.json), so transformers and vLLM load them as they would its own. Embeddings, norms
and the LM head stay 16-bit.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

SHARD_BYTES = 4 * 2**30


class _ShardWriter:
    """Collects tensors and writes `model-XXXXX-of-YYYYY.safetensors` shards plus their index."""

    def __init__(self, path: Path, shard_bytes: int) -> None:
        self.path, self.shard_bytes = path, shard_bytes
        self.pending: dict[str, torch.Tensor] = {}
        self.pending_bytes = 0
        self.shards: list[list[str]] = []
        self.total_bytes = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        tensor = tensor.detach().to("cpu").contiguous()
        self.pending[name] = tensor
        self.pending_bytes += tensor.numel() * tensor.element_size()
        self.total_bytes += tensor.numel() * tensor.element_size()
        if self.pending_bytes >= self.shard_bytes:
            self.flush()

    def flush(self) -> None:
        from safetensors.torch import save_file

        if not self.pending:
            return
        save_file(self.pending, self.path / f"part-{len(self.shards):05d}.safetensors", metadata={"format": "pt"})
        self.shards.append(sorted(self.pending))
        self.pending, self.pending_bytes = {}, 0

    def close(self) -> None:
        self.flush()
        weight_map = {}
        for index, names in enumerate(self.shards):
            final = f"model-{index + 1:05d}-of-{len(self.shards):05d}.safetensors"
            (self.path / f"part-{index:05d}.safetensors").rename(self.path / final)
            weight_map.update({name: final for name in names})
        index = {"metadata": {"total_size": self.total_bytes}, "weight_map": dict(sorted(weight_map.items()))}
        (self.path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def _materialise(module: torch.nn.Module, model: Any, device: str | torch.device) -> torch.nn.Module:
    module.to_empty(device=device)
    module.apply(model._init_weights)
    return module


def _write_layer(writer: _ShardWriter, prefix: str, layer: torch.nn.Module,
                 quantization: dict[str, Any] | None) -> None:
    """Write a decoder layer's parameters under `prefix`, its Linear weights as bitsandbytes 4-bit with a
    `quantization`."""
    linear_weights = ({f"{name}.weight" for name, child in layer.named_modules() if isinstance(child, torch.nn.Linear)}
                      if quantization else set())
    for name, param in layer.named_parameters():
        if name in linear_weights:
            import bitsandbytes.functional as bnb_functional

            packed, state = bnb_functional.quantize_4bit(
                param.data, quant_type=quantization["bnb_4bit_quant_type"],
                compress_statistics=quantization.get("bnb_4bit_use_double_quant", False), quant_storage=torch.uint8)
            writer.add(f"{prefix}{name}", packed)
            for key, value in state.as_dict(packed=True).items():
                writer.add(f"{prefix}{name}.{key}", value)
        else:
            writer.add(f"{prefix}{name}", param.data)


def save_layerwise_checkpoint(config: Any, path: Path, seed: int, device: str | torch.device,
                              quantization: dict[str, Any] | None = None, shard_bytes: int = SHARD_BYTES) -> None:
    """Save a random-init bf16 model of `config` to `path` without ever holding more than one decoder layer, its
    decoder layers' linear weights quantized as `quantization` (`BitsAndBytesConfig` arguments with `load_in_4bit`)
    if given."""
    import copy

    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    config = copy.deepcopy(config)  # the caller's config stays unquantized
    path.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    decoder = model.get_decoder()
    layers_name = next(name for name, module in model.named_modules() if module is decoder.layers)
    writer = _ShardWriter(path, shard_bytes)
    for index, layer in enumerate(decoder.layers):
        _write_layer(writer, f"{layers_name}.{index}.", _materialise(layer, model, device), quantization)
        layer.to("meta")  # dropped before the next layer is built
    # The modules holding parameters of their own outside the layers: embeddings, final norm, an untied LM head
    for name, module in model.named_modules():
        if (name == layers_name or name.startswith(layers_name + ".")
                or not list(module.parameters(recurse=False))):
            continue
        if model.config.tie_word_embeddings and module is model.get_output_embeddings():
            continue  # tied: the input embedding's weight is the only copy, as save_pretrained writes it
        _materialise(module, model, device)
        for param_name, param in module.named_parameters(recurse=False):
            writer.add(f"{name}.{param_name}" if name else param_name, param.data)
        module.to("meta")
    writer.close()
    config = model.config
    config.architectures = [type(model).__name__]  # what save_pretrained records; vLLM picks its model class by it
    if quantization:
        config.quantization_config = BitsAndBytesConfig(**quantization).to_dict()
    config.save_pretrained(path)
