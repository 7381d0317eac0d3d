"""Fused `hidden @ W.T -> log p(target)` (+ entropy) that never materialises the `[N, V]` logits.

Semantics follow TRL's `_ChunkedLogProbFunction`: the projection runs in the compute dtype (the autocast dtype when
autocast is on for the device, else `hidden.dtype`), then `z = softcap * tanh(logit_scale * x / softcap) /
temperature` (no softcap: `logit_scale * x / temperature`) and all statistics are fp32:
`logp = z[y] - logsumexp(z)`, `entropy = logsumexp(z) - sum(p * z)`.

Design. Tokens are processed in chunks of `chunk_tokens` rows; per chunk one cuBLAS GEMM fills a reused `[rows, V]`
tile (≈256 MiB on CUDA) and a Triton kernel (a torch equivalent off-GPU) folds it into logsumexp / logp / entropy.

Gradient basis (LoRA case: `hidden` needs a gradient, `weight`/`bias` do not). The hidden gradient of token t is
`g_lp[t] * u[t] + g_H[t] * v[t]` with `u = dz/dx * (onehot(y) - p) @ W` and `v = dz/dx * (-p * (z - lse + H)) @ W`.
While the tile is resident, a second kernel rewrites it in place into the `u` coefficients (and the `v` coefficients
into a second tile, only when the entropy may receive a gradient), and one more GEMM per chunk stores `u` (`v`) as
`[N, H]`. Backward is then an in-place row scaling of the saved `u` into the returned gradient: 2 GEMMs in total
instead of TRL's 3 (forward GEMM + recomputed GEMM + gradient GEMM), and no [N, H] buffer beyond the gradient itself.
Two measured precision choices keep the hidden gradient within 2x of the naive low-precision error: the target
column's O(1) coefficient is left out of the low-precision tile and added in fp32 as `dz/dx[y] * W[y]`; `u` alone is
kept in `hidden.dtype` (worst 1.24x), while `u` and `v` together are kept in fp32 (in bf16/fp16 their combined error
reaches 2.47x). The saved basis is consumed
by the first backward; a second backward (`retain_graph=True`) raises.

Recompute path (`weight` or `bias` needs a gradient: full fine-tuning, tied embeddings). Weight and bias gradients
need a sum over tokens of per-token coefficients times the upstream gradients, which only exist in backward, so
`hidden` is saved and backward recomputes each tile, rewrites it into `g_lp * dlogp/dx + g_H * dH/dx`, and
accumulates `grad_hidden`, `grad_weight`, `grad_bias` in fp32 (3 GEMMs, like TRL).

Without any gradient (no_grad, or nothing requires grad) only the statistics are computed and nothing is saved.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from packaging.version import Version

from .backend import TritonOrTorch

try:
    from ..kernels import logprob as _triton_logprob
except ImportError:  # Triton is Linux-only; elsewhere the torch tile functions below run the same algorithm
    _triton_logprob = None

# `torch.mm(..., out_dtype=torch.float32)` from bf16/fp16 inputs exists on CUDA only
_MM_OUT_DTYPE = Version(torch.__version__) >= Version("2.8.0")
_CUDA_TILE_BYTES = 256 * 2**20
_CPU_CHUNK_TOKENS = 1024


@dataclass(frozen=True)
class _Transform:
    logit_scale: float
    softcap: float | None
    inv_t: float


_backend = TritonOrTorch(_triton_logprob)
_force_backend = _backend.force  # tests: run the per-tile steps with "triton" or "torch" regardless of device
_triton_usable = _backend.usable
_use_triton = _backend.use_triton


def _torch_transform(tile: torch.Tensor, tf: _Transform) -> tuple[torch.Tensor, torch.Tensor | float]:
    x = tile.float() * tf.logit_scale
    if tf.softcap is None:
        return x * tf.inv_t, tf.inv_t * tf.logit_scale
    t = torch.tanh(x / tf.softcap)
    return tf.softcap * tf.inv_t * t, (1 - t * t) * (tf.inv_t * tf.logit_scale)


def _tile_stats_torch(
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
    """Torch version of `kernels.logprob.tile_logprob_stats`."""
    z, _ = _torch_transform(tile, _Transform(logit_scale, softcap, inv_t))
    lse.copy_(torch.logsumexp(z, dim=-1))
    logp.copy_(z.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - lse)
    if entropy is not None:
        entropy.copy_(lse - (torch.softmax(z, dim=-1) * z).sum(-1))


def _tile_grad_coefficients_torch(
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
    """Torch version of `kernels.logprob.tile_grad_coefficients`."""
    z, dz_dx = _torch_transform(tile, _Transform(logit_scale, softcap, inv_t))
    log_p = z - lse.unsqueeze(-1)
    p = log_p.exp()
    grad = -p
    if onehot:
        grad.scatter_add_(-1, targets.unsqueeze(-1), torch.ones_like(p[:, :1]))
    if g_lp is not None:
        grad.mul_(g_lp.unsqueeze(-1))
    if g_ent is not None or v_out is not None:
        ent_grad = -p * (log_p + entropy.unsqueeze(-1))
        if g_ent is not None:
            grad.add_(g_ent.unsqueeze(-1) * ent_grad)
        if v_out is not None:
            v_out.copy_(ent_grad * dz_dx)
    tile.copy_(grad * dz_dx)


def _tile_fns(device: torch.device) -> tuple[Callable[..., None], Callable[..., None]]:
    if _use_triton(device):
        return _triton_logprob.tile_logprob_stats, _triton_logprob.tile_grad_coefficients
    return _tile_stats_torch, _tile_grad_coefficients_torch


def _compute_dtype(hidden: torch.Tensor) -> torch.dtype:
    device_type = hidden.device.type
    return torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else hidden.dtype


def _default_chunk_tokens(device: torch.device, vocab: int, dtype: torch.dtype) -> int:
    if device.type != "cuda":
        return _CPU_CHUNK_TOKENS
    return max(128, min(4096, _CUDA_TILE_BYTES // (vocab * dtype.itemsize)))


def _mm_fp32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """`a @ b` accumulated and returned in fp32, without rounding the product to the inputs' dtype."""
    if a.dtype == torch.float32:
        return torch.mm(a, b)
    if _MM_OUT_DTYPE and a.device.type == "cuda":
        return torch.mm(a, b, out_dtype=torch.float32)
    return torch.mm(a.float(), b.float())


