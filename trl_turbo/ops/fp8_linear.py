"""A linear layer over an e4m3 weight with one scale per tensor (vLLM's online fp8 layout), as one torch op that
vLLM's compiled graphs and CUDA graphs can hold: `torch.ops.trl_turbo.fp8_linear`.

Design decision: how a product is computed depends on its rows, which a compiled graph only knows at run time, so
the choice is made inside one opaque op rather than in traced Python:
- decode-sized batches (at most `MAX_ROWS` rows): weight-only fp8. The activations stay 16-bit and the Triton kernel
  (`kernels.fp8_rows_matmul`) reads the fp8 weight once, the step's floor; nothing quantizes the activations.
- larger batches (prefill): vLLM's W8A8 arithmetic. The activations are quantized per row to e4m3 under a dynamic
  scale (amax / 448, as vLLM's per-token quantization) and `torch._scaled_mm` multiplies on the fp8 tensor cores.
Where fp8 tensor-core products are not available (CPU, GPUs before Ada) the large-batch path is the reference: the
dequantized weight in fp32. Where Triton cannot run (`backend.TritonOrTorch`) or has no e4m3 (before Ada),
decode-sized batches take the reference too.
"""

from __future__ import annotations

import torch

from .backend import TritonOrTorch
from .merge_fp8 import FP8_DTYPE, FP8_MAX

try:
    from ..kernels import fp8_rows_matmul as _triton_fp8_rows
except ImportError:  # no Triton: the reference serves every batch
    _triton_fp8_rows = None

MAX_ROWS = 64  # decode-sized: a GRPO generation's live sequences per step
_MIN_SCALE = 1.0 / (FP8_MAX * 512.0)  # vLLM's floor of a dynamic activation scale: a zero row stays finite

_backend = TritonOrTorch(_triton_fp8_rows)
_force_backend = _backend.force  # tests: "triton" or "torch" regardless of device


def reference(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
              bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ (scale * weight)^T (+ bias) in fp32, rounded once to x's dtype (x [M, K], weight [N, K] e4m3)."""
    out = x.float() @ (weight.float() * scale.float()).T
    if bias is not None:
        out += bias.float()
    return out.to(x.dtype)


def _rowwise_fp8(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                 bias: torch.Tensor | None) -> torch.Tensor:
    row_scale = (x.abs().amax(dim=1, keepdim=True).float() / FP8_MAX).clamp_(min=_MIN_SCALE)
    x_fp8 = (x.float() / row_scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    weight_scale = scale.float().reshape(1, 1).expand(1, weight.shape[0]).contiguous()
    out = torch._scaled_mm(x_fp8, weight.T, scale_a=row_scale, scale_b=weight_scale, out_dtype=x.dtype)
    return out if bias is None else out + bias


def _fp8_capable(device: torch.device) -> bool:
    """e4m3 in hardware (Ada, Hopper and later): Triton's conversions and torch's fp8 products need it; the CPU
    interpreter converts in software."""
    return device.type != "cuda" or torch.cuda.get_device_capability(device) >= (8, 9)


@torch.library.custom_op("trl_turbo::fp8_linear", mutates_args=())
def fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
               bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] 16-bit @ (scale * weight [N, K] e4m3)^T (+ bias [N]) -> [M, N] in x's dtype; `scale` one fp32
    element."""
    if x.shape[0] <= MAX_ROWS and _backend.use_triton(x.device) and _fp8_capable(x.device):
        return _triton_fp8_rows.fp8_rows_matmul(x, weight, scale, bias)
    if x.shape[0] > MAX_ROWS and x.device.type == "cuda" and _fp8_capable(x.device):
        return _rowwise_fp8(x, weight, scale, bias)
    return reference(x, weight, scale, bias)


@fp8_linear.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
      bias: torch.Tensor | None = None) -> torch.Tensor:
    return x.new_empty((x.shape[0], weight.shape[0]))
