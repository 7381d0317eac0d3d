"""Sequence-tiled MLP: a decoder layer's MLP computed over token tiles, so its working set is one tile's.

Design: the dense gated MLPs of llama, qwen2/3, mistral and gemma act on each token independently. An autograd
Function runs the MLP tile by tile under no_grad and saves only its input. Its backward pass recomputes one tile at
a time with grad and backpropagates through it, summing the parameters' (LoRA's) gradients over tiles and returning
them once, so each parameter gets exactly one gradient per backward pass (as DDP requires). The
[tokens, intermediate] activations (3.5× the hidden size, several of them) therefore exist for one tile only, not for
the whole micro-batch. Gradients equal the plain MLP's up to float reassociation of the per-tile sums.

Under trl_turbo's gradient checkpointing, the layer's recompute (`is_recomputing()`) only builds the graph for the
backward pass; its output values are never read. Where the MLP output feeds the residual sum directly (no norm after
it), the tiled MLP then skips its forward computation. The MLP runs forward twice per step, as with plain
checkpointing, rather than three times. Layers with a post-MLP norm (gemma2/3) compute it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .checkpoint import _autocast_state, _force_grad_leaf, is_recomputing, restored_autocast


class _TiledMLP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, mlp_forward: Callable, tile_tokens: int, output_unused: bool, _force_grad: torch.Tensor,
                x: torch.Tensor, *params: torch.Tensor) -> torch.Tensor:
        ctx.mlp_forward, ctx.tile_tokens = mlp_forward, tile_tokens
        ctx.autocast = _autocast_state()
        ctx.x_requires_grad = x.requires_grad
        ctx.save_for_backward(x, *params)
        if output_unused:
            return torch.empty_like(x)
        flat = x.reshape(-1, x.shape[-1])
        with torch.no_grad():
            out = torch.cat([mlp_forward(tile) for tile in flat.split(tile_tokens)])
        return out.view(*x.shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        # Parameter gradients are summed over tiles here and returned once, as a plain MLP's would be: gradients
        # accumulated into `.grad` tile by tile would mark each parameter ready several times (DDP refuses that).
        x, *params = ctx.saved_tensors
        flat = x.reshape(-1, x.shape[-1])
        grad_flat = grad_out.reshape(-1, grad_out.shape[-1])
        grad_x = torch.empty_like(flat) if ctx.x_requires_grad else None
        param_grads: list[torch.Tensor | None] = [None] * len(params)
        with restored_autocast(ctx.autocast), torch.enable_grad():
            for start in range(0, flat.shape[0], ctx.tile_tokens):
                end = min(start + ctx.tile_tokens, flat.shape[0])
                tile = flat[start:end].detach().requires_grad_(ctx.x_requires_grad)
                inputs = ([tile] if ctx.x_requires_grad else []) + list(params)
                grads = torch.autograd.grad(ctx.mlp_forward(tile), inputs, grad_flat[start:end], allow_unused=True)
                if ctx.x_requires_grad:
                    grad_x[start:end] = grads[0]
                    grads = grads[1:]
                for i, grad in enumerate(grads):
                    if grad is not None:
                        param_grads[i] = grad if param_grads[i] is None else param_grads[i] + grad
        grad_x = grad_x.view_as(x) if grad_x is not None else None
        return (None, None, None, None, grad_x, *param_grads)


class TiledMLPForward:
    """Replaces one MLP module's `forward`; small inputs and no-grad calls go to the original forward."""

    def __init__(self, module: torch.nn.Module, tile_tokens: int, output_feeds_residual: bool) -> None:
        self.module = module
        self.original = module.forward
        self.tile_tokens = tile_tokens
        self.output_feeds_residual = output_feeds_residual

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.numel() // x.shape[-1]
        if not torch.is_grad_enabled() or tokens <= self.tile_tokens:
            return self.original(x)
        output_unused = self.output_feeds_residual and is_recomputing()
        params = [p for p in self.module.parameters() if p.requires_grad]
        return _TiledMLP.apply(self.original, self.tile_tokens, output_unused, _force_grad_leaf(x.device), x, *params)
