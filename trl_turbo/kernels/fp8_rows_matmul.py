"""A Triton matmul for decode-sized batches against an e4m3 weight with one scale per tensor, the activations kept
16-bit (weight-only fp8): out[M, N] = x[M, K] @ (scale * W[N, K])^T (+ bias), for the sampling engine's fp8 copy
(`trl_turbo.ops.fp8_linear`).

At a decode step M is the number of live sequences (8 to 64 in GRPO), so the product is bound by reading W once;
vLLM's W8A8 GEMM also quantizes every activation row first and reaches about two thirds of the weight's read floor
there. Each program owns BLOCK_N of W's rows and one of SPLIT_K equal runs of K: it loads [BLOCK_K, BLOCK_N] tiles
of fp8 bytes (W's rows as columns), widens them to the activations' dtype in registers and accumulates x @ tile in
fp32 on the tensor cores (M padded to at least 16 rows with masked zeros, as `tl.dot` needs). Wide tiles of N keep
the activations' share of the bytes moved small (every program reads its run of x again); the split over K keeps
enough programs in flight where N / BLOCK_N alone would not fill the GPU (N = 4096). The split's partial sums go to
an fp32 buffer and a second kernel adds them in a fixed order, applies the scale (once, to the fp32 sum) and the
bias, and rounds: no atomics, so the result does not depend on the scheduling. With one run the first kernel does
that itself.

With `TRITON_INTERPRET=1` set before this module is imported, the kernel also runs on CPU tensors (`INTERPRETED`);
the interpreter's 16-bit `tl.dot` is wrong, so there both operands are widened to fp32 first (the same exact products:
every 16-bit and e4m3 value is an fp32 value).
"""

from __future__ import annotations

import os
from typing import NamedTuple

import torch
import triton
import triton.language as tl

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"

LARGEST_BLOCK_M = 64  # all of M sits in one tile's registers: decode-sized batches only


