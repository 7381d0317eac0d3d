"""The weight-only fp8 linear op (`trl_turbo.ops.fp8_linear`): the Triton rows kernel (TRITON_INTERPRET=1 on CPU)
against an fp32 reference within the tolerance rule, next to the naive path that dequantizes to bf16 first; the op's
dispatch by rows; and the op inside a compiled graph (its fake shape)."""

from __future__ import annotations

import pytest
import torch

from trl_turbo.ops import fp8_linear as fp8_linear_module
from trl_turbo.ops.fp8_linear import FP8_DTYPE, MAX_ROWS, reference
from trl_turbo.testing.tolerance import assert_within_naive_error

needs_triton = pytest.mark.skipif(fp8_linear_module._triton_fp8_rows is None, reason="Triton not installed")
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # CPU: the kernel runs interpreted


def _inputs(m: int, n: int, k: int, *, seed: int = 0, bias: bool = False):
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(n, k, generator=generator) * 0.05
    scale = (weight.abs().max() / torch.finfo(FP8_DTYPE).max).reshape(1)
    fp8 = (weight / scale).to(FP8_DTYPE)
    x = torch.randn(m, k, generator=generator).to(torch.bfloat16)
    b = (torch.randn(n, generator=generator) * 0.1).to(torch.bfloat16) if bias else None
    return (x.to(DEVICE), fp8.to(DEVICE), scale.to(DEVICE), None if b is None else b.to(DEVICE))


def _exact(x, weight, scale, bias):
    out = x.double() @ (weight.double() * scale.double()).T
    return out if bias is None else out + bias.double()


def _naive(x, weight, scale, bias):
    """Dequantize to bf16, then a bf16 matmul: what a plain torch port of the layer would do."""
    out = x @ (weight.to(torch.bfloat16) * scale.to(torch.bfloat16)).T
    return out if bias is None else out + bias


@needs_triton
@pytest.mark.parametrize("m", [1, 7, 16, 33, 64])
@pytest.mark.parametrize("bias", [False, True])
def test_the_rows_kernel_is_within_the_naive_error_of_the_exact_product(m, bias):
    from trl_turbo.kernels.fp8_rows_matmul import fp8_rows_matmul

    x, weight, scale, b = _inputs(m, 72, 300, seed=m, bias=bias)  # N, K off every block size
    # the launch's own; K split in two runs; W as the dot's left operand, whole and split
    for config in (None, (32, 64, 4, 2, 2), (32, 64, 4, 2, 1, True), (32, 64, 4, 2, 2, True)):
        result = fp8_rows_matmul(x, weight, scale, b, config=config)
        assert result.shape == (m, 72) and result.dtype == torch.bfloat16
        assert_within_naive_error(result, _naive(x, weight, scale, b), _exact(x, weight, scale, b),
                                  what=f"m={m}, {config}")


@needs_triton
def test_the_rows_kernel_reads_strided_activations_and_refuses_what_it_cannot_tile():
    from trl_turbo.kernels.fp8_rows_matmul import LARGEST_BLOCK_M, fp8_rows_matmul

    x, weight, scale, _ = _inputs(8, 40, 64)
    wide = torch.zeros(64, 8, dtype=x.dtype, device=DEVICE)
    wide.copy_(x.T)
    expected = fp8_rows_matmul(x, weight, scale)
    # a transposed view (copied first) and rows of a wider tensor (read in place) give the same bits
    assert torch.equal(fp8_rows_matmul(wide.T, weight, scale), expected)
    padded = torch.zeros(8, 72, dtype=x.dtype, device=DEVICE)
    padded[:, :64] = x
    assert padded[:, :64].stride() == (72, 1)
    assert torch.equal(fp8_rows_matmul(padded[:, :64], weight, scale), expected)
    with pytest.raises(ValueError, match="unit column stride"):
        fp8_rows_matmul(x, weight.T.contiguous().T, scale)
    big, _, _, _ = _inputs(LARGEST_BLOCK_M + 1, 40, 64)
    with pytest.raises(ValueError, match="at most"):
        fp8_rows_matmul(big, weight, scale)


