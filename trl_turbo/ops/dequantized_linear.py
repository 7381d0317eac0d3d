"""bitsandbytes 4-bit linear layers computed from their weights dequantized once per scope.

Design decision: bitsandbytes dequantizes a 4-bit weight on every call, forward and backward. A tiled MLP calls each
of its matrices once per tile and pass, so a sequence group cut into tiles dequantizes the same matrix again and again
(with 8 groups of 2 tiles, 48 times a micro-step where stock TRL does it 3 times; `benchmarks/qlora_op_counts.py`).
Inside `dequantized_once(module)` each 4-bit linear layer of `module` dequantizes its weight at its first call and
computes `linear(x, W)` from that W until the scope ends. That is what bitsandbytes computes for such a call where it
dequantizes and multiplies (before 0.50 every call with more than one row or with grad; from 0.50 on, CPU calls and
CUDA calls of more rows than its fused 4-bit kernel takes), and its backward multiplies by the same W, so outputs and
input gradients are bitwise the same; only the repeated dequantizations go. Every other call goes to bitsandbytes'
own forward unchanged: a fused kernel's rows, CPU-packed weights or CPU inference calls that would pack them, a single
row without grad, empty inputs, a layer not yet called or with a bias of another dtype, weights stored in another
dtype than the compute dtype, and any call of a bitsandbytes whose fused-kernel rows are not known. The scope's
forwards are instance attributes set as scoped `trl_turbo.registry` patches (listed by `registry.active_patches()`
while they last), removed when it ends, on exceptions too. `tests/ops/test_dequantized_linear.py`
checks the bitwise claim against the installed bitsandbytes (CPU in CI, CUDA on the GPU).
"""

from __future__ import annotations

import functools
import importlib
import math
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager

import torch
from packaging.version import Version

from .. import registry


@functools.cache
def fused_kernel_rows(device_type: str) -> int | None:
    """Up to how many rows bitsandbytes may multiply a 4-bit weight on `device_type` with a fused kernel instead of
    dequantize + linear: 0 before 0.50 and on CPU, bitsandbytes' own CUDA threshold from 0.50 on, None where unknown
    (then nothing here replaces bitsandbytes)."""
    import bitsandbytes

    if Version(bitsandbytes.__version__).release < (0, 50) or device_type == "cpu":
        return 0
    if device_type != "cuda" or torch.version.hip is not None:
        return None
    try:
        rows = importlib.import_module("bitsandbytes.backends.cuda.ops")._gemm_4bit_custom_max_m
    except (ImportError, AttributeError):
        return None
    return rows if isinstance(rows, int) else None


def is_4bit_linear(module: torch.nn.Module) -> bool:
    """A bitsandbytes 4-bit linear layer with its quantization state."""
    if not type(module).__module__.startswith("bitsandbytes"):
        return False
    import bitsandbytes

    return (isinstance(module, bitsandbytes.nn.Linear4bit)
            and getattr(module.weight, "quant_state", None) is not None)


def dequantized_bytes(module: torch.nn.Module) -> int:
    """What `dequantized_once(module)` holds at most: every 4-bit weight of `module` in its stored dtype (the only
    dtype it dequantizes to)."""
    return sum(math.prod(m.weight.quant_state.shape) * m.weight.quant_state.dtype.itemsize
               for m in module.modules() if is_4bit_linear(m))


class OnceDequantizedForward:
    """`forward` of one bitsandbytes `Linear4bit` inside a scope: its weight dequantized at the first call that
    computes here and reused (always in the compute dtype, which calls here share with the stored weight)."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module
        self.weight: torch.Tensor | None = None

    def _bitsandbytes_path(self, x: torch.Tensor) -> bool:
        module = self.module
        state = getattr(module.weight, "quant_state", None)
        if (state is None or getattr(state, "packing_format_for_cpu", False) or x.numel() == 0
                or not getattr(module, "compute_type_is_set", False) or module.compute_dtype is None
                # bitsandbytes' versions round a dequantized weight of another dtype differently (directly into the
                # compute dtype, or through the stored one) and not alike in forward and backward
                or state.dtype != module.compute_dtype
                or (module.bias is not None and module.bias.dtype != x.dtype)
                or (x.numel() == x.shape[-1] and not x.requires_grad)
                # where bitsandbytes repacks the weight for its CPU inference kernel
                or (x.device.type == "cpu" and getattr(module, "support_avx512bf16_for_cpu", False)
                    and not module.training and not x.requires_grad)):
            return True
        fused_rows = fused_kernel_rows(x.device.type)
        return fused_rows is None or x.numel() // x.shape[-1] <= fused_rows

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        module = self.module
        if self._bitsandbytes_path(x):
            return type(module).forward(module, x)
        # As bitsandbytes' Linear4bit.forward and matmul_4bit prepare the call
        input_dtype = x.dtype
        x = x.to(module.compute_dtype)
        bias = None if module.bias is None else module.bias.to(module.compute_dtype)
        if self.weight is None:
            from bitsandbytes.functional import dequantize_4bit

            # [out, in], contiguous, in the stored dtype (= the compute dtype): the matrix bitsandbytes multiplies by
            self.weight = dequantize_4bit(module.weight.data, module.weight.quant_state)
        return torch.nn.functional.linear(x, self.weight, bias).to(input_dtype)


@contextmanager
def dequantized_once(module: torch.nn.Module) -> Iterator[None]:
    """Within the scope, each 4-bit linear layer of `module` dequantizes its weight once (module docstring)."""
    with ExitStack() as scope:  # scoped registry patches: each layer's own forward comes back however it ends
        for layer in module.modules():
            if is_4bit_linear(layer) and "forward" not in layer.__dict__:
                scope.enter_context(registry.scoped(layer, "forward", OnceDequantizedForward(layer)))
        yield