@triton.jit
def _fp8_rows_matmul_kernel(x_ptr, w_ptr, scale_ptr, bias_ptr, out_ptr, m, n, k, k_per_split, stride_xm, stride_wn,
                            stride_om, HAS_BIAS: tl.constexpr, WIDE: tl.constexpr, ONE_SPLIT: tl.constexpr,
                            WEIGHT_FIRST: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                            BLOCK_K: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rows_m = tl.arange(0, BLOCK_M)
    rows_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    k_start = pid_k * k_per_split
    k_stop = tl.minimum(k, k_start + k_per_split)
    if WEIGHT_FIRST:
        # out^T = W @ x^T: W's rows are the dot's M side, where Hopper's warp-group MMA wants 64 rows, and the few
        # activation rows its narrow N side
        acc_t = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        for k0 in range(k_start, k_stop, BLOCK_K):
            cols = k0 + tl.arange(0, BLOCK_K)
            w = tl.load(w_ptr + rows_n[:, None] * stride_wn + cols[None, :],
                        mask=(rows_n[:, None] < n) & (cols[None, :] < k_stop), other=0.0)
            x_t = tl.load(x_ptr + rows_m[None, :] * stride_xm + cols[:, None],
                          mask=(rows_m[None, :] < m) & (cols[:, None] < k_stop), other=0.0)
            if WIDE:
                acc_t += tl.dot(w.to(tl.float32), x_t.to(tl.float32), input_precision="ieee")
            else:
                acc_t += tl.dot(w.to(x_t.dtype), x_t)
        acc = tl.trans(acc_t)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(k_start, k_stop, BLOCK_K):
            cols = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(x_ptr + rows_m[:, None] * stride_xm + cols[None, :],
                        mask=(rows_m[:, None] < m) & (cols[None, :] < k_stop), other=0.0)
            # W's tile loaded as [BLOCK_K, BLOCK_N] (the dot's right operand as it is consumed, no transpose in
            # registers); consecutive k are consecutive bytes
            w = tl.load(w_ptr + rows_n[None, :] * stride_wn + cols[:, None],
                        mask=(rows_n[None, :] < n) & (cols[:, None] < k_stop), other=0.0)
            if WIDE:
                acc += tl.dot(x.to(tl.float32), w.to(tl.float32), input_precision="ieee")
            else:
                acc += tl.dot(x, w.to(x.dtype))
    mask = (rows_m[:, None] < m) & (rows_n[None, :] < n)
    if ONE_SPLIT:
        acc = acc * tl.load(scale_ptr).to(tl.float32)
        if HAS_BIAS:
            acc += tl.load(bias_ptr + rows_n, mask=rows_n < n, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + rows_m[:, None] * stride_om + rows_n[None, :], acc.to(out_ptr.dtype.element_ty),
                 mask=mask)
    else:  # out_ptr is the fp32 partial buffer [splits, M, N]
        tl.store(out_ptr + pid_k * m * n + rows_m[:, None] * n + rows_n[None, :], acc, mask=mask)


@triton.jit
def _sum_splits_kernel(partial_ptr, scale_ptr, bias_ptr, out_ptr, m, n, splits, stride_om, HAS_BIAS: tl.constexpr,
                       BLOCK: tl.constexpr):
    index = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inside = index < m * n
    total = tl.zeros((BLOCK,), dtype=tl.float32)
    for split in range(splits):
        total += tl.load(partial_ptr + split * m * n + index, mask=inside, other=0.0)
    total = total * tl.load(scale_ptr).to(tl.float32)
    row = index // n
    col = index % n
    if HAS_BIAS:
        total += tl.load(bias_ptr + col, mask=inside, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_om + col, total.to(out_ptr.dtype.element_ty), mask=inside)


class LaunchConfig(NamedTuple):
    """How one product is tiled: W's rows and K's run per tile, the warps and pipeline stages of a program, the
    number of runs K is split into, and which operand is the dot's left one."""

    block_n: int
    block_k: int
    warps: int
    stages: int
    split_k: int
    weight_first: bool = False


def launch_config(n: int, k: int) -> LaunchConfig:
    """The tiling of a product against [N, K]: 64 of W's rows and 128 of K per tile, three stages, and K split into
    the most runs (a power of two) that keep each run at least eight tiles long. These were the fastest of
    `bench decode-gemm`'s sweep for all four of Llama-3.1-8B's products at 8 rows on an H200."""
    block_k = 128
    split_k = 1
    while k // (2 * split_k) >= 8 * block_k:
        split_k *= 2
    return LaunchConfig(64, block_k, 4, 3, split_k)


def fp8_rows_matmul(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None,
                    config: tuple | None = None) -> torch.Tensor:
    """x [M, K] (16-bit, M <= LARGEST_BLOCK_M) @ (scale * weight [N, K] e4m3)^T (+ bias [N]) -> [M, N] in x's dtype;
    `scale` a one-element fp32 tensor; `config` a `LaunchConfig` (or its fields as a tuple) in place of
    `launch_config`'s."""
    m, k = x.shape
    n = weight.shape[0]
    if x.stride(1) != 1:
        x = x.contiguous()
    if weight.shape[1] != k or weight.stride(1) != 1:
        raise ValueError(f"need x [M, K] and weight [N, K] with unit column stride, got {tuple(x.shape)} and "
                         f"{tuple(weight.shape)}")
    if m > LARGEST_BLOCK_M:
        raise ValueError(f"this kernel is for at most {LARGEST_BLOCK_M} rows, got {m}")
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    block_m = max(16, triton.next_power_of_2(m))  # `tl.dot` needs at least 16 rows
    tiling = LaunchConfig(*config) if config is not None else launch_config(n, k)
    k_per_split = triton.cdiv(triton.cdiv(k, tiling.split_k), tiling.block_k) * tiling.block_k
    splits = triton.cdiv(k, k_per_split)  # no empty run
    target = out if splits == 1 else torch.empty((splits, m, n), dtype=torch.float32, device=x.device)
    bias_arg = bias if bias is not None else scale
    _fp8_rows_matmul_kernel[(triton.cdiv(n, tiling.block_n), splits)](
        x, weight, scale, bias_arg, target, m, n, k, k_per_split, x.stride(0), weight.stride(0), out.stride(0),
        HAS_BIAS=bias is not None, WIDE=INTERPRETED, ONE_SPLIT=splits == 1, WEIGHT_FIRST=tiling.weight_first,
        BLOCK_M=block_m, BLOCK_N=tiling.block_n, BLOCK_K=tiling.block_k, num_warps=tiling.warps,
        num_stages=tiling.stages)
    if splits > 1:
        block = 1024
        _sum_splits_kernel[(triton.cdiv(m * n, block),)](target, scale, bias_arg, out, m, n, splits, out.stride(0),
                                                          HAS_BIAS=bias is not None, BLOCK=block)
    return out