@needs_triton
def test_decode_sized_batches_take_the_kernel_and_others_the_large_batch_path():
    x, weight, scale, b = _inputs(MAX_ROWS, 48, 64, bias=True)
    from trl_turbo.kernels.fp8_rows_matmul import fp8_rows_matmul

    with fp8_linear_module._force_backend("triton"):
        torch.testing.assert_close(torch.ops.trl_turbo.fp8_linear(x, weight, scale, b),
                                   fp8_rows_matmul(x, weight, scale, b), rtol=0, atol=0)
    with fp8_linear_module._force_backend("torch"):  # no Triton: the reference serves
        torch.testing.assert_close(torch.ops.trl_turbo.fp8_linear(x, weight, scale, b),
                                   reference(x, weight, scale, b), rtol=0, atol=0)
    prefill, _, _, _ = _inputs(MAX_ROWS + 1, 48, 64)
    expected = reference(prefill, weight, scale) if DEVICE.type == "cpu" else None
    result = torch.ops.trl_turbo.fp8_linear(prefill, weight, scale, None)
    if expected is not None:  # without fp8 tensor cores a larger batch is the reference
        torch.testing.assert_close(result, expected, rtol=0, atol=0)
    assert result.shape == (MAX_ROWS + 1, 48)


def test_the_reference_rounds_once_from_fp32():
    x, weight, scale, b = _inputs(5, 24, 40, bias=True)
    exact = _exact(x, weight, scale, b)
    assert torch.equal(reference(x, weight, scale, b), exact.float().to(torch.bfloat16))


@pytest.mark.parametrize("rows", [6, MAX_ROWS + 2])
def test_the_ops_fake_agrees_with_it_for_compilers(rows):
    x, weight, scale, b = _inputs(rows, 32, 48, bias=True)
    torch.library.opcheck(torch.ops.trl_turbo.fp8_linear.default, (x, weight, scale, b),
                          test_utils=("test_faketensor", "test_aot_dispatch_dynamic"))


def test_the_op_is_opaque_to_a_compiled_graph():
    x, weight, scale, b = _inputs(6, 32, 48, bias=True)

    def layer(rows: torch.Tensor) -> torch.Tensor:
        return torch.ops.trl_turbo.fp8_linear(rows, weight, scale, b) * 2

    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(x), layer(x), rtol=0, atol=0)


@needs_triton
@pytest.mark.parametrize("m", [3, 40])
@pytest.mark.parametrize("split_k", [1, 3])
@pytest.mark.parametrize("weight_first", [False, True])
def test_the_rows_kernel_is_exact_where_every_product_and_sum_is_representable(m, split_k, weight_first):
    """Small integers in x and in the e4m3 weight, a power-of-two scale: every partial sum is an integer below bf16's
    256, so any tiling or masking mistake (or a scale applied twice or not at all) shows as a wrong value."""
    from trl_turbo.kernels.fp8_rows_matmul import fp8_rows_matmul

    generator = torch.Generator().manual_seed(m)
    x = torch.randint(-2, 3, (m, 37), generator=generator).to(torch.bfloat16).to(DEVICE)
    weight = torch.randint(-2, 3, (29, 37), generator=generator).to(FP8_DTYPE).to(DEVICE)
    scale = torch.tensor([0.5], device=DEVICE)
    bias = torch.randint(-3, 4, (29,), generator=generator).to(torch.bfloat16).to(DEVICE)
    expected = (x.float() @ weight.float().T * 0.5 + bias.float()).to(torch.bfloat16)
    # 16-wide tiles of N and K: K = 37 in three runs of 16, 16 and 5 columns, added by the second kernel
    assert torch.equal(fp8_rows_matmul(x, weight, scale, bias, config=(16, 16, 4, 2, split_k, weight_first)),
                       expected)
    assert torch.equal(fp8_rows_matmul(x, weight, scale, bias), expected)  # the launch's own configuration


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
                    reason="needs a GPU with e4m3 (Ada, Hopper)")
def test_larger_batches_are_w8a8_with_rows_quantized_as_vllm_does():
    x, weight, scale, b = _inputs(200, 256, 512, bias=True)
    row_scale = (x.abs().amax(dim=1, keepdim=True).float() / 448.0).clamp(min=1 / (448.0 * 512))
    rows = (x.float() / row_scale).clamp(-448, 448).to(FP8_DTYPE).float() * row_scale
    emulated = rows @ (weight.float() * scale).T + b.float()
    result = torch.ops.trl_turbo.fp8_linear(x, weight, scale, b)
    torch.testing.assert_close(result.float(), emulated, rtol=2**-7, atol=1e-3)


def test_the_launchs_own_tiling_splits_k_into_runs_of_at_least_eight_tiles():
    from trl_turbo.kernels.fp8_rows_matmul import launch_config

    # Llama-3.1-8B's qkv, o, gate_up and down: the splits the tiling sweep found fastest at 8 rows
    assert [launch_config(n, k).split_k for n, k in ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336))] == \
        [4, 4, 4, 8]
    assert launch_config(64, 512).split_k == 1  # K shorter than eight tiles is one run
