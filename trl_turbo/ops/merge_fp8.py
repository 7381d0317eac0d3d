"""An fp8 (e4m3, one scale per tensor) copy of merged LoRA weights, written in place into a sampler's weight tensor.

Design decision: the merged weight W + scaling * B @ A is the objective the sampler should serve, so it is formed in
fp32 and quantized once: never rounded to 16 bits first (that would add a second rounding) and never materialized
whole (the Triton path computes it tile by tile in registers, twice: once for the amax, once to quantize). A fused
sampler tensor (q/k/v, gate/up) holds several HF matrices as row blocks under ONE per-tensor scale, as vLLM's online
fp8 layers do, so the amax runs over every shard before any shard is written. The scale rule is vLLM's dynamic
per-tensor one: amax / FP8_MAX. The torch path (any device; the reference of the tests) computes the same thing in
row blocks of bounded fp32 scratch.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from .backend import TritonOrTorch

try:
    from ..kernels import merge_fp8 as _triton_merge_fp8
except ImportError:  # no Triton (macOS, Windows): the torch path serves every device
    _triton_merge_fp8 = None

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448
_MIN_AMAX = 1e-12  # an all-zero tensor gets a tiny positive scale, never a division by zero
_BLOCK_BYTES = 64 << 20  # fp32 scratch of one torch-path block


@dataclass(frozen=True)
class MergedShard:
    """HF matrix `weight` [rows, K] (16 bits) plus `scaling * b @ a` (b [rows, r], a [r, K]; None: no adapter), stored
    at rows [start, start + rows) of the fused output."""

    weight: torch.Tensor
    b: torch.Tensor | None
    a: torch.Tensor | None
    scaling: float
    start: int

    @property
    def stop(self) -> int:
        return self.start + self.weight.shape[0]


_backend = TritonOrTorch(_triton_merge_fp8)
_force_backend = _backend.force  # tests: run with "triton" or "torch" regardless of device
_use_triton = _backend.use_triton


def _merged_rows(shard: MergedShard, start: int, stop: int) -> torch.Tensor:
    block = shard.weight[start:stop].float()
    if shard.b is None or shard.a is None:
        return block
    delta = shard.b[start:stop].to(device=block.device, dtype=torch.float32) @ shard.a.to(block.device, torch.float32)
    return block.add_(delta, alpha=shard.scaling)


def _row_blocks(shard: MergedShard) -> Iterator[tuple[int, int]]:
    rows = max(1, _BLOCK_BYTES // (4 * max(1, shard.weight.shape[1])))
    for start in range(0, shard.weight.shape[0], rows):
        yield start, min(start + rows, shard.weight.shape[0])


def merged_amax(shard: MergedShard) -> torch.Tensor:
    """max |W + scaling * B @ A| of one shard (a 0-d fp32 tensor on the weight's device)."""
    if _use_triton(shard.weight.device):
        return _triton_merge_fp8.tile_merged_amax(shard.weight, shard.b, shard.a, shard.scaling).max()
    return torch.stack([_merged_rows(shard, s, e).abs().max() for s, e in _row_blocks(shard)]).max()


def quantize_merged(shard: MergedShard, scale: torch.Tensor, out: torch.Tensor) -> None:
    """out <- e4m3(clamp((W + scaling * B @ A) / scale, +-FP8_MAX)), `out` the shard's rows of the fused tensor."""
    if _use_triton(shard.weight.device):
        _triton_merge_fp8.tile_merged_fp8(shard.weight, shard.b, shard.a, shard.scaling, scale, out, FP8_MAX)
        return
    for s, e in _row_blocks(shard):
        out[s:e].copy_((_merged_rows(shard, s, e) / scale).clamp_(-FP8_MAX, FP8_MAX).to(out.dtype))


@torch.no_grad()
def write_merged_fp8(shards: Sequence[MergedShard], out: torch.Tensor, scale: torch.Tensor) -> None:
    """Write every shard's merged rows into `out` [N, K] (e4m3, rows a view of the sampler's tensor) under one
    per-tensor `scale` (a one-element fp32 tensor, written in place: amax over all shards / FP8_MAX)."""
    if out.dtype != FP8_DTYPE:
        raise ValueError(f"the fp8 output must be {FP8_DTYPE}, got {out.dtype}")
    amax = torch.stack([merged_amax(shard).to(scale.device) for shard in shards]).max()
    scale.copy_((amax.clamp(min=_MIN_AMAX) / FP8_MAX).reshape(scale.shape).to(scale.dtype))
    for shard in shards:
        quantize_merged(shard, scale.reshape(()).float(), out[shard.start : shard.stop])


def reference_merged_fp8(shards: Sequence[MergedShard], rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 [rows, K], scale) computed whole in fp32 with torch: what `write_merged_fp8` must produce."""
    merged = torch.zeros(rows, shards[0].weight.shape[1], dtype=torch.float32, device=shards[0].weight.device)
    for shard in shards:
        merged[shard.start : shard.stop] = _merged_rows(shard, 0, shard.weight.shape[0])
    scale = merged.abs().max().clamp(min=_MIN_AMAX) / FP8_MAX
    return (merged / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale
