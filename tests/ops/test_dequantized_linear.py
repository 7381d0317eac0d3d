"""4-bit linear layers dequantized once per scope: bitwise what bitsandbytes computes, with fewer dequantizations.

Against the installed bitsandbytes (CPU here and in CI; CUDA with the `gpu` marker): outputs and input gradients of a
`Linear4bit` inside `dequantized_once` equal its own forward's bit for bit at row counts on both sides of
bitsandbytes' fused-kernel threshold, and the weight is dequantized once per scope where bitsandbytes dequantizes per
call. A tiled NF4 MLP (LoRA on every projection) gives bitwise the same output and gradients with the scope on and off.
"""

from __future__ import annotations

import collections
import contextlib
import importlib.util

import pytest
import torch

from trl_turbo.ops.dequantized_linear import OnceDequantizedForward, dequantized_once, fused_kernel_rows

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


def counts_dequantizations(device: str) -> bool:
    """Where every dequantization shows as a `bitsandbytes::dequantize_4bit` op: CPU, and CUDA before 0.50 (from 0.50
    on, CUDA's dequantize + linear fallback calls its kernel directly; there only the bitwise checks run)."""
    return device == "cpu" or fused_kernel_rows(device) == 0


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
    if not counts_dequantizations(device):
        pytest.skip("this bitsandbytes dequantizes on CUDA without an op the profiler sees")
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
        assert layer.compute_type_is_set and scoped_forward.weight is None
        layer(torch.randn(4, 64))
        assert scoped_forward.weight is not None and scoped_forward.weight.dtype == torch.float32
    stored_bf16 = linear_4bit(64, 32, "cpu", torch.bfloat16, nested=False)
    stored_bf16.compute_dtype = torch.float32  # versions of bitsandbytes round such a weight differently
    with dequantized_once(stored_bf16):
        stored_bf16(torch.randn(4, 64))
        assert stored_bf16.__dict__["forward"].weight is None


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
def test_tiled_nf4_mlp_with_lora_is_bitwise_the_same_with_weights_dequantized_once(device, monkeypatch):
    skip_without(device)
    from peft import LoraConfig, get_peft_model

    from trl_turbo.offload import tiled_mlp
    from trl_turbo.offload.tiled_mlp import TiledMLPForward

    dtype = torch.bfloat16
    base = torch.nn.Sequential(GatedMLP(128, 384, device, dtype))
    model = get_peft_model(base, LoraConfig(r=4, target_modules=["gate_proj", "up_proj", "down_proj"],
                                            init_lora_weights=False))
    mlp = model.base_model.model[0]
    tile_tokens = max(fused_kernel_rows(device) or 0, 256) + 64  # every tile past any fused kernel's rows
    x = torch.randn(1, 3 * tile_tokens, 128, device=device, dtype=dtype)
    results = {}
    for name in ("per call", "once"):
        if name == "per call":
            monkeypatch.setattr(tiled_mlp, "dequantized_once", lambda module: contextlib.nullcontext())
        else:
            monkeypatch.undo()
        tiled = TiledMLPForward(mlp, tile_tokens, output_feeds_residual=True, free_bytes=lambda _device: None)
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
    if counts_dequantizations(device):
        # Per call: each matrix once per tile in the forward, again in the backward's forward and its input gradient
        assert plain_count == 3 * 3 * 3  # three tiles
        assert once_count == 3 * 2  # each matrix once in the forward loop and once in the backward loop


def test_the_tiled_mlp_dequantizes_once_only_where_a_quarter_of_the_free_memory_holds_the_weights():
    from trl_turbo.offload.tiled_mlp import DEQUANTIZED_FREE_SHARE, TiledMLPForward

    mlp = GatedMLP(64, 128, "cpu", torch.bfloat16)
    held = 3 * 64 * 128 * 2  # three bf16 matrices
    enough = int(held / DEQUANTIZED_FREE_SHARE)
    for free, once in ((None, True), (enough, True), (enough - 1, False)):
        tiled = TiledMLPForward(mlp, 256, output_feeds_residual=True, free_bytes=lambda _device, free=free: free)
        assert tiled.dequantized_bytes == held
        with tiled._weights_scope():
            assert isinstance(mlp.up_proj.__dict__.get("forward"), OnceDequantizedForward) is once, free
    assert TiledMLPForward(torch.nn.Linear(4, 4), 256, output_feeds_residual=True).dequantized_bytes == 0
