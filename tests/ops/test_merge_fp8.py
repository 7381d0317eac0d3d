"""The fp8 merge-quantize op (`trl_turbo.ops.merge_fp8`): the Triton kernels (TRITON_INTERPRET=1 on CPU) write the
same e4m3 bits and scale as the fp32 torch reference, and the result is within the tolerance rule of the exact merged
weight next to a naive path that merges in 16 bits before quantizing."""

from __future__ import annotations

import pytest
import torch

from trl_turbo.ops import merge_fp8
from trl_turbo.ops.merge_fp8 import FP8_DTYPE, FP8_MAX, MergedShard, reference_merged_fp8, write_merged_fp8
from trl_turbo.testing.tolerance import assert_within_naive_error

BACKENDS = ["torch", pytest.param("triton", marks=pytest.mark.skipif(
    merge_fp8._triton_merge_fp8 is None, reason="Triton not installed"))]
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # CPU: the kernels run interpreted


def _shards(dtype: torch.dtype, *, rank: int, seed: int = 0, k: int = 72) -> tuple[list[MergedShard], int]:
    """A fused tensor of three adapted shards (like q/k/v) and one without an adapter; sizes off the block grid."""
    generator = torch.Generator().manual_seed(seed)
    shards, start = [], 0
    for rows, adapted in ((40, True), (24, True), (24, True), (9, False)):
        weight = (torch.randn(rows, k, generator=generator) * 0.05).to(dtype)
        b = torch.randn(rows, rank, generator=generator) * 0.1 if adapted else None
        a = torch.randn(rank, k, generator=generator) * 0.1 if adapted else None
        shards.append(MergedShard(weight.to(DEVICE), None if b is None else b.to(DEVICE),
                                  None if a is None else a.to(DEVICE), 2.0, start))
        start += rows
    # values that land on e4m3 subnormals and exactly on ties once scaled, and one large outlier setting the scale
    shards[-1].weight[0, :4] = torch.tensor([1e-5, -3e-6, 0.0, 2e-4]).to(dtype).to(DEVICE)
    shards[-1].weight[1, 0] = 3.0
    return shards, start


def _fp32_reference(shards: list[MergedShard], rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 rows, scale) written here, independently of the module under test: each shard's W + scaling * B @ A in
    fp32 at its rows, one per-tensor scale amax / e4m3's max."""
    merged = torch.zeros(rows, shards[0].weight.shape[1], dtype=torch.float32, device=DEVICE)
    for shard in shards:
        block = shard.weight.float()
        if shard.b is not None:
            block = torch.add(block, shard.b.float() @ shard.a.float(), alpha=shard.scaling)
        merged[shard.start: shard.start + block.shape[0]] = block
    scale = merged.abs().max() / FP8_MAX
    return (merged / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


def test_the_module_reference_is_the_fp32_merge():
    shards, rows = _shards(torch.bfloat16, rank=5)
    expected, expected_scale = _fp32_reference(shards, rows)
    reference, scale = reference_merged_fp8(shards, rows)
    assert torch.equal(reference.view(torch.uint8), expected.view(torch.uint8))
    assert scale.item() == expected_scale.item()


def _assert_one_step_apart(out: torch.Tensor, expected: torch.Tensor, at_most: float) -> None:
    """Every value within one e4m3 step of the expected one, and at most a fraction `at_most` of them differing."""
    got, want = out.float(), expected.float()
    magnitude = torch.maximum(got.abs(), want.abs())
    step = torch.where(magnitude < 2**-6, torch.full_like(magnitude, 2**-9),
                       torch.exp2(torch.floor(torch.log2(magnitude.clamp(min=2**-6))) - 3))
    difference = (got - want).abs()
    assert bool((difference <= step).all()), difference.max()
    assert (difference > 0).float().mean().item() <= at_most


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rank", [5, 20])  # 20: more than one rank block in the kernel
def test_written_bits_equal_the_fp32_reference(backend, dtype, rank):
    shards, rows = _shards(dtype, rank=rank)
    expected, expected_scale = _fp32_reference(shards, rows)
    out = torch.full((rows, shards[0].weight.shape[1]), float("nan"), device=DEVICE).to(FP8_DTYPE)
    scale = torch.empty(1, device=DEVICE)
    with merge_fp8._force_backend(backend):
        write_merged_fp8(shards, out, scale)
    assert scale.item() == pytest.approx(expected_scale.item(), rel=1e-6)
    if DEVICE.type == "cpu":  # same summation order as the reference: the same bits
        assert torch.equal(out.view(torch.uint8), expected.view(torch.uint8))
    else:  # the GPU sums B @ A in another order: a value on a rounding boundary may land one fp8 step away
        _assert_one_step_apart(out, expected, at_most=0.01)
    assert out.float().abs().max().item() == FP8_MAX  # the largest merged value maps to the top of the range


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_error_against_the_exact_merge_is_within_the_naive_paths(backend, dtype):
    shards, rows = _shards(dtype, rank=8, seed=3)
    exact = torch.cat([s.weight.double() + (0 if s.b is None else s.scaling * (s.b.double() @ s.a.double()))
                       for s in shards])
    # naive: merge in 16 bits (rounded), then quantize that with the same per-tensor rule
    merged16 = torch.cat([s.weight + (0 if s.b is None else (s.scaling * (s.b @ s.a)).to(dtype)) for s in shards])
    naive_scale = merged16.float().abs().max() / FP8_MAX
    naive = (merged16.float() / naive_scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE).float() * naive_scale
    out = torch.empty(rows, shards[0].weight.shape[1], dtype=FP8_DTYPE, device=DEVICE)
    scale = torch.empty(1, device=DEVICE)
    with merge_fp8._force_backend(backend):
        write_merged_fp8(shards, out, scale)
    assert_within_naive_error(out.float() * scale, naive, exact, what=f"fp8 merge {dtype} {backend}")


def test_shards_write_only_their_rows_of_a_strided_output():
    """A shard's rows of a wider fused tensor: the kernel honours the row stride and leaves other rows alone."""
    shards, rows = _shards(torch.bfloat16, rank=4)
    wide = torch.zeros(rows + 5, shards[0].weight.shape[1], dtype=FP8_DTYPE, device=DEVICE)
    scale = torch.empty(1, device=DEVICE)
    write_merged_fp8(shards, wide[:rows], scale)
    assert torch.equal(wide[rows:].view(torch.uint8), torch.zeros_like(wide[rows:].view(torch.uint8)))
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        write_merged_fp8(shards, torch.empty(rows, shards[0].weight.shape[1], device=DEVICE), scale)


def test_an_all_zero_tensor_gets_a_positive_scale():
    shard = MergedShard(torch.zeros(4, 16, dtype=torch.bfloat16, device=DEVICE), None, None, 1.0, 0)
    out = torch.empty(4, 16, dtype=FP8_DTYPE, device=DEVICE)
    scale = torch.empty(1, device=DEVICE)
    write_merged_fp8([shard], out, scale)
    assert scale.item() > 0 and torch.equal(out.float().cpu(), torch.zeros(4, 16))
