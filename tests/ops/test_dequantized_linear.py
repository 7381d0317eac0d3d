"""4-bit linear layers dequantized once per scope: bitwise what bitsandbytes computes, with fewer dequantizations.

Against the installed bitsandbytes (CPU here and in CI; CUDA with the `gpu` marker): outputs and input gradients of a
`Linear4bit` inside `dequantized_once` equal its own forward's bit for bit at row counts on both sides of
bitsandbytes' fused-kernel threshold, and the weight is dequantized once per scope where bitsandbytes dequantizes per
call. A tiled NF4 MLP (LoRA on every projection) gives bitwise the same output and gradients with the scope on and off.
"""

from __future__ import annotations

import collections
import importlib.util

import pytest
import torch

from trl_turbo.ops.dequantized_linear import dequantized_once, fused_kernel_rows

pytestmark = pytest.mark.skipif(importlib.util.find_spec("bitsandbytes") is None, reason="needs bitsandbytes")

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def skip_without(device: str) -> None:
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA")


def linear_4bit(in_features: int, out_features: int, device: str, compute_dtype: torch.dtype, nested: bool,
                seed: int = 0) -> torch.nn.Module:
    import bitsandbytes as bnb

    torch.manual_seed(seed)
    layer = bnb.nn.Linear4bit(in_features, out_features, bias=False, compute_dtype=compute_dtype,
                              compress_statistics=nested, quant_type="nf4")
    layer.weight = bnb.nn.Params4bit(torch.randn(out_features, in_features, dtype=compute_dtype) * 0.05,
                                     requires_grad=False, compress_statistics=nested, quant_type="nf4")
    return layer.to(device)  # quantizes


def dequantize_count(function) -> int:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        function()
    return collections.Counter(event.name for event in profile.events())["bitsandbytes::dequantize_4bit"]


