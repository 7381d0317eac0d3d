"""Putting offloaded checkpointing, tiled MLPs, lean norms and Liger's layers on a transformers model, and taking
them off again (`detach_model`).

Design decision: every installation is per module instance and goes through `trl_turbo.registry` (held weakly), so
`trl_turbo.unpatch()` undoes it and two models in one process never share state: the model's `CheckpointingRuntime`
(`_trl_turbo_checkpointing`), the decoder layers' checkpoint functions (`_gradient_checkpointing_func`, only for the
dense families in `families.DECODER_LAYER_CLASSES`), the MLPs' and RMSNorms' forwards. The seam that keeps the
checkpoint functions in place across transformers' re-enables is `patches.transformers_checkpointing`; the
GRPOTrainer side that decides what to install is `patches.trl_checkpointing`.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .. import registry
from ..families import DECODER_LAYER_CLASSES, LLAMA_NORM_CLASSES
from ..sharding.fsdp_modules import own_class_name
from .checkpoint import CheckpointOffloader, offloaded_checkpoint
from .lean_norm import LeanRMSNormForward
from .memory_plan import MemoryPlanner, head_weight_gradient_bytes, planned_checkpoint
from .tiled_mlp import TiledMLPForward

_MLP_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
_SILU_CLASSES = frozenset({"SiLU", "SiLUActivation"})  # the MLPs Liger's SwiGLU computes exactly
# Decoder layers that trl_turbo's checkpoint function and tiled MLP apply to (`families.DECODER_LAYER_CLASSES`): the
# dense families the parity tests train. Their layers take no keyword tensor that needs a gradient and capture nothing
# through hooks (MoE router logits would be), their MLPs act per token, and their MLP output feeds the residual sum
# directly except where a `post_feedforward_layernorm` follows it. Other layers keep transformers' checkpointing and
# their plain MLP. RMSNorm classes in `families.LLAMA_NORM_CLASSES` are checked against their originals by the tests.
_configured: weakref.WeakSet = weakref.WeakSet()


@dataclass
class CheckpointingRuntime:
    """What a model's checkpointed layers use: the offloader (None: inputs stay on the device), the memory planner
    (None: every layer checkpoints) and, per layer, the checkpoint function (each routes its own layer's trainable
    parameters; see `offload.checkpoint`)."""

    offloader: CheckpointOffloader | None
    planner: MemoryPlanner | None = None

    def __post_init__(self) -> None:
        self._functions: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._indices: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def number_layers(self, layers: list[torch.nn.Module]) -> None:
        """The decoder layers in forward order (the planner measures at the first and plans by position)."""
        for index, layer in enumerate(layers):
            self._indices[layer] = index

    def checkpoint_for(self, layer: torch.nn.Module):
        """The checkpoint function of `layer` (the same object on every call)."""
        if layer not in self._functions:
            offloaded = offloaded_checkpoint(self.offloader, layer)
            if self.planner is not None and layer in self._indices:
                offloaded = planned_checkpoint(self.planner, self._indices[layer], offloaded,
                                               offloaded_checkpoint(None, layer))
            self._functions[layer] = offloaded
        return self._functions[layer]


def _decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The checkpointed layers of `model` that trl_turbo's features apply to (`DECODER_LAYER_CLASSES`)."""
    return [m for m in _checkpointed_layers(model) if own_class_name(m) in DECODER_LAYER_CLASSES]


def _checkpointed_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    from transformers.modeling_layers import GradientCheckpointingLayer

    return [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]


def memory_planner(model: torch.nn.Module, can_offload: bool) -> MemoryPlanner:
    """A planner for `model`'s decoder layers (`turbo_memory_plan="auto"`); `can_offload`: an offloader exists."""
    model_ref = weakref.ref(model)

    def parameters():
        live = model_ref()
        return live.parameters() if live is not None else iter(())

    layers = _decoder_layers(model)
    # the tiled MLP runs a post-MLP-norm layer's recompute untiled under "auto" (`offload.tiled_mlp`)
    untiled = any(hasattr(layer, "post_feedforward_layernorm") for layer in layers)
    hidden_size, element_size = _layer_input(model)
    return MemoryPlanner(layer_count=len(layers), parameters=parameters, can_offload=can_offload,
                         untiled_recompute=untiled, hidden_size=hidden_size, hidden_element_size=element_size,
                         head_gradient_bytes=_head_gradient_bytes(model))


