"""Sequence-tiled MLP: a decoder layer's MLP computed over token tiles, so its working set is one tile's.

Design: the dense gated MLPs of llama, qwen2/3, mistral and gemma act on each token independently. An autograd
Function runs the MLP tile by tile without keeping a graph and saves only its input. Its backward pass recomputes one
tile at a time with grad and backpropagates through it, summing the parameters' (LoRA's) gradients over tiles and
returning them once, so each parameter gets exactly one gradient per backward pass (as DDP requires). The
[tokens, intermediate] activations (3.5× the hidden size, several of them) therefore exist for one tile only, not for
the whole micro-batch. Gradients equal the plain MLP's up to float reassociation of the per-tile sums, which are
accumulated in fp32 and rounded once. Parameters kept in bf16 (TRL's QLoRA casts LoRA weights to bf16) still round
each tile's partial gradient inside its matmul: there, tiled and untiled gradients differ by a few bf16 ulps. The
MLPs of bitsandbytes-quantized models run their forward tiles with autograd recording (one tile's graph at a time),
because bitsandbytes picks a differently-rounding kernel for no-grad calls. Their 4-bit weights are dequantized once
per tile loop (`ops.dequantized_linear`), not once per tile and call, where the dequantized matrices take at most
`DEQUANTIZED_FREE_SHARE` of the free device memory; otherwise each call dequantizes as bitsandbytes does.

Under trl_turbo's gradient checkpointing, the layer's recompute (`is_recomputing()`) only builds the graph for the
backward pass; its output values are never read. Where the MLP output feeds the residual sum directly (no norm after
it), the tiled MLP then skips its forward computation. The MLP runs forward twice per step, as with plain
checkpointing, rather than three times. Layers with a post-MLP norm (gemma2/3) compute it, so tiling costs them a third
MLP pass (1.20x a Gemma-2-9B step under "min"). Under the "auto" memory plan, whose reserve holds one layer's untiled
backward working set wherever the plan keeps a layer (`untile_post_norm`, the planner's `keeps_layers`), such an MLP
therefore runs untiled there if its whole working set fits in the free share below; tiles remain for what does not
fit, for a plan that keeps nothing and for every MLP under "min".

In a layer whose activations the memory plan keeps (`memory_plan.in_kept_layer`) the MLP runs untiled: there is no
recompute whose working set tiling would bound. It runs its gated product through `ops.gated_product` there, so the
layer's saved-tensor hooks (`offload.lean_activations`) store neither the activation's output nor the product.
The same forward is installed without tiles (`tile_tokens=None`) where the memory plan is "auto" but tiling is off.

The tile is `turbo_tiled_mlp_tokens` unless the device is short of it: where half the memory a plan could still
take (`device_memory.device_budget`) would not hold a tile's working set (about `MLP_WORKING_TENSORS`
intermediate-size tensors per token: the gate, up, activation and product, and their gradients in the backward pass),
the tile shrinks to a power of two that fits, down to `MIN_TILE_TOKENS`. On a large GPU nothing changes; on a 5 GiB
one the untiled MLP of 8 x 1088 tokens (1.2 GiB for Qwen2.5-1.5B) is what did not fit.

An MLP with active dropout modules (LoRA's `lora_dropout` > 0 in training) runs untiled: a tile recomputed in the
backward pass would draw other dropout masks than its forward did.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext

import torch

from ..device_memory import device_budget
from ..ops.autocast_state import autocast_state, restored_autocast
from ..ops.dequantized_linear import dequantized_bytes, dequantized_once
from ..ops.gated_product import can_run_gated, gated_product
from .checkpoint import _force_grad_leaf, is_recomputing
from .memory_plan import in_kept_layer

MLP_WORKING_TENSORS = 8
MIN_TILE_TOKENS = 256
# The share of the free memory one tile's working set may take (the rest: the layer's attention part, the margin)
TILE_FREE_SHARE = 0.5
# The share of the free memory a quantized MLP's dequantized weights may take for a tile loop (else per call)
DEQUANTIZED_FREE_SHARE = 0.25


def free_device_bytes(device: torch.device) -> int | None:
    """What a plan could still take on `device` (None where there is no CUDA device to ask)."""
    return device_budget(device)[0] if device.type == "cuda" else None


def fitting_tile_tokens(tile_tokens: int, tokens: int, per_token_bytes: int, free_bytes: int | None) -> int:
    """`tile_tokens`, or where `min(tokens, tile_tokens)` tokens' working set (`per_token_bytes` each) would take more
    than `TILE_FREE_SHARE` of `free_bytes`: the largest power of two that fits, at least `MIN_TILE_TOKENS` and never
    more than `tile_tokens`."""
    if free_bytes is None or per_token_bytes <= 0:
        return tile_tokens
    fitting = int(TILE_FREE_SHARE * max(free_bytes, 0)) // per_token_bytes
    if fitting >= min(tokens, tile_tokens):
        return tile_tokens
    tile = MIN_TILE_TOKENS
    while tile * 2 <= fitting:
        tile *= 2
    return min(tile, tile_tokens)


def tile_spans(tokens: int, tile_tokens: int) -> list[tuple[int, int]]:
    """`[start, end)` token ranges of at most `tile_tokens`, covering `tokens`."""
    return [(start, min(start + tile_tokens, tokens)) for start in range(0, tokens, tile_tokens)]


def forward_tiles(mlp_forward: Callable, x: torch.Tensor, tile_tokens: int, grad_path: bool,
                  weights_scope: Callable[[], AbstractContextManager] = nullcontext) -> torch.Tensor:
    """The MLP's output for `x`, computed tile by tile without keeping a graph. `grad_path`: quantized layers that
    pick another kernel without autograd run each tile as the untiled MLP runs in training (a graph for one tile at
    a time, dropped at once), so the values are the same as without tiles. `weights_scope()` is entered around the
    tiles (quantized weights dequantized once)."""
    flat = x.reshape(-1, x.shape[-1])
    spans = tile_spans(flat.shape[0], tile_tokens)
    if grad_path:
        with torch.enable_grad(), weights_scope():
            out = torch.cat([mlp_forward(flat[start:end].detach().requires_grad_()).detach() for start, end in spans])
    else:
        with torch.no_grad():
            out = torch.cat([mlp_forward(flat[start:end]) for start, end in spans])
    return out.view(*x.shape[:-1], out.shape[-1])


class _TiledMLP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, mlp_forward: Callable, tile_tokens: int, output_unused: bool, grad_path: bool,
                weights_scope: Callable[[], AbstractContextManager], _force_grad: torch.Tensor, x: torch.Tensor,
                *params: torch.Tensor) -> torch.Tensor:
        ctx.mlp_forward, ctx.tile_tokens, ctx.weights_scope = mlp_forward, tile_tokens, weights_scope
        ctx.autocast = autocast_state()
        ctx.x_requires_grad = x.requires_grad
        ctx.save_for_backward(x, *params)
        if output_unused:
            return torch.empty_like(x)
        return forward_tiles(mlp_forward, x, tile_tokens, grad_path, weights_scope)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        # Parameter gradients are summed over tiles here and returned once, as a plain MLP's would be: gradients
        # accumulated into `.grad` tile by tile would mark each parameter ready several times (DDP refuses that).
        x, *params = ctx.saved_tensors
        flat = x.reshape(-1, x.shape[-1])
        grad_flat = grad_out.reshape(-1, grad_out.shape[-1])
        grad_x = torch.empty_like(flat) if ctx.x_requires_grad else None
        param_grads: list[torch.Tensor | None] = [None] * len(params)
        with restored_autocast(ctx.autocast), torch.enable_grad(), ctx.weights_scope():
            for start, end in tile_spans(flat.shape[0], ctx.tile_tokens):
                tile = flat[start:end].detach().requires_grad_(ctx.x_requires_grad)
                inputs = ([tile] if ctx.x_requires_grad else []) + list(params)
                grads = torch.autograd.grad(ctx.mlp_forward(tile), inputs, grad_flat[start:end], allow_unused=True)
                if ctx.x_requires_grad:
                    grad_x[start:end] = grads[0]
                    grads = grads[1:]
                for i, grad in enumerate(grads):
                    if grad is not None:
                        # Summed in fp32 and rounded once, as one untiled matmul would: low-precision parameters
                        # (bf16 LoRA weights, e.g. TRL's QLoRA) would otherwise round every tile's partial sum.
                        grad = grad.float()
                        param_grads[i] = grad if param_grads[i] is None else param_grads[i] + grad
        param_grads = [None if grad is None else grad.to(param.dtype) for grad, param in zip(param_grads, params)]
        grad_x = grad_x.view_as(x) if grad_x is not None else None
        return (None, None, None, None, None, None, grad_x, *param_grads)


def kept_mlp_forward(mlp: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """A gated MLP in a kept layer: the modeling code's computation (`down(act(gate(x)) * up(x))`, in eager torch
    even where Liger's fused SwiGLU is installed: its product is not one the hooks can rebuild), with the gated
    product saving only gate and up."""
    return mlp.down_proj(gated_product(mlp.gate_proj(x), mlp.up_proj(x), mlp.act_fn))


class TiledMLPForward:
    """Replaces one MLP module's `forward`; small inputs go to the original forward, and no-grad calls too unless the
    device is short of memory (then in tiles, without autograd). `tile_tokens=None`: never tiled (only the kept
    layers' lean product)."""

    def __init__(self, module: torch.nn.Module, tile_tokens: int | None, output_feeds_residual: bool,
                 free_bytes: Callable[[torch.device], int | None] = free_device_bytes,
                 untile_post_norm: Callable[[], bool] | None = None) -> None:
        self.module = module
        self.original = module.forward
        self.tile_tokens = tile_tokens
        self.output_feeds_residual = output_feeds_residual
        self.untile_post_norm = untile_post_norm  # when it says so, a post-norm MLP may run untiled (module docstring)
        self.free_bytes = free_bytes
        gate = getattr(module, "gate_proj", None) or getattr(module, "up_proj", None)
        self.intermediate_size = getattr(gate, "out_features", 0)
        # bitsandbytes sends a no-grad call with few rows to a fused 4-bit GEMM (on CUDA below a per-architecture row
        # count) and a grad call to dequantise + matmul; they round differently, so tiles of a quantized MLP take
        # the grad path, as the untiled MLP in a training forward does (see `_TiledMLP.forward`).
        self.grad_path = any(type(m).__module__.startswith("bitsandbytes") for m in module.modules())
        self.dequantized_bytes = dequantized_bytes(module)
        # Tiles are recomputed in the backward pass without the forward's random state: dropout (LoRA's
        # `lora_dropout`) would draw other masks, so an MLP with active dropout runs untiled.
        self.dropouts = [m for m in module.modules() if isinstance(m, torch.nn.Dropout)]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.numel() // x.shape[-1]
        if torch.is_inference_mode_enabled():
            return self.original(x)
        if in_kept_layer():  # a layer the memory plan keeps whole: tiles would only add recompute
            lean = torch.is_grad_enabled() and can_run_gated(self.module.act_fn)
            return kept_mlp_forward(self.module, x) if lean else self.original(x)
        if self.tile_tokens is None or self._dropout_active():
            return self.original(x)
        grad = torch.is_grad_enabled()
        tile_tokens = self.tile_tokens if grad else tokens  # without autograd only a short device needs tiles
        per_token = MLP_WORKING_TENSORS * self.intermediate_size * x.element_size()
        if grad and not self.output_feeds_residual and self.untile_post_norm is not None and self.untile_post_norm():
            free = self.free_bytes(x.device)
            if free is None or tokens * per_token <= TILE_FREE_SHARE * free:
                return self.original(x)
        if tokens > MIN_TILE_TOKENS:
            tile_tokens = fitting_tile_tokens(tile_tokens, tokens, per_token, self.free_bytes(x.device))
        if tokens <= tile_tokens:
            return self.original(x)
        if not grad:  # e.g. a checkpointed layer's first forward: the MLP's intermediates for one tile at a time
            return forward_tiles(self.original, x, tile_tokens, self.grad_path, self._weights_scope)
        output_unused = self.output_feeds_residual and is_recomputing()
        params = [p for p in self.module.parameters() if p.requires_grad]
        return _TiledMLP.apply(self.original, tile_tokens, output_unused, self.grad_path, self._weights_scope,
                               _force_grad_leaf(x.device), x, *params)

    def _weights_scope(self) -> AbstractContextManager:
        """Quantized weights dequantized once for a tile loop where they take at most `DEQUANTIZED_FREE_SHARE` of
        the free device memory; otherwise (and for 16-bit MLPs) nothing changes."""
        if not self.dequantized_bytes:
            return nullcontext()
        free = self.free_bytes(next(self.module.parameters()).device)
        if free is not None and self.dequantized_bytes > DEQUANTIZED_FREE_SHARE * free:
            return nullcontext()
        return dequantized_once(self.module)

    def _dropout_active(self) -> bool:
        return any(m.training and m.p > 0 for m in self.dropouts)
