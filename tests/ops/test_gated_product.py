"""`ops.gated_product`: values and gradients bitwise those of `act(gate) * up`, with two tensors saved, not three."""

from __future__ import annotations

import pytest
import torch
from transformers.activations import ACT2FN

from trl_turbo.ops.gated_product import gated_product, is_gated_product_node, recompute_gated_product


def _saved(fn):
    count = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: count.append(t) or t, lambda t: t):
        out = fn()
    return out, len({t.untyped_storage().data_ptr() for t in count})


@pytest.mark.parametrize("act", ["silu", "gelu_pytorch_tanh"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_values_and_gradients_are_bitwise_the_plain_product(act, dtype):
    torch.manual_seed(0)
    activation = ACT2FN[act]
    gate, up, grad = (torch.randn(64, 96).to(dtype) for _ in range(3))
    results = []
    for product in (lambda g, u: activation(g) * u, lambda g, u: gated_product(g, u, activation)):
        g, u = gate.clone().requires_grad_(), up.clone().requires_grad_()
        out, saved = _saved(lambda: product(g, u))
        out.backward(grad)
        results.append((out.detach(), g.grad, u.grad, saved))
    (plain, plain_g, plain_u, plain_saved), (lean, lean_g, lean_u, lean_saved) = results
    assert torch.equal(plain, lean) and torch.equal(plain_g, lean_g) and torch.equal(plain_u, lean_u)
    assert (plain_saved, lean_saved) == (3, 2)  # gate, activation output, up -> gate, up


def test_only_the_inputs_that_need_a_gradient_get_one():
    gate = torch.randn(8, requires_grad=True)
    up = torch.randn(8)
    gated_product(gate, up, torch.nn.SiLU()).sum().backward()
    assert gate.grad is not None and up.grad is None


def test_the_product_is_rebuilt_bitwise_from_its_node():
    gate, up = torch.randn(16, 32, requires_grad=True), torch.randn(16, 32, requires_grad=True)
    out = gated_product(gate, up, torch.nn.SiLU())
    assert is_gated_product_node(out.grad_fn) and not is_gated_product_node((out * 2).grad_fn)
    assert torch.equal(recompute_gated_product(out.grad_fn), out.detach())
