"""Triton kernels that write an fp8 (e4m3) copy of a merged LoRA weight, W + scaling * B @ A, without ever holding the
merged matrix in 16 or 32 bits (`trl_turbo.ops.merge_fp8`).

Both kernels walk the same [BLOCK_N, BLOCK_K] tiles of the [N, K] weight and compute the tile's merged values in fp32
registers (the 16-bit base tile upcast, plus the rank-r product of B's rows and A's columns, accumulated in IEEE fp32):

- `tile_merged_amax`: one program per tile writes the tile's max |merged| to a partial buffer; the caller reduces it
  to the per-tensor amax (deterministic, no atomics).
- `tile_merged_fp8`: writes round_to_nearest_even(clamp(merged / scale, -FP8_MAX, FP8_MAX)) as e4m3 into the output
  rows (any row stride, so one shard of a fused q/k/v or gate/up tensor can be written in place). The rounding is
  done in fp32 bit arithmetic before the cast, so the result does not depend on the backend's fp8 conversion.

With `TRITON_INTERPRET=1` set before this module is imported, the kernels also run on CPU tensors (`INTERPRETED`).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"

BLOCK_N = 64
BLOCK_K = 128
BLOCK_R = 16  # tl.dot needs every dimension >= 16; ranks are padded with masked zeros


@triton.jit
def _merged_tile(w_ptr, b_ptr, a_ptr, scaling, n, k, rank, stride_w, stride_b, stride_a, pid_n, pid_k,
                 HAS_ADAPTER: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr):
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    mask = (rows[:, None] < n) & (cols[None, :] < k)
    tile = tl.load(w_ptr + rows[:, None] * stride_w + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if HAS_ADAPTER:
        delta = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        for r0 in range(0, rank, BLOCK_R):
            ranks = r0 + tl.arange(0, BLOCK_R)
            b = tl.load(b_ptr + rows[:, None] * stride_b + ranks[None, :],
                        mask=(rows[:, None] < n) & (ranks[None, :] < rank), other=0.0).to(tl.float32)
            a = tl.load(a_ptr + ranks[:, None] * stride_a + cols[None, :],
                        mask=(ranks[:, None] < rank) & (cols[None, :] < k), other=0.0).to(tl.float32)
            delta += tl.dot(b, a, input_precision="ieee")
        tile = tile + scaling * delta
    return tile, rows, cols, mask


@triton.jit
def _round_to_e4m3(x):
    # Round-to-nearest-even onto e4m3's grid in fp32, so the final cast is exact whatever conversion the backend
    # implements (Triton's interpreter rounds some ties away from zero and drops carries into the exponent).
    # Normal range (|x| >= 2**-6): keep 3 of fp32's 23 mantissa bits. Subnormals: multiples of 2**-9.
    bits = x.to(tl.int32, bitcast=True)
    lsb = (bits >> 20) & 1
    normal = ((bits + 0x7FFFF + lsb) & -0x100000).to(tl.float32, bitcast=True)
    magnitude = tl.abs(x)
    subnormal = ((magnitude * 512.0 + 12582912.0) - 12582912.0) / 512.0
    subnormal = tl.where(bits < 0, -subnormal, subnormal)  # the sign bit survives rounding to zero (-0.0)
    return tl.where(magnitude < 0.015625, subnormal, normal)


@triton.jit
def _amax_kernel(w_ptr, b_ptr, a_ptr, partial_ptr, scaling, n, k, rank, stride_w, stride_b, stride_a,
                 HAS_ADAPTER: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    tile, rows, cols, mask = _merged_tile(w_ptr, b_ptr, a_ptr, scaling, n, k, rank, stride_w, stride_b, stride_a,
                                          pid_n, pid_k, HAS_ADAPTER, BLOCK_N, BLOCK_K, BLOCK_R)
    amax = tl.max(tl.max(tl.where(mask, tl.abs(tile), 0.0), axis=1), axis=0)
    tl.store(partial_ptr + pid_n * tl.num_programs(1) + pid_k, amax)


@triton.jit
def _quantize_kernel(w_ptr, b_ptr, a_ptr, out_ptr, scale_ptr, scaling, n, k, rank, stride_w, stride_b, stride_a,
                     stride_out, fp8_max, HAS_ADAPTER: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     BLOCK_R: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    tile, rows, cols, mask = _merged_tile(w_ptr, b_ptr, a_ptr, scaling, n, k, rank, stride_w, stride_b, stride_a,
                                          pid_n, pid_k, HAS_ADAPTER, BLOCK_N, BLOCK_K, BLOCK_R)
    scale = tl.load(scale_ptr).to(tl.float32)
    q = _round_to_e4m3(tl.minimum(tl.maximum(tile / scale, -fp8_max), fp8_max))
    tl.store(out_ptr + rows[:, None] * stride_out + cols[None, :], q.to(out_ptr.dtype.element_ty), mask=mask)


def _adapter_args(weight: torch.Tensor, b: torch.Tensor | None, a: torch.Tensor | None):
    if b is None or a is None:
        return weight, weight, 0, 0, 0, False
    if b.stride(1) != 1 or a.stride(1) != 1:
        raise ValueError("the LoRA factors must have unit stride along their last dimension")
    return b, a, a.shape[0], b.stride(0), a.stride(0), True


def _grid(weight: torch.Tensor) -> tuple[int, int]:
    return triton.cdiv(weight.shape[0], BLOCK_N), triton.cdiv(weight.shape[1], BLOCK_K)


def tile_merged_amax(weight: torch.Tensor, b: torch.Tensor | None, a: torch.Tensor | None,
                     scaling: float) -> torch.Tensor:
    """max |weight + scaling * b @ a| per tile (fp32, one entry per program); `b`, `a` None: the weight alone."""
    if weight.stride(1) != 1:
        raise ValueError("the weight must have unit stride along its columns")
    b_arg, a_arg, rank, stride_b, stride_a, has_adapter = _adapter_args(weight, b, a)
    grid = _grid(weight)
    partial = torch.empty(grid[0] * grid[1], dtype=torch.float32, device=weight.device)
    _amax_kernel[grid](weight, b_arg, a_arg, partial, float(scaling), weight.shape[0], weight.shape[1], rank,
                       weight.stride(0), stride_b, stride_a, HAS_ADAPTER=has_adapter, BLOCK_N=BLOCK_N,
                       BLOCK_K=BLOCK_K, BLOCK_R=BLOCK_R)
    return partial


def tile_merged_fp8(weight: torch.Tensor, b: torch.Tensor | None, a: torch.Tensor | None, scaling: float,
                    scale: torch.Tensor, out: torch.Tensor, fp8_max: float) -> None:
    """out <- e4m3(clamp((weight + scaling * b @ a) / scale, +-fp8_max)); `scale` a one-element fp32 tensor."""
    if weight.stride(1) != 1 or out.stride(1) != 1:
        raise ValueError("the weight and the output must have unit stride along their columns")
    if out.shape != weight.shape:
        raise ValueError(f"output {tuple(out.shape)} and weight {tuple(weight.shape)} differ in shape")
    b_arg, a_arg, rank, stride_b, stride_a, has_adapter = _adapter_args(weight, b, a)
    _quantize_kernel[_grid(weight)](weight, b_arg, a_arg, out, scale, float(scaling), weight.shape[0],
                                    weight.shape[1], rank, weight.stride(0), stride_b, stride_a, out.stride(0),
                                    float(fp8_max), HAS_ADAPTER=has_adapter, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
                                    BLOCK_R=BLOCK_R)