def _head_gradient_bytes(model: torch.nn.Module) -> int:
    """`head_weight_gradient_bytes` of `model`'s LM head where it trains (its whole weight: under FSDP2 the head is
    gathered for the loss), else 0."""
    weight = _embedding_weight(model, "get_output_embeddings")
    if weight is None or not weight.requires_grad or weight.dim() != 2:
        return 0
    vocab_size, hidden_size = weight.shape  # a DTensor's shape is whole
    # returned in the compute dtype: 16 bits, fp32 masters included (FSDP2's mixed precision gathers them in bf16)
    return head_weight_gradient_bytes(vocab_size, hidden_size, min(weight.element_size(), 2))


def _layer_input(model: torch.nn.Module) -> tuple[int, int]:
    """(hidden size, element size) of a decoder layer's input as the model's config and input embeddings give them;
    (0, 2) where they do not say (the planner then waits for its first forward to see one)."""
    try:
        config = model.config
        text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
        hidden_size = int(getattr(text_config, "hidden_size", 0) or 0)
    except (AttributeError, ValueError, TypeError):
        hidden_size = 0
    weight = _embedding_weight(model, "get_input_embeddings")
    return hidden_size, weight.element_size() if weight is not None else 2


def _embedding_weight(model: torch.nn.Module, getter: str) -> torch.Tensor | None:
    """The weight of the embedding `model.<getter>()` returns (`get_input_embeddings`, `get_output_embeddings`), or
    None where the model has none."""
    try:
        weight = getattr(getattr(model, getter)(), "weight", None)
    except (AttributeError, NotImplementedError):
        return None
    return weight if isinstance(weight, torch.Tensor) else None


RUNTIME_ATTRIBUTE = "_trl_turbo_checkpointing"


def runtime_of(model: torch.nn.Module | None) -> CheckpointingRuntime | None:
    """The checkpointing runtime installed on `model` (PEFT-wrapped or not; None: transformers' checkpointing)."""
    get_base_model = getattr(model, "get_base_model", None)
    base = get_base_model() if callable(get_base_model) else model
    return getattr(base, RUNTIME_ATTRIBUTE, None)


def install_runtime(model: torch.nn.Module, runtime: CheckpointingRuntime) -> None:
    """Attach `runtime` to `model` (through the registry, replacing an earlier runtime; `trl_turbo.unpatch()` and
    `detach_model` take it off); its checkpointed layers use it now and after every later enable."""
    registry.replace_attr(model, RUNTIME_ATTRIBUTE, runtime, weak=True)
    runtime.number_layers(_decoder_layers(model))
    _configured.add(model)
    use_runtime_in_layers(model, runtime)


def use_runtime_in_layers(model: torch.nn.Module, runtime: CheckpointingRuntime) -> None:
    """Give each checkpointed decoder layer of the tested families its checkpoint function from `runtime` (through the
    registry: `trl_turbo.unpatch()` and `detach_model` put transformers' back). Called again after every enable,
    which makes transformers set its own function on each layer anew."""
    for layer in _decoder_layers(model):
        current = layer.__dict__.get("_gradient_checkpointing_func")
        ours = runtime.checkpoint_for(layer)
        if current is None or current is ours:
            continue
        registry.replace_attr(layer, "_gradient_checkpointing_func", ours, weak=True)


