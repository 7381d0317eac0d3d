"""Decode attention over vLLM's paged KV cache: the Triton kernel (`kernels.paged_decode_attention`) where it can
run, else a torch reference that gathers each sequence's pages and computes in fp32.

Design decision: the reference is the definition the kernel is tested against, and the path where Triton or e4m3
cannot run (CPU without the interpreter, GPUs before Ada with an fp8 cache). Both take the same arguments: a query
token per sequence [T, Hq, D], the caches [blocks, page, Hkv, D] with their block table and lengths, and the fp8
scales (one fp32 element each) where the query or the caches are e4m3.
"""

from __future__ import annotations

import torch

from .backend import TritonOrTorch

try:
    from ..kernels import paged_decode_attention as _triton_decode
except ImportError:  # no Triton: the reference serves
    _triton_decode = None

_backend = TritonOrTorch(_triton_decode)
_force_backend = _backend.force  # tests: "triton" or "torch" regardless of device


def reference(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, block_table: torch.Tensor,
              seq_lens: torch.Tensor, *, softmax_scale: float, out: torch.Tensor | None = None,
              q_scale: torch.Tensor | None = None, k_scale: torch.Tensor | None = None,
              v_scale: torch.Tensor | None = None, compute_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Softmax attention of each query token over its sequence's first `seq_lens[t]` cached tokens, in
    `compute_dtype` (tests: fp64), rounded once into `out` (or a tensor like a 16-bit query, bf16 for an e4m3 one);
    zeros for an empty sequence."""
    tokens, q_heads, head_dim = query.shape
    page, kv_heads = key_cache.shape[1], key_cache.shape[2]
    group = q_heads // kv_heads

    def _widened(tensor: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
        wide = tensor.to(compute_dtype)
        return wide if scale is None else wide * scale.to(compute_dtype)

    result = torch.zeros((tokens, q_heads, head_dim), dtype=compute_dtype, device=query.device)
    q = _widened(query, q_scale)
    for t, length in enumerate(seq_lens.tolist()):
        if length == 0:
            continue
        pages = block_table[t, : -(-length // page)].long()
        keys = _widened(key_cache[pages].reshape(-1, kv_heads, head_dim)[:length], k_scale)
        values = _widened(value_cache[pages].reshape(-1, kv_heads, head_dim)[:length], v_scale)
        keys = keys.repeat_interleave(group, dim=1)  # [length, Hq, D]
        values = values.repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,lhd->hl", q[t], keys) * softmax_scale
        result[t] = torch.einsum("hl,lhd->hd", scores.softmax(dim=-1), values)
    if out is None:
        return result.to(query.dtype if query.element_size() > 1 else torch.bfloat16)
    out.copy_(result)
    return out


def _fp8_capable(device: torch.device) -> bool:
    return device.type != "cuda" or torch.cuda.get_device_capability(device) >= (8, 9)


def kernel_serves(query: torch.Tensor, key_cache: torch.Tensor) -> bool:
    """Whether `paged_decode_attention` runs the Triton kernel on these inputs (Triton usable on their device, e4m3
    in hardware where they are e4m3, a head size the kernel takes) rather than the reference."""
    e4m3 = query.element_size() == 1 or key_cache.element_size() == 1
    return (_backend.use_triton(query.device) and (not e4m3 or _fp8_capable(query.device))
            and _triton_decode.supported_head_dim(query.shape[-1]))


def paged_decode_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                           block_table: torch.Tensor, seq_lens: torch.Tensor, *, softmax_scale: float,
                           max_seq_len: int, out: torch.Tensor | None = None, q_scale: torch.Tensor | None = None,
                           k_scale: torch.Tensor | None = None,
                           v_scale: torch.Tensor | None = None,
                           config: tuple | None = None) -> torch.Tensor:
    """The kernel where it serves (`kernel_serves`), else `reference`; arguments as
    `kernels.paged_decode_attention.paged_decode_attention`."""
    if kernel_serves(query, key_cache):
        return _triton_decode.paged_decode_attention(
            query, key_cache, value_cache, block_table, seq_lens, softmax_scale=softmax_scale,
            max_seq_len=max_seq_len, out=out, q_scale=q_scale, k_scale=k_scale, v_scale=v_scale, config=config)
    return reference(query, key_cache, value_cache, block_table, seq_lens, softmax_scale=softmax_scale, out=out,
                     q_scale=q_scale, k_scale=k_scale, v_scale=v_scale)
