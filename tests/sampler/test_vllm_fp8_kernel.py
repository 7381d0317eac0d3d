"""The seam that gives trl_turbo's fp8 engine its weight-only decode GEMM (`trl_turbo.vllm.fp8_kernel`), on a
stand-in for vLLM's online fp8 method: layers created while an engine asks for it are marked, marked layers'
products go to `torch.ops.trl_turbo.fp8_linear` with vLLM's [K, N] weight view read as [N, K] rows, everything else
to vLLM's own `apply`; the request travels in the engine's hashed `additional_config`."""

from __future__ import annotations

import pytest
import torch

from trl_turbo.ops.fp8_linear import FP8_DTYPE, reference
from trl_turbo.vllm import fp8_kernel


class OnlineFp8Method:
    """vLLM's `Fp8PerTensorOnlineLinearMethod` as the seam sees it: weights created on a layer, then applied."""

    calls: list[str] = []

    def create_weights(self, layer, input_size, output_size):
        generator = torch.Generator().manual_seed(input_size + output_size)
        rows = (torch.randn(output_size, input_size, generator=generator) * 8).to(FP8_DTYPE)
        layer.weight = torch.nn.Parameter(rows.t(), requires_grad=False)  # vLLM keeps the [K, N] view
        layer.weight_scale = torch.nn.Parameter(torch.tensor([0.25]), requires_grad=False)

    def apply(self, layer, x, bias=None):
        OnlineFp8Method.calls.append("vllm")
        return "vllm's product"


@pytest.fixture
def method(monkeypatch):
    OnlineFp8Method.calls = []
    cls = type("Method", (OnlineFp8Method,), {})
    monkeypatch.setattr(cls, "create_weights", fp8_kernel._marking(OnlineFp8Method.create_weights))
    monkeypatch.setattr(cls, "apply", fp8_kernel._routing(OnlineFp8Method.apply))
    return cls()


def _layer(method, monkeypatch, requested: bool) -> torch.nn.Module:
    monkeypatch.setattr(fp8_kernel, "_requested", lambda: requested)
    layer = torch.nn.Module()
    method.create_weights(layer, 48, 24)
    return layer


def test_an_engine_that_asks_gets_the_op_for_every_product(method, monkeypatch):
    layer = _layer(method, monkeypatch, requested=True)
    assert getattr(layer, fp8_kernel.LAYER_MARK) is True
    x = torch.randn(2, 3, 48).to(torch.bfloat16)  # leading dims are flattened into rows and restored
    bias = torch.randn(24).to(torch.bfloat16)
    out = method.apply(layer, x, bias)
    assert OnlineFp8Method.calls == [] and out.shape == (2, 3, 24)
    rows = layer.weight.t()
    assert rows.shape == (24, 48) and rows.stride() == (48, 1)  # the [N, K] rows vLLM's [K, N] view is made of
    expected = torch.ops.trl_turbo.fp8_linear(x.reshape(6, 48), rows, layer.weight_scale, bias).reshape(2, 3, 24)
    assert torch.equal(out, expected)
    torch.testing.assert_close(out.float(), reference(x.reshape(6, 48), rows, layer.weight_scale, bias).float()
                               .reshape(2, 3, 24), rtol=2**-7, atol=1e-2)  # and it is the layer's product


def test_other_engines_and_other_inputs_keep_vllms_own_apply(method, monkeypatch):
    plain = _layer(method, monkeypatch, requested=False)
    assert not hasattr(plain, fp8_kernel.LAYER_MARK)
    assert method.apply(plain, torch.randn(4, 48).to(torch.bfloat16)) == "vllm's product"
    marked = _layer(method, monkeypatch, requested=True)
    # an already-quantized activation (vLLM's fused norm + quant) is not a tensor: vLLM's path
    assert method.apply(marked, object()) == "vllm's product"
    assert OnlineFp8Method.calls == ["vllm", "vllm"]


def test_the_request_is_an_engine_argument_vllm_hashes():
    arguments = fp8_kernel.engine_arguments()
    assert arguments == {"additional_config": {fp8_kernel.ENGINE_KEY: fp8_kernel.WEIGHT_ONLY_DECODE}}