def _logits_tile(
    out: torch.Tensor, hidden_chunk: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> None:
    if bias is None:
        torch.mm(hidden_chunk, weight.t(), out=out)
    else:
        torch.addmm(bias, hidden_chunk, weight.t(), out=out)


def _forward(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    tf: _Transform,
    compute_entropy: bool,
    chunk_tokens: int | None,
    basis: bool,
    basis_v: bool,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Chunked forward. Returns `(logp, entropy, lse, u, v)`; `u`/`v` only when `basis`/`basis_v`."""
    n, vocab = hidden.shape[0], weight.shape[0]
    device = hidden.device
    compute_dtype = _compute_dtype(hidden)
    w = weight.to(compute_dtype)
    b = bias.to(compute_dtype) if bias is not None else None
    rows = chunk_tokens or _default_chunk_tokens(device, vocab, compute_dtype)
    stats_fn, coeff_fn = _tile_fns(device)
    kw = {"logit_scale": tf.logit_scale, "softcap": tf.softcap, "inv_t": tf.inv_t}

    lse = torch.empty(n, device=device, dtype=torch.float32)
    logp = torch.empty(n, device=device, dtype=torch.float32)
    entropy = torch.empty(n, device=device, dtype=torch.float32) if compute_entropy else None
    tile_buf = torch.empty(min(n, rows), vocab, device=device, dtype=compute_dtype)
    v_buf = torch.empty_like(tile_buf) if basis_v else None
    # `u` alone is stored in hidden.dtype (worst seen: 1.24x the naive low-precision error, inside the 2x bound, and
    # the backward scales it in place into the returned gradient: no extra [N, H] buffer). With the entropy basis
    # too, the two low-precision products combined exceed the bound (2.47x in fp16), so both are kept in fp32.
    basis_dtype = torch.float32 if basis_v else hidden.dtype
    u = torch.empty(hidden.shape, device=device, dtype=basis_dtype) if basis else None
    v = torch.empty(hidden.shape, device=device, dtype=basis_dtype) if basis_v else None

    for start in range(0, n, rows):
        end = min(start + rows, n)
        tile = tile_buf[: end - start]
        _logits_tile(tile, hidden[start:end].to(compute_dtype), w, b)
        ent_c = entropy[start:end] if entropy is not None else None
        stats_fn(tile, targets[start:end], lse[start:end], logp[start:end], ent_c, **kw)
        if basis:
            # The target column's O(1) coefficient would lose the most to the tile's low precision: keep it out of
            # the tile and add `dz/dx[target] * W[target]` in fp32 instead
            y_c = targets[start:end]
            _, dz_target = _torch_transform(tile.gather(1, y_c.unsqueeze(-1)).squeeze(-1), tf)
            dz_target = torch.as_tensor(dz_target, dtype=torch.float32, device=device).expand(y_c.shape)
            v_tile = v_buf[: end - start] if v_buf is not None else None
            coeff_fn(tile, y_c, lse[start:end], ent_c, v_tile, None, None, onehot=False, **kw)
            u[start:end] = _mm_fp32(tile, w).addcmul_(w[y_c].float(), dz_target.unsqueeze(-1))
            if v_tile is not None:
                v[start:end].copy_(_mm_fp32(v_tile, w))
    return logp, entropy, lse, u, v


def _check_entropy_grad(g_ent: torch.Tensor | None, allowed: bool) -> None:
    if g_ent is not None and not allowed:
        raise RuntimeError(
            "fused_logprobs(entropy_grad=False) was called, but a gradient reached the entropy output; "
            "detach the entropy or pass entropy_grad=None/True"
        )


class _BasisLogProb(torch.autograd.Function):
    """Hidden-only gradient from the basis `u` (`v`) computed in forward; backward runs no GEMM."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, tf, compute_entropy, entropy_grad, chunk_tokens):
        ctx.set_materialize_grads(False)
        basis_v = compute_entropy and entropy_grad
        logp, entropy, _, u, v = _forward(
            hidden, weight, bias, targets, tf, compute_entropy, chunk_tokens, basis=True, basis_v=basis_v
        )
        # Internal buffers (not inputs/outputs), freed by the first backward that consumes them
        ctx.u, ctx.v, ctx.entropy_grad, ctx.hidden_dtype = u, v, basis_v, hidden.dtype
        return logp, entropy

    @staticmethod
    def backward(ctx, g_lp, g_ent):
        _check_entropy_grad(g_ent, ctx.entropy_grad)
        if ctx.u is None:
            raise RuntimeError(
                "fused_logprobs: backward ran twice on the same graph; its gradient basis is consumed in place by "
                "the first backward, so retain_graph=True is not supported"
            )
        u, v = ctx.u, ctx.v
        ctx.u = ctx.v = None
        if g_lp is None and g_ent is None:
            return (None,) * 8
        if g_lp is None:
            grad = v.mul_(g_ent.float().unsqueeze(-1))
        else:
            grad = u.mul_(g_lp.float().unsqueeze(-1))
            if g_ent is not None:
                grad.addcmul_(v, g_ent.float().unsqueeze(-1))
        grad = grad.to(ctx.hidden_dtype)
        return grad, None, None, None, None, None, None, None


class _RecomputeLogProb(torch.autograd.Function):
    """Weight/bias (and hidden) gradients: backward recomputes each logits tile and runs 2 gradient GEMMs on it."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, tf, compute_entropy, entropy_grad, chunk_tokens):
        ctx.set_materialize_grads(False)
        logp, entropy, lse, _, _ = _forward(
            hidden, weight, bias, targets, tf, compute_entropy, chunk_tokens, basis=False, basis_v=False
        )
        ctx.save_for_backward(hidden, weight, bias, targets, lse, entropy)
        ctx.tf, ctx.chunk_tokens = tf, chunk_tokens
        ctx.entropy_grad = compute_entropy and entropy_grad
        return logp, entropy

    @staticmethod
    def backward(ctx, g_lp, g_ent):
        _check_entropy_grad(g_ent, ctx.entropy_grad)
        hidden, weight, bias, targets, lse, entropy = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        if g_lp is None and g_ent is None:
            return (None,) * 8
        n, vocab = hidden.shape[0], weight.shape[0]
        device = hidden.device
        tf = ctx.tf
        compute_dtype = _compute_dtype(hidden)
        w = weight.to(compute_dtype)
        b = bias.to(compute_dtype) if bias is not None else None
        rows = ctx.chunk_tokens or _default_chunk_tokens(device, vocab, compute_dtype)
        _, coeff_fn = _tile_fns(device)
        # The logp term is always scaled per row; a missing logp gradient scales it by zero
        g_lp = g_lp.float().contiguous() if g_lp is not None else torch.zeros_like(lse)
        g_ent = g_ent.float().contiguous() if g_ent is not None else None

        grad_h = torch.zeros(hidden.shape, device=device, dtype=torch.float32) if need_h else None
        grad_w = torch.zeros(weight.shape, device=device, dtype=torch.float32) if need_w else None
        grad_b = torch.zeros(bias.shape, device=device, dtype=torch.float32) if need_b else None
        tile_buf = torch.empty(min(n, rows), vocab, device=device, dtype=compute_dtype)
        for start in range(0, n, rows):
            end = min(start + rows, n)
            tile = tile_buf[: end - start]
            h_c = hidden[start:end].to(compute_dtype)
            _logits_tile(tile, h_c, w, b)
            coeff_fn(
                tile,
                targets[start:end],
                lse[start:end],
                entropy[start:end] if entropy is not None else None,
                None,
                g_lp[start:end],
                g_ent[start:end] if g_ent is not None else None,
                logit_scale=tf.logit_scale,
                softcap=tf.softcap,
                inv_t=tf.inv_t,
            )
            if grad_h is not None:
                grad_h[start:end] += _mm_fp32(tile, w)
            if grad_w is not None:
                grad_w += _mm_fp32(tile.t(), h_c)
            if grad_b is not None:
                grad_b += tile.sum(dim=0, dtype=torch.float32)
        return (
            grad_h.to(hidden.dtype) if grad_h is not None else None,
            grad_w.to(weight.dtype) if grad_w is not None else None,
            grad_b.to(bias.dtype) if grad_b is not None else None,
            None,
            None,
            None,
            None,
            None,
        )


def fused_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    temperature: float = 1.0,
    logit_scale: float = 1.0,
    softcap: float | None = None,
    compute_entropy: bool = False,
    entropy_grad: bool | None = None,
    chunk_tokens: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """fp32 `log p(targets)` (and entropy if `compute_entropy`) of `transform(hidden @ weight.T + bias)`.

    `hidden` is `[..., H]`, `targets` `[...]` (valid ids), `weight` `[V, H]`; outputs have `targets.shape`.
    `entropy_grad`: `None` = the entropy may receive a gradient, `True` = it will, `False` = it is only used detached
    (skips the entropy basis; a gradient reaching it raises).
    """
    if entropy_grad and not compute_entropy:
        raise ValueError("entropy_grad=True needs compute_entropy=True")
    shape = targets.shape
    h = hidden.reshape(-1, hidden.shape[-1])
    y = targets.reshape(-1).to(torch.int64).contiguous()
    tf = _Transform(float(logit_scale), None if softcap is None else float(softcap), 1.0 / float(temperature))
    params = (tf, compute_entropy, entropy_grad is not False, chunk_tokens)

    weight_grad = weight.requires_grad or (bias is not None and bias.requires_grad)
    if not torch.is_grad_enabled() or not (hidden.requires_grad or weight_grad):
        logp, entropy, _, _, _ = _forward(
            h, weight, bias, y, tf, compute_entropy, chunk_tokens, basis=False, basis_v=False
        )
    elif weight_grad:
        logp, entropy = _RecomputeLogProb.apply(h, weight, bias, y, *params)
    else:
        logp, entropy = _BasisLogProb.apply(h, weight, bias, y, *params)
    return logp.view(shape), entropy.view(shape) if entropy is not None else None


def reference_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    temperature: float = 1.0,
    logit_scale: float = 1.0,
    softcap: float | None = None,
    compute_entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Naive reference: full `[..., V]` logits in the compute dtype, fp32 transform + log_softmax, plain autograd."""
    logits = torch.nn.functional.linear(hidden.to(_compute_dtype(hidden)), weight, bias)
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32)) * logit_scale
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    log_probs = torch.log_softmax(logits / temperature, dim=-1)
    logp = log_probs.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    entropy = -(log_probs.exp() * log_probs).sum(-1) if compute_entropy else None
    return logp, entropy