def _llama_norms(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The Llama-style RMSNorms of `model` (the classes in `LLAMA_NORM_CLASSES`)."""
    return [m for m in model.modules() if own_class_name(m) in LLAMA_NORM_CLASSES and hasattr(m, "variance_epsilon")]


def _gated_mlps(model: torch.nn.Module) -> list[tuple[torch.nn.Module, torch.nn.Module]]:
    """(decoder layer, MLP) for every decoder layer whose MLP has gate/up/down projections."""
    pairs = [(layer, getattr(layer, "mlp", None)) for layer in _decoder_layers(model)]
    return [(layer, mlp) for layer, mlp in pairs
            if mlp is not None and all(hasattr(mlp, name) for name in _MLP_PROJECTIONS)]


def _install_norm_forward(model: torch.nn.Module, forward_cls: type) -> int:
    """Give every Llama-style RMSNorm a `forward_cls(module)` forward (replacing another of ours); returns the count."""
    norms = _llama_norms(model)
    for module in norms:
        if not isinstance(module.__dict__.get("forward"), forward_cls):
            registry.replace_attr(module, "forward", forward_cls(module), weak=True)
    return len(norms)


def install_tiled_mlp(model: torch.nn.Module, tile_tokens: int | None,
                      untile_post_norm: Callable[[], bool] | None = None) -> int:
    """Tile every dense gated MLP of `model`'s decoder layers (`tile_tokens=None`: only the kept layers' lean gated
    product; `untile_post_norm`: while it returns True, MLPs followed by a norm run untiled where that fits, see
    `offload.tiled_mlp`; idempotent; `trl_turbo.unpatch()` undoes it)."""
    mlps = _gated_mlps(model)
    for layer, mlp in mlps:
        current = mlp.__dict__.get("forward")
        if isinstance(current, TiledMLPForward):
            current.tile_tokens, current.untile_post_norm = tile_tokens, untile_post_norm
        else:
            feeds_residual = not hasattr(layer, "post_feedforward_layernorm")
            # Wraps whatever forward the MLP has now (Liger's, when installed first)
            registry.replace_attr(mlp, "forward", TiledMLPForward(mlp, tile_tokens, feeds_residual,
                                                                  untile_post_norm=untile_post_norm), weak=True)
    return len(mlps)


def install_liger_layers(model: torch.nn.Module) -> int:
    """Route every Llama-style RMSNorm and gated-SiLU MLP of `model` through Liger's kernels (idempotent;
    `trl_turbo.unpatch()` undoes it). Install before the tiled MLP, which then tiles the Liger forward."""
    from ..ops.liger_layers import LigerRMSNormForward, LigerSwiGLUForward

    count = _install_norm_forward(model, LigerRMSNormForward)
    for _, mlp in _gated_mlps(model):
        if type(getattr(mlp, "act_fn", None)).__name__ not in _SILU_CLASSES:
            continue
        current = mlp.__dict__.get("forward")
        if isinstance(current, TiledMLPForward):  # tiled by an earlier trainer: Liger goes inside the tiles
            if not isinstance(current.original, LigerSwiGLUForward):
                current.original = LigerSwiGLUForward(mlp)
        elif not isinstance(current, LigerSwiGLUForward):
            registry.replace_attr(mlp, "forward", LigerSwiGLUForward(mlp), weak=True)
        count += 1
    return count


def install_lean_norms(model: torch.nn.Module) -> int:
    """Give every Llama-style RMSNorm of `model` the lean backward (idempotent; `trl_turbo.unpatch()` undoes it)."""
    return _install_norm_forward(model, LeanRMSNormForward)


def detach_model(model: torch.nn.Module) -> None:
    """Undo every trl_turbo installation on `model`: its layers' checkpoint functions (back to transformers'), the
    runtime, and the module forwards of tiled MLPs, lean or Liger norms and Liger MLPs. A trainer built on a model an
    earlier trainer configured starts from here, so it gets exactly what its own config asks for."""
    from ..ops.liger_layers import LigerRMSNormForward, LigerSwiGLUForward

    for layer in _checkpointed_layers(model):
        registry.restore_attr(layer, "_gradient_checkpointing_func")
    registry.restore_attr(model, RUNTIME_ATTRIBUTE)
    _configured.discard(model)
    ours = (TiledMLPForward, LeanRMSNormForward, LigerRMSNormForward, LigerSwiGLUForward)
    for module in model.modules():
        if isinstance(module.__dict__.get("forward"), ours):
            registry.restore_attr(module, "forward")


def detach_all_models() -> None:
    """On unpatch: configured models go back to the checkpoint function transformers gave them."""
    for model in list(_configured):
        detach_model(model)
