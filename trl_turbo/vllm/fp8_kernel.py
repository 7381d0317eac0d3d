"""The GEMM of trl_turbo's fp8 sampling engine: weight-only fp8 for decode-sized batches, vLLM's W8A8 for the rest
(`ops.fp8_linear`).

Design decisions:
- The engine asks for it by an engine argument (`engine_request`, under `ENGINE_KEY`), which vLLM hashes into the
  key of its compiled-graph cache.
- vLLM traces and captures its model while `LLM()` is built, so the choice is made while its layers are created:
  `create_weights` of vLLM's online per-tensor fp8 method marks each layer of an engine that asked, and the method's
  `apply` sends a marked layer's product to the `trl_turbo::fp8_linear` op (opaque to vLLM's compiler, so CUDA
  graphs capture it), every other layer to vLLM's own code. Both are replaced once, through the registry.
- The op reads the layer's weight as vLLM keeps it (a [K, N] view of [N, K] e4m3 storage, whose rows trl_turbo's
  fp8 writer fills) and its one fp32 scale.
- A candidate, not yet what training samples with: nothing in the run plan asks for it until it beats vLLM's W8A8
  on the GPU (`bench engine-options --options fp8,fp8-turbo-gemm`). Measured so far it has not: 1.56x vLLM's GEMM
  time in the engine at 8 sequences, docs/benchmarks.md.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from .. import registry
from ..ops import fp8_linear as _registers_the_op  # noqa: F401  (torch.ops.trl_turbo.fp8_linear)
from . import engine_request

ENGINE_KEY = "trl_turbo_fp8_linear"
WEIGHT_ONLY_DECODE = "weight_only_decode"
LAYER_MARK = "_trl_turbo_weight_only_decode"


def engine_arguments() -> dict[str, Any]:
    """The engine arguments that select this GEMM."""
    return engine_request.arguments(ENGINE_KEY, WEIGHT_ONLY_DECODE)


def _online_fp8_method() -> type:
    from vllm.model_executor.layers.quantization.online.fp8 import Fp8PerTensorOnlineLinearMethod

    return Fp8PerTensorOnlineLinearMethod


def _requested() -> bool:
    return engine_request.asked(engine_request.current_config(), ENGINE_KEY, WEIGHT_ONLY_DECODE)


def _marking(create_weights: Any) -> Any:
    @functools.wraps(create_weights)
    def marked_create_weights(self: Any, layer: torch.nn.Module, *args: Any, **kwargs: Any) -> None:
        create_weights(self, layer, *args, **kwargs)
        if _requested():
            setattr(layer, LAYER_MARK, True)

    return marked_create_weights


def _routing(apply: Any) -> Any:
    @functools.wraps(apply)
    def routed_apply(self: Any, layer: torch.nn.Module, x: Any, bias: torch.Tensor | None = None) -> torch.Tensor:
        if not getattr(layer, LAYER_MARK, False) or not isinstance(x, torch.Tensor):
            return apply(self, layer, x, bias)
        rows = x.reshape(-1, x.shape[-1])
        out = torch.ops.trl_turbo.fp8_linear(rows, layer.weight.t(), layer.weight_scale, bias)
        return out.reshape(*x.shape[:-1], out.shape[-1])

    return routed_apply


def install() -> None:
    """Replace the online fp8 method's `create_weights` and `apply` (once; `trl_turbo.unpatch()` restores them)."""
    method = _online_fp8_method()
    if registry.original(method, "apply") is not method.__dict__["apply"]:
        return  # installed already
    registry.set_attr(method, "create_weights", _marking(method.__dict__["create_weights"]))
    registry.set_attr(method, "apply", _routing(method.__dict__["apply"]))