def forward_backward(layer: torch.nn.Module, x: torch.Tensor, calls: int) -> tuple[list[torch.Tensor], torch.Tensor]:
    """`calls` forwards of the same input (as tiles call a weight again), summed and backpropagated."""
    x = x.detach().requires_grad_()
    outputs = [layer(x) for _ in range(calls)]
    sum(o.float().square().sum() for o in outputs).backward()
    return [o.detach() for o in outputs], x.grad


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("compute_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("nested", [True, False])
def test_outputs_and_input_gradients_are_bitwise_bitsandbytes(device, compute_dtype, nested):
    skip_without(device)
    layer = linear_4bit(256, 384, device, compute_dtype, nested)
    layer(torch.zeros(2, 256, device=device, dtype=compute_dtype))  # bitsandbytes settles its compute type here
    threshold = fused_kernel_rows(device) or 0
    for rows in sorted({3, 64, threshold + 5}):
        x = torch.randn(rows, 256, device=device, dtype=compute_dtype)
        plain_out, plain_grad = forward_backward(layer, x, calls=3)
        with dequantized_once(layer):
            once_out, once_grad = forward_backward(layer, x, calls=3)
        for a, b in zip(plain_out, once_out):
            assert torch.equal(a, b), rows
        assert torch.equal(plain_grad, once_grad), rows


@pytest.mark.parametrize("device", DEVICES)
def test_the_weight_is_dequantized_once_per_scope_where_bitsandbytes_dequantizes_per_call(device):
    skip_without(device)
    layer = linear_4bit(256, 384, device, torch.bfloat16, nested=True)
    layer(torch.zeros(2, 256, device=device, dtype=torch.bfloat16))
    rows = (fused_kernel_rows(device) or 0) + 64  # past any fused kernel: bitsandbytes dequantizes every call
    x = torch.randn(rows, 256, device=device, dtype=torch.bfloat16)
    plain = dequantize_count(lambda: forward_backward(layer, x, calls=3))
    assert plain == 6  # three forwards and three input gradients

    def scoped():
        with dequantized_once(layer):
            forward_backward(layer, x, calls=3)

    assert dequantize_count(scoped) == 1
    assert "forward" not in layer.__dict__  # the scope's forward is gone


def test_an_exception_inside_the_scope_removes_its_forwards():
    layer = linear_4bit(64, 32, "cpu", torch.float32, nested=False)
    layer(torch.zeros(2, 64))
    with pytest.raises(RuntimeError, match="inside"):
        with dequantized_once(layer):
            assert "forward" in layer.__dict__
            raise RuntimeError("inside")
    assert "forward" not in layer.__dict__


def test_calls_bitsandbytes_routes_elsewhere_go_to_its_own_forward():
    """A single row without grad (bitsandbytes' inference kernel), a layer whose compute type is not settled yet
    (bitsandbytes settles it at the first call) and a weight stored in another dtype than the compute dtype are left
    to bitsandbytes: no dequantization is cached for them."""
    layer = linear_4bit(64, 32, "cpu", torch.float32, nested=False)
    with dequantized_once(layer):
        scoped_forward = layer.__dict__["forward"]
        with torch.no_grad():
            layer(torch.randn(1, 64))
        layer.compute_type_is_set = False
        layer(torch.randn(4, 64))
        assert layer.compute_type_is_set and scoped_forward.weights == {}
        layer(torch.randn(4, 64))
        assert list(scoped_forward.weights) == [torch.float32]
    stored_bf16 = linear_4bit(64, 32, "cpu", torch.bfloat16, nested=False)
    stored_bf16.compute_dtype = torch.float32  # versions of bitsandbytes round such a weight differently
    with dequantized_once(stored_bf16):
        stored_bf16(torch.randn(4, 64))
        assert stored_bf16.__dict__["forward"].weights == {}


class GatedMLP(torch.nn.Module):
    def __init__(self, hidden: int, intermediate: int, device: str, dtype: torch.dtype) -> None:
        super().__init__()
        self.gate_proj = linear_4bit(hidden, intermediate, device, dtype, nested=True, seed=1)
        self.up_proj = linear_4bit(hidden, intermediate, device, dtype, nested=True, seed=2)
        self.down_proj = linear_4bit(intermediate, hidden, device, dtype, nested=True, seed=3)
        self.act_fn = torch.nn.SiLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


@pytest.mark.parametrize("device", DEVICES)
def test_tiled_nf4_mlp_with_lora_is_bitwise_the_same_with_weights_dequantized_once(device):
    skip_without(device)
    from peft import LoraConfig, get_peft_model

    from trl_turbo.offload.tiled_mlp import TiledMLPForward

    dtype = torch.bfloat16
    base = torch.nn.Sequential(GatedMLP(128, 384, device, dtype))
    model = get_peft_model(base, LoraConfig(r=4, target_modules=["gate_proj", "up_proj", "down_proj"],
                                            init_lora_weights=False))
    mlp = model.base_model.model[0]
    rows = max(fused_kernel_rows(device) or 0, 256) + 64
    tile_tokens = rows // 3 + 1 if not fused_kernel_rows(device) else rows - 32
    x = torch.randn(1, rows * 2, 128, device=device, dtype=dtype)
    results = {}
    for name, free in (("per call", lambda _device: 0), ("once", lambda _device: None)):
        tiled = TiledMLPForward(mlp, tile_tokens, output_feeds_residual=True, free_bytes=free)
        model.zero_grad(set_to_none=True)
        inputs = x.detach().requires_grad_()
        count_holder = {}

        def step():
            out = tiled(inputs)
            out.float().square().sum().backward()
            count_holder["out"] = out.detach()

        count = dequantize_count(step)
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        results[name] = (count, count_holder["out"], inputs.grad.clone(), grads)
    (plain_count, plain_out, plain_x_grad, plain_grads), (once_count, once_out, once_x_grad, once_grads) = (
        results["per call"], results["once"])
    assert torch.equal(plain_out, once_out)
    assert torch.equal(plain_x_grad, once_x_grad)
    assert plain_grads.keys() == once_grads.keys() and len(plain_grads) == 6  # A and B of three LoRA layers
    for name in plain_grads:
        assert torch.equal(plain_grads[name], once_grads[name]), name
    tiles = -(-x.shape[1] // tile_tokens)
    # Per call: each matrix once per tile in the forward, again in the backward's forward and its input gradient
    assert plain_count == 3 * 3 * tiles
    assert once_count == 3 * 2  # each matrix once in the forward loop and once in the backward loop
