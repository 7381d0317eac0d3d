"""RMSNorm that keeps only its input and one fp32 scalar per token for the backward pass.

Design: the Llama-style RMSNorm (llama, qwen2, qwen3, mistral) upcasts to fp32, and autograd then keeps that fp32
copy for `pow` and `mul`, plus the rounded normalised tensor for the weight product. That is ~6 bytes per element,
three times the input. With two norms per layer, it is a large share of a layer's recompute working set at long
context. This Function computes the forward with exactly the same torch operations (bitwise-identical output). It
saves the input, which a neighbouring op usually keeps anyway, and `rstd` [tokens], and computes the backward in fp32
from them. Gradients equal autograd's up to rounding: autograd takes the weight-product gradient in the input dtype,
this one in fp32.
"""

from __future__ import annotations

import torch


class _LeanRMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        x32 = x.to(torch.float32)
        rstd = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
        normalized = (x32 * rstd).to(x.dtype)
        ctx.save_for_backward(x, weight, rstd)
        return weight * normalized

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None, None]:
        x, weight, rstd = ctx.saved_tensors
        x32 = x.to(torch.float32)
        xhat = x32 * rstd
        grad_weight = None
        if ctx.needs_input_grad[1]:
            rounded = xhat.to(x.dtype).to(torch.float32)
            grad_weight = (grad_out.to(torch.float32) * rounded).reshape(-1, x.shape[-1]).sum(0).to(weight.dtype)
        grad_x = None
        if ctx.needs_input_grad[0]:
            g = grad_out.to(torch.float32) * weight.to(torch.float32)
            grad_x = (rstd * (g - xhat * (g * xhat).mean(-1, keepdim=True))).to(x.dtype)
        return grad_x, grad_weight, None


class LeanRMSNormForward:
    """Replaces a Llama-style RMSNorm module's `forward` (`weight * normalize(x)`, fp32 statistics)."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module  # the weight is read per call: wrappers such as FSDP may replace the Parameter

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        weight, eps = self.module.weight, float(self.module.variance_epsilon)
        if not torch.is_grad_enabled():
            x32 = x.to(torch.float32)
            return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
        return _LeanRMSNorm.apply(x, weight, eps)
