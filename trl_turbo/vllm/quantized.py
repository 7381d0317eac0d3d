"""The training model's bitsandbytes 4-bit weights, as vLLM's bitsandbytes loader takes them.

Design decision: vLLM does not quantize anything itself. Its loader is fed the training model's packed 4-bit bytes
and quantization states (under HF names, as its in-flight quantizer would yield them), so vLLM's `qweight` shards
hold exactly the bytes the HF `Linear4bit` layers hold, whatever the quantization (NF4 or FP4, double quantization
or not, any block size), and the HF weights can then become views of them. The states handed over are new
`QuantState` objects over the same tensors: vLLM's loader replaces the double-quantized statistics of the states it
gets with dequantized fp32 ones (the same numbers, precomputed for speed), which must not change the training
model's own states. The engine is described to vLLM by the HF quantization config itself (`hf_overrides`), and
both sides are checked to quantize the same layers (`sharing_problems` before loading, `layout_problems` on the
loaded model). 8-bit layers and non-uint8 storage cannot be shared: vLLM cannot hold them in a layout the HF layers
could view, so vLLM gets a separate 16-bit copy of those models instead (`dequantized`, `sharing`).
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch

from .weight_views import hf_weight_name


def quantization_config_dict(quantization_config: Any) -> dict[str, Any] | None:
    """An HF quantization config (a `BitsAndBytesConfig`, its dict, or None) as a plain JSON-able dict."""
    if quantization_config is None:
        return None
    if not isinstance(quantization_config, Mapping):
        quantization_config = quantization_config.to_dict()
    plain = {}
    for key, value in quantization_config.items():
        if isinstance(value, torch.dtype):
            value = str(value).removeprefix("torch.")
        elif isinstance(value, enum.Enum):
            value = value.value  # transformers' QuantizationMethod
        plain[key] = value
    plain.setdefault("quant_method", "bitsandbytes")
    return plain


def sharing_problems(config: Mapping[str, Any]) -> list[str]:
    """Why the weights of a model quantized with `config` (a bitsandbytes config, as a dict as
    `quantization_config_dict` gives it) cannot be shared with vLLM (empty when they can)."""
    problems = []
    if config.get("load_in_8bit"):
        problems.append("8-bit bitsandbytes layers (`load_in_8bit=True`) cannot be shared; use `load_in_4bit=True`")
    elif not config.get("load_in_4bit"):
        problems.append("the bitsandbytes config loads neither 4-bit nor 8-bit weights")
    storage = str(config.get("bnb_4bit_quant_storage", "uint8")).removeprefix("torch.")
    if storage != "uint8":
        problems.append(f"`bnb_4bit_quant_storage={storage!r}`: vLLM stores 4-bit weights as uint8 only")
    if config.get("llm_int8_enable_fp32_cpu_offload"):
        problems.append("`llm_int8_enable_fp32_cpu_offload=True` keeps layers on the host, where vLLM cannot see them")
    skipped = set(config.get("llm_int8_skip_modules") or []) - {"lm_head"}
    if skipped:
        problems.append(f"`llm_int8_skip_modules={sorted(skipped)}`: transformers and vLLM match these names "
                        "differently (vLLM fuses q/k/v and gate/up), so they would quantize different layers; "
                        "leave it unset (the LM head stays 16-bit either way)")
    return problems


def compute_dtype_warning(config: Mapping[str, Any]) -> str | None:
    """vLLM's bitsandbytes layers compute in bf16 whatever the config says; a warning when training computes in
    another dtype (the sampler's log-probs then differ more from the trainer's)."""
    dtype = str(config.get("bnb_4bit_compute_dtype") or "float32").removeprefix("torch.")
    if dtype == "bfloat16":
        return None
    return (f"trl_turbo: the 4-bit layers compute in {dtype} in training (`bnb_4bit_compute_dtype`), but vLLM's "
            "bitsandbytes layers always compute in bfloat16, so sampling and training log-probs differ by more than "
            "rounding. Set `bnb_4bit_compute_dtype=torch.bfloat16` to make them agree.")


def layout_problems(model: torch.nn.Module) -> list[str]:
    """Why the layers of a loaded 4-bit model do not line up with vLLM's bitsandbytes layers (empty when they do):
    vLLM quantizes every decoder projection and never the LM head."""
    packed = four_bit_weights(model)
    if not packed:
        return []
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    head_weight = getattr(head, "weight", None)
    problems = []
    if head_weight is not None and is_packed_4bit(head_weight):
        problems.append("the LM head is 4-bit, but vLLM keeps LM heads in 16-bit (add 'lm_head' to "
                        "`llm_int8_skip_modules`)")
    unquantized = [hf_weight_name(f"{name}.weight") for name, module in model.named_modules()
                   if isinstance(module, torch.nn.Linear) and "lora_" not in name and module is not head
                   and not is_packed_4bit(module.weight) and not module.weight.requires_grad]
    if unquantized:
        problems.append(f"{len(unquantized)} projections are not 4-bit ({', '.join(unquantized[:3])}, …) among 4-bit "
                        "ones, and vLLM quantizes every projection")
    return problems


def vllm_quantization_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """The `quantization_config` vLLM's `BitsAndBytesConfig.from_config` reads: the HF one, without module names to
    skip (`sharing_problems` allows only the LM head there, which vLLM never quantizes)."""
    return {**config, "quant_method": "bitsandbytes", "llm_int8_skip_modules": []}


def is_packed_4bit(weight: torch.Tensor) -> bool:
    """A bitsandbytes `Params4bit` that holds packed 4-bit data (not yet-to-be-quantized 16-bit values)."""
    return getattr(weight, "quant_state", None) is not None and weight.dtype == torch.uint8


def _is_int8(weight: torch.Tensor) -> bool:
    # bitsandbytes' Int8Params with quantized data (has_fp16_weights=True keeps 16-bit data, used as it is)
    return weight.dtype == torch.int8 and hasattr(weight, "SCB")


def _is_quantized(module: torch.nn.Module) -> bool:
    weight = getattr(module, "weight", None)
    return weight is not None and (getattr(weight, "quant_state", None) is not None or _is_int8(weight))


def quantized_layers(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """The bitsandbytes-quantized layers of an HF model (PEFT-wrapped or not; 4-bit of any storage or 8-bit), by the
    plain HF name of their weight."""
    return {hf_weight_name(f"{name}.weight"): module for name, module in model.named_modules()
            if "lora_" not in name and _is_quantized(module)}


def four_bit_weights(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    """The packed 4-bit weights of an HF model (PEFT-wrapped or not), by plain HF name."""
    return {name: layer.weight for name, layer in quantized_layers(model).items() if is_packed_4bit(layer.weight)}


def state_for_vllm(quant_state: Any) -> Any:
    """A new `QuantState` over the same tensors (vLLM may rebind its fields; the training model's state stays)."""
    from bitsandbytes.functional import QuantState

    return QuantState(absmax=quant_state.absmax, shape=quant_state.shape, code=quant_state.code,
                      blocksize=quant_state.blocksize, quant_type=quant_state.quant_type, dtype=quant_state.dtype,
                      offset=quant_state.offset, state2=quant_state.state2)


def weights_for_vllm(model: torch.nn.Module, named_tensors: Iterable[tuple[str, torch.Tensor]]
                     ) -> tuple[Iterator[tuple[str, torch.Tensor]], dict[str, Any]]:
    """What vLLM's bitsandbytes loader expects from its weight iterator: (HF name, tensor) pairs, packed bytes for
    4-bit weights, and the quantization state of each 4-bit weight by HF name. `named_tensors` is the model's
    state under HF names; the quantization statistics bitsandbytes adds to it (`<weight>.absmax`, …) are left out,
    since they travel as states."""
    packed = four_bit_weights(model)
    states = {name: state_for_vllm(weight.quant_state) for name, weight in packed.items()}
    return without_statistics(named_tensors, packed), states


def without_statistics(named_tensors: Iterable[tuple[str, torch.Tensor]], weight_names: Iterable[str]
                       ) -> Iterator[tuple[str, torch.Tensor]]:
    """`named_tensors` (a state under HF names) without the quantization statistics bitsandbytes adds next to each
    of the quantized weights `weight_names` (`<weight>.absmax`, `.quant_map`, `.nested_*`, `.quant_state.*` for
    4-bit, `<layer>.SCB` and `<layer>.weight_format` for 8-bit): every name under the layer but its weight and bias."""
    layers = [name.removesuffix(".weight") for name in weight_names]
    prefixes = tuple(f"{layer}." for layer in layers)
    kept = {f"{layer}.{leaf}" for layer in layers for leaf in ("weight", "bias")}
    for name, tensor in named_tensors:
        if name in kept or not name.startswith(prefixes):
            yield name, tensor


def dequantized_absmax(quant_state: Any) -> torch.Tensor:
    """The per-block scales of a state, double quantization undone (fp32)."""
    if not getattr(quant_state, "nested", False):
        return quant_state.absmax.float()
    from bitsandbytes.functional import dequantize_blockwise

    return (dequantize_blockwise(quant_state.absmax, quant_state.state2) + quant_state.offset).float()


def same_quantization(ours: Any, theirs: Any) -> bool:
    """Whether two states dequantize the same bytes to the same values."""
    return (tuple(ours.shape) == tuple(theirs.shape) and ours.blocksize == theirs.blocksize
            and ours.quant_type == theirs.quant_type and ours.dtype == theirs.dtype
            and torch.equal(ours.code.to(theirs.code.device), theirs.code)
            and torch.equal(dequantized_absmax(ours).to(theirs.absmax.device), dequantized_absmax(theirs)))


def statistics_bytes(model: torch.nn.Module, shared: bool = True) -> int:
    """Bytes of the fp32 per-block scales vLLM holds beyond the training model's tensors: with `shared` weights, for
    double-quantized 4-bit weights only (it undoes double quantization; single-quantized weights' scales are shared
    as they are); in its own copy, for every 4-bit weight."""
    return sum(weight.quant_state.absmax.numel() * 4 for weight in four_bit_weights(model).values()
               if not shared or getattr(weight.quant_state, "nested", False))
