"""A Triton matmul for decode-sized batches against an e4m3 weight with one scale per tensor, the activations kept
16-bit (weight-only fp8): out[M, N] = x[M, K] @ (scale * W[N, K])^T (+ bias), for the sampling engine's fp8 copy
(`trl_turbo.ops.fp8_linear`).

At a decode step M is the number of live sequences (8 to 64 in GRPO), so the product is bound by reading W once;
vLLM's W8A8 GEMM also quantizes every activation row first and reaches about two thirds of the weight's read floor
there. Each program owns BLOCK_N of W's rows and walks all of K: it loads a [BLOCK_K, BLOCK_N] tile of fp8 bytes
(W's rows as columns), widens it to the activations' dtype in registers and accumulates x @ tile in fp32 on the
tensor cores (M padded to at least 16 rows with masked zeros, as `tl.dot` needs). The scale multiplies the fp32 sum
once at the end. No split over K: N is several thousand in every decoder matrix, so N / BLOCK_N programs already
cover the GPU, and the sum over K stays in one order (the result does not depend on the launch).

With `TRITON_INTERPRET=1` set before this module is imported, the kernel also runs on CPU tensors (`INTERPRETED`);
the interpreter's 16-bit `tl.dot` is wrong, so there both operands are widened to fp32 first (the same exact products:
every 16-bit and e4m3 value is an fp32 value).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"

LARGEST_BLOCK_M = 64  # all of M sits in one tile's registers: decode-sized batches only


@triton.jit
def _fp8_rows_matmul_kernel(x_ptr, w_ptr, scale_ptr, bias_ptr, out_ptr, m, n, k, stride_xm, stride_wn, stride_om,
                            HAS_BIAS: tl.constexpr, WIDE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                            BLOCK_K: tl.constexpr):
    pid_n = tl.program_id(0)
    rows_m = tl.arange(0, BLOCK_M)
    rows_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, k, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + rows_m[:, None] * stride_xm + cols[None, :],
                    mask=(rows_m[:, None] < m) & (cols[None, :] < k), other=0.0)
        # W's tile loaded as [BLOCK_K, BLOCK_N] (the dot's right operand as it is consumed, no transpose in
        # registers); consecutive k are consecutive bytes
        w = tl.load(w_ptr + rows_n[None, :] * stride_wn + cols[:, None],
                    mask=(rows_n[None, :] < n) & (cols[:, None] < k), other=0.0)
        if WIDE:
            acc += tl.dot(x.to(tl.float32), w.to(tl.float32), input_precision="ieee")
        else:
            acc += tl.dot(x, w.to(x.dtype))
    acc = acc * tl.load(scale_ptr).to(tl.float32)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rows_n, mask=rows_n < n, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + rows_m[:, None] * stride_om + rows_n[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=(rows_m[:, None] < m) & (rows_n[None, :] < n))


def launch_config(block_m: int) -> tuple[int, int, int, int]:
    """(BLOCK_N, BLOCK_K, warps, stages) for a tile of `block_m` rows: narrow tiles of N, so that even N = 4096
    gives two programs per SM of an H100/H200, each with several tiles of fp8 bytes in flight; K's tile shrinks as
    M's grows, to keep the activations' tiles in shared memory."""
    return 16, {16: 512, 32: 256}.get(block_m, 128), 4, 4


def fp8_rows_matmul(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None,
                    config: tuple[int, int, int, int] | None = None) -> torch.Tensor:
    """x [M, K] (16-bit, M <= LARGEST_BLOCK_M) @ (scale * weight [N, K] e4m3)^T (+ bias [N]) -> [M, N] in x's dtype;
    `scale` a one-element fp32 tensor; `config` (BLOCK_N, BLOCK_K, warps, stages) in place of `launch_config`'s."""
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
    block_m = max(16, triton.next_power_of_2(m))
    block_n, block_k, warps, stages = config or launch_config(block_m)
    _fp8_rows_matmul_kernel[(triton.cdiv(n, block_n),)](
        x, weight, scale, bias if bias is not None else scale, out, m, n, k, x.stride(0), weight.stride(0),
        out.stride(0), HAS_BIAS=bias is not None, WIDE=INTERPRETED, BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_K=block_k, num_warps=warps, num_stages=stages)
    return out
