"""Decode attention over a paged KV cache (vLLM's flash-attention layout), one query token per sequence, for the
sampling engine's decode steps (`ops.paged_decode_attention`).

A decode step's attention reads each sequence's live keys and values once; its floor is those bytes. FlashAttention 3
pays a fixed cost per launch that dominates short contexts (at 64 sequences of 16 tokens on an H200, about 20 us per
layer alone and 31 us inside vLLM) and reads long fp8 caches at 55-58% of the bandwidth. Design decisions:
- One program per (sequence, KV head, run of the context): the query heads that share the KV head (grouped-query
  attention) are the rows of one `tl.dot`, padded to 16 as the tensor cores need, so each key and value byte is
  read once for the whole group.
- The launch fixes the number of runs a sequence's context is cut into (from the batch and the GPU, never from the
  context: a CUDA graph captures the grid and replays it on every later context), and each sequence cuts its own
  context into that many runs of whole tiles, computed in the kernel from its length. A short context thus fills
  one tile of one run and the other runs exit at once, while a long one spreads over all of them: a fixed run
  length instead (long enough runs for the engine's longest context) launched thousands of empty programs per layer
  at short contexts, 3x the kernel's own time at 16 tokens. Each run keeps an online softmax (fp32 running max and
  sum) and writes its unnormalised output with the max and sum; a second kernel combines a sequence's runs in a
  fixed order (no atomics: the result does not depend on scheduling). Where one run holds a sequence's whole
  context (always so with one run), that run normalises and writes the output itself, and the combine skips it.
- A tile of `block_n` tokens gathers its pages through the block table, token by token, so any page size works
  (vLLM's is 16).
- fp8 caches (e4m3, one scale per tensor, as vLLM keeps them) and fp8 queries (vLLM quantizes them for FA3) are
  widened in registers to fp16, which holds every e4m3 value exactly and which Hopper converts to in one instruction
  (to bf16 a second conversion per element follows); the scales multiply the fp32
  scores (queries and keys) and the fp32 output (values), so the products themselves are exact. A cut may instead
  take the scores from e4m3 products of an e4m3 query and keys (`fp8_scores`: exact products, no key widened, which
  Hopper's fp8 tensor cores may sum at reduced precision, as in FA3), a candidate for `bench decode-attention`'s
  sweep. Probabilities enter the second product in the dot's 16-bit type (fp16 for e4m3, else the cache's). That
  product contracts over tokens, so its e4m3 values are transposed on their way from shared memory, which Triton
  does a byte at a time on Hopper (`ldmatrix` transposes 16-bit elements only): e4m3 reads at about 60% of the
  bandwidth at best, bf16 at 96%. Zero-length sequences (CUDA-graph padding) give zeros.

With `TRITON_INTERPRET=1` set before import the kernels also run on CPU tensors (`INTERPRETED`); the interpreter's
16-bit `tl.dot` is wrong, so there both operands are widened to fp32 first.
"""

from __future__ import annotations

import functools
import os
from typing import NamedTuple

import torch
import triton
import triton.language as tl

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
LOG2E = 1.4426950408889634
MIN_DOT_ROWS = 16
MIN_FP8_DOT_DEPTH = 32  # an e4m3 product's shared dimension
E4M3 = torch.float8_e4m3fn
_DOT_TYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}
PROGRAMS_PER_PROCESSOR = 4  # the default cut's target: enough programs to hide a gathered tile's latency
MIN_RUN_TILES = 4  # the default cut's shortest run, in tiles
COMBINE_CHUNK = 16  # runs the combine holds at once: registers bounded whatever the run count


def supported_head_dim(head_dim: int) -> bool:
    """Head sizes the kernel takes: powers of two the tensor cores' dot accepts."""
    return head_dim >= MIN_DOT_ROWS and not head_dim & (head_dim - 1)


