"""The gated product of an MLP, `act(gate) * up`, saving only `gate` and `up` for the backward pass.

Design decision: plain autograd saves three intermediate-sized tensors for this product (the activation's input, its
output and `up`); this Function saves two and recomputes `act(gate)` in the backward pass, an elementwise op that
costs a fraction of the layer's matmuls. The backward pass runs the very ops autograd would (`grad * up`,
`grad * act(gate)`, the activation's own backward on `gate`), under the forward's autocast state, so values and
gradients are bitwise those of `act(gate) * up` for a parameter-free activation (`can_run_gated`).
`offload.lean_activations` also rebuilds the product itself from the two saved tensors where a later op (the down
projection's LoRA) would save a copy of it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.autograd.function import once_differentiable

from .autocast_state import autocast_state, restored_autocast


class GatedProduct(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate: torch.Tensor, up: torch.Tensor, act: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        ctx.act = act
        ctx.autocast = autocast_state()
        ctx.save_for_backward(gate, up)
        return act(gate) * up

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None, None]:
        gate, up = ctx.saved_tensors
        with restored_autocast(ctx.autocast), torch.enable_grad():
            gate_leaf = gate.detach().requires_grad_(ctx.needs_input_grad[0])
            activated = ctx.act(gate_leaf)
        grad_up = grad * activated.detach() if ctx.needs_input_grad[1] else None
        grad_gate = None
        if ctx.needs_input_grad[0]:
            (grad_gate,) = torch.autograd.grad(activated, gate_leaf, grad * up)
        return grad_gate, grad_up, None


def can_run_gated(act: Callable[[torch.Tensor], torch.Tensor]) -> bool:
    """Whether `gated_product` computes `act(gate) * up` exactly: an activation without trainable parameters (it
    would get no gradient through the Function)."""
    parameters = act.parameters() if isinstance(act, torch.nn.Module) else ()
    return not any(p.requires_grad for p in parameters)


def gated_product(gate: torch.Tensor, up: torch.Tensor, act: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """`act(gate) * up`, keeping `gate` and `up` (not the activation's output) for the backward pass."""
    return GatedProduct.apply(gate, up, act)


def recompute_gated_product(node: object) -> torch.Tensor:
    """The output of the `GatedProduct` whose autograd node is `node`, rebuilt from its saved inputs (bitwise equal)."""
    gate, up = node.saved_tensors
    with restored_autocast(node.autocast), torch.no_grad():
        return node.act(gate) * up


def is_gated_product_node(node: object) -> bool:
    return isinstance(node, GatedProduct._backward_cls)
