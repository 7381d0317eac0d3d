"""Triton kernels for the fused linear -> selected-token log-prob op (`trl_turbo.ops.fused_logprob`).

Both kernels work on one resident `[rows, V]` logits tile that the caller filled with a cuBLAS GEMM, so the GEMMs stay
on tensor cores and the kernels only stream the tile once:

- `tile_logprob_stats`: one program per row, looping over the vocabulary in blocks with an online max / sum-exp,
  writes fp32 logsumexp, target log-prob and (optionally) entropy of the transformed logits.
- `tile_grad_coefficients`: rewrites the tile in place into `dlogp/dx` (the GEMM with `W` then gives the hidden
  gradient), optionally scaled per row by upstream gradients and optionally writing `dentropy/dx` to a second tile.

The transform is `z = softcap * tanh(logit_scale * x / softcap) / temperature` (no softcap: `logit_scale * x /
temperature`), evaluated in fp32; `tanh` is written as `2 * sigmoid(2x) - 1`, which exists under the same name in
every Triton version. With `TRITON_INTERPRET=1` set before this module is imported, the kernels also run on CPU
tensors (`INTERPRETED`).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

# `triton.jit` reads TRITON_INTERPRET when the kernels below are decorated, i.e. at this import
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"

STATS_BLOCK = 1024
COEFF_BLOCK = 1024


@triton.jit
def _transform(x, logit_scale, softcap, inv_t, HAS_SOFTCAP: tl.constexpr):
    # Returns the transformed logits z and dz/dx (the latter a scalar without softcap)
    x = x * logit_scale
    if HAS_SOFTCAP:
        t = 2 * tl.sigmoid(2 * x / softcap) - 1
        z = softcap * t * inv_t
        dz_dx = (1 - t * t) * (inv_t * logit_scale)
    else:
        z = x * inv_t
        dz_dx = inv_t * logit_scale + tl.zeros_like(x)
    return z, dz_dx


@triton.jit
def _round_bf16(x):
    # Round fp32 to the nearest-even bf16 value (still fp32): the interpreter truncates on `.to(tl.bfloat16)`, GPUs
    # round to nearest even, and the CPU tests must see the GPU's rounding
    bits = x.to(tl.uint32, bitcast=True)
    bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _stats_kernel(
    tile_ptr,
    tile_stride,
    targets_ptr,
    lse_ptr,
    logp_ptr,
    entropy_ptr,
    n_cols,
    logit_scale,
    softcap,
    inv_t,
    HAS_SOFTCAP: tl.constexpr,
    HAS_ENTROPY: tl.constexpr,
    BLOCK: tl.constexpr,
):
    logit_scale = tl.cast(logit_scale, tl.float32)
    softcap = tl.cast(softcap, tl.float32)
    inv_t = tl.cast(inv_t, tl.float32)
    row = tl.program_id(0).to(tl.int64)
    row_ptr = tile_ptr + row * tile_stride
    m = float("-inf")
    s = 0.0
    zs = 0.0
    for start in range(0, n_cols, BLOCK):
        offsets = start + tl.arange(0, BLOCK)
        mask = offsets < n_cols
        x = tl.load(row_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        z, _ = _transform(x, logit_scale, softcap, inv_t, HAS_SOFTCAP)
        new_m = tl.maximum(m, tl.max(tl.where(mask, z, float("-inf")), axis=0))
        rescale = tl.exp(m - new_m)
        e = tl.where(mask, tl.exp(z - new_m), 0.0)
        s = s * rescale + tl.sum(e, axis=0)
        if HAS_ENTROPY:
            zs = zs * rescale + tl.sum(e * tl.where(mask, z, 0.0), axis=0)
        m = new_m
    lse = m + tl.log(s)
    target = tl.load(targets_ptr + row)
    x_target = tl.load(row_ptr + target).to(tl.float32)
    z_target, _ = _transform(x_target, logit_scale, softcap, inv_t, HAS_SOFTCAP)
    tl.store(lse_ptr + row, lse)
    tl.store(logp_ptr + row, z_target - lse)
    if HAS_ENTROPY:
        tl.store(entropy_ptr + row, lse - zs / s)


@triton.jit
def _coeff_kernel(
    tile_ptr,
    tile_stride,
    v_ptr,
    v_stride,
    targets_ptr,
    lse_ptr,
    entropy_ptr,
    g_lp_ptr,
    g_ent_ptr,
    n_cols,
    logit_scale,
    softcap,
    inv_t,
    HAS_SOFTCAP: tl.constexpr,
    SCALE_LP: tl.constexpr,
    HAS_G_ENT: tl.constexpr,
    WRITE_V: tl.constexpr,
    ONEHOT: tl.constexpr,
    ROUND_BF16: tl.constexpr,
    BLOCK: tl.constexpr,
):
    logit_scale = tl.cast(logit_scale, tl.float32)
    softcap = tl.cast(softcap, tl.float32)
    inv_t = tl.cast(inv_t, tl.float32)
    row = tl.program_id(0).to(tl.int64)
    offsets = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n_cols
    ptrs = tile_ptr + row * tile_stride + offsets
    x = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    z, dz_dx = _transform(x, logit_scale, softcap, inv_t, HAS_SOFTCAP)
    lse = tl.load(lse_ptr + row)
    p = tl.exp(z - lse)
    # d(log p_target)/dz = onehot(target) - p
    grad = -p
    if ONEHOT:
        grad += (offsets == tl.load(targets_ptr + row)).to(tl.float32)
    if SCALE_LP:
        grad = grad * tl.load(g_lp_ptr + row)
    if HAS_G_ENT or WRITE_V:
        # d(entropy)/dz = -p * (log p + entropy)
        ent_grad = -p * (z - lse + tl.load(entropy_ptr + row))
        if HAS_G_ENT:
            grad += tl.load(g_ent_ptr + row) * ent_grad
        if WRITE_V:
            v = ent_grad * dz_dx
            if ROUND_BF16:
                v = _round_bf16(v)
            tl.store(v_ptr + row * v_stride + offsets, v.to(v_ptr.dtype.element_ty), mask=mask)
    grad = grad * dz_dx
    if ROUND_BF16:
        grad = _round_bf16(grad)
    tl.store(ptrs, grad.to(tile_ptr.dtype.element_ty), mask=mask)


def tile_logprob_stats(
    tile: torch.Tensor,
    targets: torch.Tensor,
    lse: torch.Tensor,
    logp: torch.Tensor,
    entropy: torch.Tensor | None,
    *,
    logit_scale: float,
    softcap: float | None,
    inv_t: float,
) -> None:
    """Write fp32 `lse`, `logp` (and `entropy` if given) for the rows of a `[rows, V]` raw-logits tile."""
    rows, n_cols = tile.shape
    _stats_kernel[(rows,)](
        tile,
        tile.stride(0),
        targets,
        lse,
        logp,
        entropy if entropy is not None else lse,
        n_cols,
        float(logit_scale),
        float(softcap or 1.0),
        float(inv_t),
        HAS_SOFTCAP=softcap is not None,
        HAS_ENTROPY=entropy is not None,
        BLOCK=STATS_BLOCK,
    )


def tile_grad_coefficients(
    tile: torch.Tensor,
    targets: torch.Tensor,
    lse: torch.Tensor,
    entropy: torch.Tensor | None,
    v_out: torch.Tensor | None,
    g_lp: torch.Tensor | None,
    g_ent: torch.Tensor | None,
    *,
    onehot: bool = True,
    logit_scale: float,
    softcap: float | None,
    inv_t: float,
) -> None:
    """Rewrite a raw-logits tile in place into `g_lp * dlogp/dx + g_ent * dentropy/dx` (`g_lp=None`: unit scale,
    `g_ent=None`: no entropy term, `onehot=False`: leave out the target's `+1 * dz/dx` in `dlogp/dx`); if `v_out` is
    given, also write the unscaled `dentropy/dx` into it."""
    rows, n_cols = tile.shape
    _coeff_kernel[(rows, triton.cdiv(n_cols, COEFF_BLOCK))](
        tile,
        tile.stride(0),
        v_out if v_out is not None else tile,
        v_out.stride(0) if v_out is not None else 0,
        targets,
        lse,
        entropy if entropy is not None else lse,
        g_lp if g_lp is not None else lse,
        g_ent if g_ent is not None else lse,
        n_cols,
        float(logit_scale),
        float(softcap or 1.0),
        float(inv_t),
        HAS_SOFTCAP=softcap is not None,
        SCALE_LP=g_lp is not None,
        HAS_G_ENT=g_ent is not None,
        WRITE_V=v_out is not None,
        ONEHOT=onehot,
        ROUND_BF16=INTERPRETED and tile.dtype == torch.bfloat16,
        BLOCK=COEFF_BLOCK,
    )