def run_length(seq_len: int, runs: int, block_n: int) -> int:
    """Tokens per run of a `seq_len`-token sequence under a launch of `runs` runs: its context over the runs, in whole
    tiles (one tile at least). `_run_length` computes it in the kernels."""
    per_run = -(-seq_len // runs)
    return max(-(-per_run // block_n), 1) * block_n


@triton.jit
def _run_length(seq_len, runs, BLOCK_N: tl.constexpr):
    return tl.maximum(tl.cdiv(tl.cdiv(seq_len, runs), BLOCK_N), 1) * BLOCK_N


@triton.jit
def _paged_decode_runs_kernel(q_ptr, k_ptr, v_ptr, table_ptr, lens_ptr, q_scale_ptr, k_scale_ptr, v_scale_ptr, out_ptr,
                       acc_ptr, stats_ptr, qk_scale, runs,
                       stride_qt, stride_qh, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
                       stride_table, stride_ot, stride_oh,
                       GROUP: tl.constexpr, GROUP_ROWS: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr,
                       BLOCK_N: tl.constexpr, ONE_RUN: tl.constexpr, Q_SCALED: tl.constexpr,
                       KV_SCALED: tl.constexpr, DOT_TYPE: tl.constexpr, FP8_SCORES: tl.constexpr,
                       WIDE: tl.constexpr):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    run = tl.program_id(2)
    seq_len = tl.load(lens_ptr + seq)
    run_length = _run_length(seq_len, runs, BLOCK_N)
    start = run * run_length
    rows = tl.arange(0, GROUP_ROWS)
    real_rows = rows < GROUP
    heads = kv_head * GROUP + rows
    dims = tl.arange(0, HEAD_DIM)
    if start < seq_len:
        stop = tl.minimum(seq_len, start + run_length)
        q = tl.load(q_ptr + seq * stride_qt + heads[:, None] * stride_qh + dims[None, :], mask=real_rows[:, None],
                    other=0.0)
        scale = qk_scale  # softmax scale x log2(e), and the fp8 scales: applied to the fp32 scores
        if Q_SCALED:
            scale = scale * tl.load(q_scale_ptr).to(tl.float32)
        if KV_SCALED:
            scale = scale * tl.load(k_scale_ptr).to(tl.float32)
        if WIDE:
            q = q.to(tl.float32)
        elif not FP8_SCORES:  # else an e4m3 query meets the e4m3 keys as they are
            q = q.to(DOT_TYPE)
        running_max = tl.full((GROUP_ROWS,), float("-inf"), dtype=tl.float32)
        running_sum = tl.zeros((GROUP_ROWS,), dtype=tl.float32)
        acc = tl.zeros((GROUP_ROWS, HEAD_DIM), dtype=tl.float32)
        for tile in range(start, stop, BLOCK_N):
            tokens = tile + tl.arange(0, BLOCK_N)
            live = tokens < stop
            pages = tl.load(table_ptr + seq * stride_table + tokens // PAGE, mask=live, other=0).to(tl.int64)
            slots = tokens % PAGE
            k = tl.load(k_ptr + (pages * stride_kb + slots * stride_kt + kv_head * stride_kh)[:, None] + dims[None, :],
                        mask=live[:, None], other=0.0)
            v = tl.load(v_ptr + (pages * stride_vb + slots * stride_vt + kv_head * stride_vh)[:, None] + dims[None, :],
                        mask=live[:, None], other=0.0)
            if WIDE:
                scores = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee")
            elif FP8_SCORES:
                scores = tl.dot(q, tl.trans(k))
            else:
                scores = tl.dot(q, tl.trans(k.to(DOT_TYPE)))
            scores = tl.where(live[None, :], scores * scale, float("-inf"))
            new_max = tl.maximum(running_max, tl.max(scores, axis=1))
            probs = tl.exp2(scores - new_max[:, None])
            decay = tl.exp2(running_max - new_max)
            running_sum = running_sum * decay + tl.sum(probs, axis=1)
            if WIDE:
                acc = acc * decay[:, None] + tl.dot(probs, v.to(tl.float32), input_precision="ieee")
            else:
                acc = acc * decay[:, None] + tl.dot(probs.to(DOT_TYPE), v.to(DOT_TYPE))
            running_max = new_max
        if KV_SCALED:
            acc = acc * tl.load(v_scale_ptr).to(tl.float32)
        if seq_len <= run_length:  # the whole context in this one run (always so with one run): the output itself
            out = acc / tl.where(running_sum > 0, running_sum, 1.0)[:, None]
            tl.store(out_ptr + seq * stride_ot + heads[:, None] * stride_oh + dims[None, :],
                     out.to(out_ptr.dtype.element_ty), mask=real_rows[:, None])
        elif not ONE_RUN:  # acc [seqs, q heads, runs, dims] fp32; stats [seqs, q heads, runs, 2]: max and sum
            slot = (seq * (tl.num_programs(1) * GROUP) + heads) * runs + run
            tl.store(acc_ptr + slot[:, None] * HEAD_DIM + dims[None, :], acc, mask=real_rows[:, None])
            tl.store(stats_ptr + slot * 2, running_max, mask=real_rows)
            tl.store(stats_ptr + slot * 2 + 1, running_sum, mask=real_rows)
    elif run == 0:  # an empty sequence (CUDA-graph padding): zeros
        tl.store(out_ptr + seq * stride_ot + heads[:, None] * stride_oh + dims[None, :],
                 tl.zeros((GROUP_ROWS, HEAD_DIM), dtype=out_ptr.dtype.element_ty), mask=real_rows[:, None])


@triton.jit
def _paged_decode_combine_kernel(acc_ptr, stats_ptr, lens_ptr, out_ptr, runs, stride_ot, stride_oh,
                                 HEAD_DIM: tl.constexpr, CHUNK: tl.constexpr, BLOCK_N: tl.constexpr):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    seq_len = tl.load(lens_ptr + seq)
    length = _run_length(seq_len, runs, BLOCK_N)
    if seq_len > length:  # else one run (or none) held the context, and wrote the output itself
        used = tl.cdiv(seq_len, length)
        base = (seq * tl.num_programs(1) + head) * runs
        # CHUNK runs at a time (a long context over a small batch may have hundreds): the largest max first, then the
        # rescaled partial outputs and sums, in run order
        top = tl.full((), float("-inf"), tl.float32)
        for first in range(0, used, CHUNK):
            index = first + tl.arange(0, CHUNK)
            maxima = tl.load(stats_ptr + (base + index) * 2, mask=index < used, other=float("-inf"))
            top = tl.maximum(top, tl.max(maxima, axis=0))
        dims = tl.arange(0, HEAD_DIM)
        out = tl.zeros((HEAD_DIM,), dtype=tl.float32)
        total = tl.zeros((), dtype=tl.float32)
        for first in range(0, used, CHUNK):
            index = first + tl.arange(0, CHUNK)
            taken = index < used
            maxima = tl.load(stats_ptr + (base + index) * 2, mask=taken, other=float("-inf"))
            sums = tl.load(stats_ptr + (base + index) * 2 + 1, mask=taken, other=0.0)
            weights = tl.where(taken, tl.exp2(maxima - top), 0.0)
            partial = tl.load(acc_ptr + (base + index)[:, None] * HEAD_DIM + dims[None, :], mask=taken[:, None],
                              other=0.0)
            out += tl.sum(partial * weights[:, None], axis=0)
            total += tl.sum(weights * sums, axis=0)
        tl.store(out_ptr + seq * stride_ot + head * stride_oh + dims, (out / total).to(out_ptr.dtype.element_ty))


class DecodeAttentionConfig(NamedTuple):
    """How one launch is cut: tokens per tile, warps and pipeline stages of a program, the runs each sequence's
    context is cut into (each sequence in whole tiles of its own length), and, for an e4m3 query over e4m3 keys,
    whether the scores come from e4m3 products on the tensor cores (the same exact products, no key widened, summed
    at the tensor cores' fp8 precision; FA3's way) instead of fp16 ones."""

    block_n: int
    warps: int
    stages: int
    runs: int
    fp8_scores: bool = False


def decode_attention_config(max_seq_len: int, sequences: int, kv_heads: int, processors: int,
                            e4m3_cache: bool = False) -> DecodeAttentionConfig:
    """Two warps a program, and as many runs as give the GPU about `PROGRAMS_PER_PROCESSOR` programs per processor
    (rounded: one run at 64 sequences x 8 KV heads on 132 processors), no run shorter than `MIN_RUN_TILES` tiles at
    `max_seq_len`. Tiles of 64 tokens in three stages for an e4m3 cache, and for a 16-bit one where the batch fills the
    GPU with one run; else 32 in two. These are the fastest cuts `bench decode-attention` timed on an H200: at 64
    sequences x 8 KV heads one run of 64-token tiles was 19-39% under FA3 at 320-512 tokens and 6-7% at 1984, both
    caches; at 8 sequences x 1984 tokens the e4m3 cut (eight runs) ties FA3, and the 16-bit one was 4% over at nine
    runs (eight not timed). The cut depends on the batch and the longest context only, so a CUDA graph captured for a
    batch size serves every context up to `max_seq_len`."""
    wanted = max(1, round(PROGRAMS_PER_PROCESSOR * processors / max(1, sequences * kv_heads)))
    block_n, stages = (64, 3) if e4m3_cache or wanted == 1 else (32, 2)
    runs = max(1, min(wanted, -(-max_seq_len // (MIN_RUN_TILES * block_n))))
    return DecodeAttentionConfig(block_n, 2, stages, runs)


@functools.cache
def _processors(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def paged_decode_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                           block_table: torch.Tensor, seq_lens: torch.Tensor, *, softmax_scale: float,
                           max_seq_len: int, out: torch.Tensor | None = None, q_scale: torch.Tensor | None = None,
                           k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                           config: DecodeAttentionConfig | tuple | None = None) -> torch.Tensor:
    """Attention of `query` [T, Hq, D] (one token per sequence, 16-bit or e4m3 under `q_scale`) over the first
    `seq_lens[t]` tokens of sequence t in the paged caches [blocks, page, Hkv, D] (16-bit, or e4m3 under `k_scale`
    and `v_scale`, one-element fp32 tensors) whose pages `block_table` [T, pages] lists. `max_seq_len` bounds every
    `seq_lens` the launch may see (a CUDA graph replays its grid); it shapes the default cut only. Returns `out`
    [T, Hq, D] (16-bit; required for an e4m3 query)."""
    tokens, q_heads, head_dim = query.shape
    _, page, kv_heads, cache_dim = key_cache.shape
    if cache_dim != head_dim or value_cache.shape != key_cache.shape or q_heads % kv_heads:
        raise ValueError(f"query {tuple(query.shape)} does not match caches {tuple(key_cache.shape)} / "
                         f"{tuple(value_cache.shape)}")
    if not supported_head_dim(head_dim) or query.stride(2) != 1 or key_cache.stride(3) != 1 or (
            value_cache.stride(3) != 1 or block_table.stride(1) != 1):
        raise ValueError(f"need a power-of-two head size of at least {MIN_DOT_ROWS} (got {head_dim}), unit stride in "
                         "the query, both caches and the block table")
    e4m3_query, e4m3_cache = query.dtype == E4M3, key_cache.dtype == E4M3
    if (key_cache.dtype not in _DOT_TYPES and not e4m3_cache) or value_cache.dtype != key_cache.dtype or (
            e4m3_query and not e4m3_cache) or (query.dtype not in _DOT_TYPES and not e4m3_query):
        raise ValueError(f"query and caches are bf16, fp16 or e4m3 (an e4m3 query with e4m3 caches), got "
                         f"{query.dtype}, {key_cache.dtype}, {value_cache.dtype}")
    if (q_scale is not None) != e4m3_query or (k_scale is None) != (v_scale is None) or (k_scale is None) == e4m3_cache:
        raise ValueError("an e4m3 query needs q_scale; e4m3 caches need k_scale and v_scale, others none")
    if any(scale is not None and scale.numel() != 1 for scale in (q_scale, k_scale, v_scale)):
        raise ValueError("the scales are one per tensor (one element each)")
    if out is None:
        if e4m3_query:
            raise ValueError("pass `out` for an e4m3 query")
        out = torch.empty_like(query)
    if out.shape != query.shape or out.stride(2) != 1:
        raise ValueError(f"`out` must be {tuple(query.shape)} with unit stride in its last dimension")
    if tokens == 0:
        return out
    group = q_heads // kv_heads
    if config is not None:
        tiling = DecodeAttentionConfig(*config)
    else:
        processors = _processors(query.device.index or 0) if query.device.type == "cuda" else 1
        tiling = decode_attention_config(max_seq_len, tokens, kv_heads, processors, e4m3_cache)
    if tiling.runs < 1 or tiling.block_n < MIN_DOT_ROWS or tiling.block_n & (tiling.block_n - 1):
        raise ValueError(f"{tiling}: at least one run, and tiles of a power of two of at least {MIN_DOT_ROWS} tokens")
    if tiling.fp8_scores and (not e4m3_query or head_dim < MIN_FP8_DOT_DEPTH):
        raise ValueError(f"{tiling}: e4m3 scores need an e4m3 query and e4m3 keys, and a head size of at least "
                         f"{MIN_FP8_DOT_DEPTH} (got {head_dim})")
    runs = tiling.runs
    one_run = runs == 1
    if one_run:
        acc = stats = out
    else:
        acc = torch.empty((tokens, q_heads, runs, head_dim), dtype=torch.float32, device=query.device)
        stats = torch.empty((tokens, q_heads, runs, 2), dtype=torch.float32, device=query.device)
    dummy = seq_lens  # a pointer for the scales a launch does not read
    lens = seq_lens if seq_lens.dtype == torch.int32 else seq_lens.to(torch.int32)
    _paged_decode_runs_kernel[(tokens, kv_heads, runs)](
        query, key_cache, value_cache, block_table, lens,
        q_scale if q_scale is not None else dummy, k_scale if k_scale is not None else dummy,
        v_scale if v_scale is not None else dummy, out, acc, stats, softmax_scale * LOG2E, runs,
        query.stride(0), query.stride(1), key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2), block_table.stride(0),
        out.stride(0), out.stride(1),
        GROUP=group, GROUP_ROWS=max(MIN_DOT_ROWS, triton.next_power_of_2(group)), HEAD_DIM=head_dim, PAGE=page,
        BLOCK_N=tiling.block_n, ONE_RUN=one_run, Q_SCALED=q_scale is not None, KV_SCALED=k_scale is not None,
        DOT_TYPE=tl.float16 if e4m3_cache else _DOT_TYPES[key_cache.dtype], FP8_SCORES=tiling.fp8_scores,
        WIDE=INTERPRETED, num_warps=tiling.warps, num_stages=tiling.stages)
    if not one_run:
        _paged_decode_combine_kernel[(tokens, q_heads)](
            acc, stats, lens, out, runs, out.stride(0), out.stride(1), HEAD_DIM=head_dim,
            CHUNK=min(COMBINE_CHUNK, triton.next_power_of_2(runs)), BLOCK_N=tiling.block_n)
    return out
