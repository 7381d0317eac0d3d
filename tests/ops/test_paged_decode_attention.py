"""Decode attention over a paged KV cache (`trl_turbo.ops.paged_decode_attention`): the Triton kernel
(TRITON_INTERPRET=1 on CPU) against the reference computed in fp64, within the tolerance rule beside the naive bf16
torch path; bf16 and e4m3 caches, e4m3 queries, grouped-query heads, scattered pages of any size, one run and
several, empty sequences; what the launcher refuses."""

from __future__ import annotations

import pytest
import torch

from trl_turbo.ops import paged_decode_attention as decode_module
from trl_turbo.ops.merge_fp8 import FP8_DTYPE, FP8_MAX
from trl_turbo.ops.paged_decode_attention import reference
from trl_turbo.testing.tolerance import assert_within_naive_error

needs_triton = pytest.mark.skipif(decode_module._triton_decode is None, reason="Triton not installed")
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # CPU: the kernels run interpreted
PAGE = 16


def _case(lengths: list[int], *, q_heads: int = 8, kv_heads: int = 2, head_dim: int = 32, fp8_cache: bool = False,
          fp8_query: bool = False, seed: int = 0):
    """Caches of scattered pages (shuffled block table, spare pages) filled with random keys and values."""
    generator = torch.Generator().manual_seed(seed)
    pages_each = max(1, max(-(-n // PAGE) for n in lengths))
    blocks = len(lengths) * pages_each + 3
    keys = torch.randn(blocks, PAGE, kv_heads, head_dim, generator=generator)
    values = torch.randn(blocks, PAGE, kv_heads, head_dim, generator=generator)
    query = torch.randn(len(lengths), q_heads, head_dim, generator=generator)
    table = torch.randperm(blocks, generator=generator)[: len(lengths) * pages_each].reshape(len(lengths), -1)
    scales = {}
    if fp8_cache:
        k_scale, v_scale = keys.abs().max() / FP8_MAX, values.abs().max() / FP8_MAX
        keys, values = (keys / k_scale).to(FP8_DTYPE), (values / v_scale).to(FP8_DTYPE)
        scales.update(k_scale=k_scale.reshape(1), v_scale=v_scale.reshape(1))
    else:
        keys, values = keys.to(torch.bfloat16), values.to(torch.bfloat16)
    if fp8_query:
        q_scale = query.abs().max() / FP8_MAX
        query = (query / q_scale).to(FP8_DTYPE)
        scales["q_scale"] = q_scale.reshape(1)
    else:
        query = query.to(torch.bfloat16)
    lens = torch.tensor(lengths, dtype=torch.int32)
    move = {key: value.to(DEVICE) for key, value in scales.items()}
    return (query.to(DEVICE), keys.to(DEVICE), values.to(DEVICE), table.to(torch.int32).to(DEVICE),
            lens.to(DEVICE), move)


def _exact(query, keys, values, table, lens, scales, softmax_scale):
    return reference(query, keys, values, table, lens, softmax_scale=softmax_scale, compute_dtype=torch.float64,
                     out=torch.empty(query.shape, dtype=torch.float64, device=query.device), **scales)


def _naive(query, keys, values, table, lens, scales, softmax_scale):
    """The same attention in bf16 torch ops: what a plain port would compute."""
    kv_heads, head_dim = keys.shape[2], keys.shape[3]
    group = query.shape[1] // kv_heads
    q = query.to(torch.bfloat16) if "q_scale" not in scales else (query.float() * scales["q_scale"]).bfloat16()
    out = torch.zeros(query.shape, dtype=torch.bfloat16, device=query.device)
    for t, length in enumerate(lens.tolist()):
        if length == 0:
            continue
        pages = table[t, : -(-length // PAGE)].long()
        k = keys[pages].reshape(-1, kv_heads, head_dim)[:length]
        v = values[pages].reshape(-1, kv_heads, head_dim)[:length]
        if "k_scale" in scales:
            k, v = (k.float() * scales["k_scale"]).bfloat16(), (v.float() * scales["v_scale"]).bfloat16()
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,lhd->hl", q[t], k) * softmax_scale
        out[t] = torch.einsum("hl,lhd->hd", scores.softmax(dim=-1), v)
    return out


@needs_triton
@pytest.mark.parametrize("cache", ["bf16", "fp8", "fp8-query"])
@pytest.mark.parametrize("config", [None, (32, 4, 2, 3), (16, 4, 1, 8)], ids=["default", "three-runs", "eight-runs"])
def test_the_kernel_is_within_the_naive_error_of_the_exact_attention(cache, config):
    from trl_turbo.kernels.paged_decode_attention import paged_decode_attention

    # off every tile and page; an empty sequence (CUDA-graph padding); eight runs leave the short ones' later runs empty
    lengths = [1, 17, 0, 95, 48, 130]
    query, keys, values, table, lens, scales = _case(lengths, fp8_cache=cache != "bf16",
                                                     fp8_query=cache == "fp8-query", seed=len(cache))
    softmax_scale = query.shape[-1] ** -0.5
    out = torch.empty(query.shape, dtype=torch.bfloat16, device=DEVICE)
    result = paged_decode_attention(query, keys, values, table, lens, softmax_scale=softmax_scale, max_seq_len=130,
                                    out=out, config=config, **scales)
    assert result is out
    exact = _exact(query, keys, values, table, lens, scales, softmax_scale)
    assert_within_naive_error(result, _naive(query, keys, values, table, lens, scales, softmax_scale), exact,
                              what=f"{cache}, {config}")
    assert torch.count_nonzero(result[2]) == 0  # the empty sequence
    # one token: its value, rounded once (Triton's interpreter truncates to bf16 where the GPU rounds to nearest)
    single, rounded = result[0].float(), exact[0].to(torch.bfloat16).float()
    if DEVICE.type == "cuda":
        assert torch.equal(single, rounded)
    else:
        assert torch.allclose(single, rounded, rtol=2**-7, atol=0)


@needs_triton
def test_e4m3_scores_are_within_the_naive_error_and_need_an_e4m3_query():
    """The accuracy half runs the e4m3 products on a GPU only: Triton's interpreter widens every operand to fp32
    (there it checks the cut's runs); the refusals run everywhere."""
    from trl_turbo.kernels.paged_decode_attention import paged_decode_attention

    lengths = [1, 17, 0, 95, 48, 130]
    query, keys, values, table, lens, scales = _case(lengths, fp8_cache=True, fp8_query=True, seed=11)
    out = torch.empty(query.shape, dtype=torch.bfloat16, device=DEVICE)
    for config in ((32, 4, 2, 4, True), (16, 4, 1, 1, True)):  # several runs and one
        result = paged_decode_attention(query, keys, values, table, lens, softmax_scale=0.2, max_seq_len=130,
                                        out=out, config=config, **scales)
        assert_within_naive_error(result, _naive(query, keys, values, table, lens, scales, 0.2),
                                  _exact(query, keys, values, table, lens, scales, 0.2), what=str(config))
    bf16_query, *_ = _case(lengths, fp8_cache=True, seed=11)
    with pytest.raises(ValueError, match="e4m3 scores need an e4m3 query"):
        paged_decode_attention(bf16_query, keys, values, table, lens, softmax_scale=0.2, max_seq_len=130,
                               config=(32, 4, 2, 4, True), k_scale=scales["k_scale"], v_scale=scales["v_scale"])
    with pytest.raises(ValueError, match="head size of at least 32"):  # an e4m3 product's shared dimension
        paged_decode_attention(query[..., :16], keys[..., :16], values[..., :16], table, lens, softmax_scale=0.2,
                               max_seq_len=130, out=out[..., :16].contiguous(), config=(32, 4, 2, 4, True),
                               **scales)


@needs_triton
def test_runs_combine_to_what_one_run_computes_and_each_sequence_cuts_its_own_context():
    from trl_turbo.kernels.paged_decode_attention import paged_decode_attention

    lengths = [200, 7, 64]
    query, keys, values, table, lens, scales = _case(lengths, q_heads=4, kv_heads=4, seed=3)  # no grouping
    softmax_scale = 0.2
    exact = _exact(query, keys, values, table, lens, scales, softmax_scale)
    one = paged_decode_attention(query, keys, values, table, lens, softmax_scale=softmax_scale, max_seq_len=256,
                                 config=(64, 4, 2, 1))
    # sixteen runs: 200 tokens in runs of one 32-token tile (seven used), 7 and 64 tokens in one and two
    several = paged_decode_attention(query, keys, values, table, lens, softmax_scale=softmax_scale, max_seq_len=256,
                                     config=(32, 4, 2, 16))
    for result in (one, several):
        assert_within_naive_error(result, _naive(query, keys, values, table, lens, scales, softmax_scale), exact)
    assert (one.float() - several.float()).abs().max() <= 2 * (one.float() - exact).abs().max() + 1e-2
    # the default cut for a shorter longest context still covers every token: max_seq_len shapes the cut only
    default = paged_decode_attention(query, keys, values, table, lens, softmax_scale=softmax_scale, max_seq_len=32)
    assert_within_naive_error(default, _naive(query, keys, values, table, lens, scales, softmax_scale), exact)


@needs_triton
def test_the_op_takes_the_kernel_and_the_reference_alike_and_refuses_mismatched_inputs():
    from trl_turbo.kernels.paged_decode_attention import paged_decode_attention

    query, keys, values, table, lens, scales = _case([33, 5], fp8_cache=True, seed=5)
    with decode_module._force_backend("triton"):
        kernel = decode_module.paged_decode_attention(query, keys, values, table, lens, softmax_scale=0.3,
                                                      max_seq_len=64, **scales)
    with decode_module._force_backend("torch"):
        torch_path = decode_module.paged_decode_attention(query, keys, values, table, lens, softmax_scale=0.3,
                                                          max_seq_len=64, **scales)
    assert kernel.dtype == torch_path.dtype == torch.bfloat16
    assert (kernel.float() - torch_path.float()).abs().max() < 2e-2
    with pytest.raises(ValueError, match="does not match"):
        paged_decode_attention(query[:, :3], keys, values, table, lens, softmax_scale=0.3, max_seq_len=64, **scales)
    with pytest.raises(ValueError, match="k_scale and v_scale"):
        paged_decode_attention(query, keys, values, table, lens, softmax_scale=0.3, max_seq_len=64,
                               k_scale=scales["k_scale"])
    fp8_query, *_ = _case([3], fp8_query=True)
    with pytest.raises(ValueError, match="pass `out`"):
        paged_decode_attention(fp8_query, keys, values, table[:1], lens[:1], softmax_scale=0.3, max_seq_len=64,
                               q_scale=torch.ones(1, device=DEVICE), **scales)
    with pytest.raises(ValueError, match="an e4m3 query with e4m3 caches"):
        bf16_keys, bf16_values = keys.to(torch.bfloat16), values.to(torch.bfloat16)
        paged_decode_attention(fp8_query, bf16_keys, bf16_values, table[:1], lens[:1], softmax_scale=0.3,
                               max_seq_len=64, q_scale=torch.ones(1, device=DEVICE),
                               out=torch.empty(fp8_query.shape, dtype=torch.bfloat16, device=DEVICE))
    with pytest.raises(ValueError, match="bf16, fp16 or e4m3"):  # vLLM's e4m3 cache is stored as bytes
        paged_decode_attention(query, keys.view(torch.uint8), values.view(torch.uint8), table, lens,
                               softmax_scale=0.3, max_seq_len=64, **scales)
    with pytest.raises(ValueError, match="one per tensor"):
        paged_decode_attention(query, keys, values, table, lens, softmax_scale=0.3, max_seq_len=64,
                               k_scale=scales["k_scale"].repeat(2), v_scale=scales["v_scale"])
    with pytest.raises(ValueError, match="power-of-two head size of at least 16"):
        paged_decode_attention(query[..., :8], keys[..., :8], values[..., :8], table, lens, softmax_scale=0.3,
                               max_seq_len=64, **scales)
    with pytest.raises(ValueError, match="`out` must be"):
        paged_decode_attention(query, keys, values, table, lens, softmax_scale=0.3, max_seq_len=64,
                               out=torch.empty(2, 8, 16, dtype=torch.bfloat16, device=DEVICE), **scales)
    for cut in ((32, 4, 2, 0), (24, 4, 2, 2), (8, 4, 2, 2)):
        with pytest.raises(ValueError, match="at least one run"):
            paged_decode_attention(query, keys, values, table, lens, softmax_scale=0.3, max_seq_len=64, config=cut,
                                   **scales)


def test_the_default_cut_gives_the_gpu_four_programs_per_processor_whatever_the_context():
    from trl_turbo.kernels.paged_decode_attention import decode_attention_config

    many = decode_attention_config(2112, sequences=64, kv_heads=8, processors=132)
    few = decode_attention_config(2112, sequences=8, kv_heads=8, processors=132)
    assert many == (64, 2, 3, 1, False)  # 512 programs: one run of 64-token tiles
    assert decode_attention_config(2112, 64, 8, 132, e4m3_cache=True) == (64, 2, 3, 1, False)
    assert few == (32, 2, 2, 8, False)  # 512 programs: runs of eight tiles at 1984 tokens
    assert decode_attention_config(2112, 8, 8, 132, e4m3_cache=True) == (64, 2, 3, 8, False)
    assert decode_attention_config(2112, sequences=32, kv_heads=8, processors=132).runs == 2
    assert decode_attention_config(16, sequences=1, kv_heads=1, processors=132).runs == 1  # no run under four tiles
    assert decode_attention_config(300, sequences=1, kv_heads=1, processors=132).runs == 3


@needs_triton
def test_a_page_of_any_size_is_gathered_token_by_token():
    from trl_turbo.kernels.paged_decode_attention import paged_decode_attention

    query, keys, values, table, lens, scales = _case([70, 9], seed=7)
    # the same tokens in pages of 48: each sequence's 64 contiguous tokens regrouped, tiles of 32 crossing pages
    flat_k = torch.cat([keys[table[t].long()].reshape(-1, *keys.shape[2:]) for t in range(2)])
    flat_v = torch.cat([values[table[t].long()].reshape(-1, *values.shape[2:]) for t in range(2)])
    per_sequence = flat_k.shape[0] // 2
    pad = -per_sequence % 48
    big_k = torch.cat([torch.cat([flat_k[t * per_sequence:(t + 1) * per_sequence],
                                  flat_k.new_zeros(pad, *flat_k.shape[1:])]) for t in range(2)]).reshape(
        -1, 48, *keys.shape[2:])
    big_v = torch.cat([torch.cat([flat_v[t * per_sequence:(t + 1) * per_sequence],
                                  flat_v.new_zeros(pad, *flat_v.shape[1:])]) for t in range(2)]).reshape(
        -1, 48, *values.shape[2:])
    pages = big_k.shape[0] // 2
    big_table = torch.arange(2 * pages, dtype=torch.int32, device=DEVICE).reshape(2, pages).flip(0).contiguous()
    big_k, big_v = big_k.reshape(2, pages, 48, *keys.shape[2:]).flip(0).reshape(-1, 48, *keys.shape[2:]), \
        big_v.reshape(2, pages, 48, *values.shape[2:]).flip(0).reshape(-1, 48, *values.shape[2:])
    small = paged_decode_attention(query, keys, values, table, lens, softmax_scale=0.3, max_seq_len=96,
                                   config=(32, 4, 2, 3))
    large = paged_decode_attention(query, big_k, big_v, big_table, lens, softmax_scale=0.3, max_seq_len=96,
                                   config=(32, 4, 2, 3))
    assert torch.equal(small, large)


# Compiles the kernels for Hopper ahead of time, without a GPU (Triton's own compiler and ptxas): what the interpreter
# cannot check (layouts, shared memory, dot operand types) at the cuts the engine launches.
_HOPPER_COMPILE = r"""
import inspect, itertools, sys
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from trl_turbo.kernels import paged_decode_attention as m

def compile_for_hopper(kernel, pointers, constants, warps, stages=1):
    names = list(inspect.signature(kernel.fn).parameters)
    signature = {name: "constexpr" if name.isupper() else pointers.get(name, "i32") for name in names}
    signature["qk_scale"] = "fp32"
    # as a launch specializes them: vLLM's tensors and their strides are multiples of 16 bytes (the block table's
    # row stride need not be), which turns on vectorized and asynchronous copies and their shared memory
    aligned = [name for name in names if name.endswith("_ptr") or name.startswith("stride_") and name != "stride_table"]
    source = ASTSource(fn=kernel, signature={k: v for k, v in signature.items() if k in names}, constexprs=constants,
                       attrs={(names.index(name),): [["tt.divisibility", 16]] for name in aligned})
    triton.compile(source, target=GPUTarget("cuda", 90, 64), options={"num_warps": warps, "num_stages": stages})

cuts = [("bf16", "bf16", tl.bfloat16, False), ("fp16", "fp16", tl.float16, False),
        ("fp8e4nv", "fp8e4nv", tl.float16, False), ("fp8e4nv", "fp8e4nv", tl.float16, True)]
for (query, cache, dot, fp8_scores), sequences in itertools.product(cuts, (64, 8)):  # one run, and several
    cut = m.decode_attention_config(2112, sequences, 8, 132, e4m3_cache=cache == "fp8e4nv")
    pointers = {"q_ptr": f"*{query}", "k_ptr": f"*{cache}", "v_ptr": f"*{cache}", "out_ptr": "*bf16",
                "acc_ptr": "*fp32", "stats_ptr": "*fp32", "q_scale_ptr": "*fp32", "k_scale_ptr": "*fp32",
                "v_scale_ptr": "*fp32", "table_ptr": "*i32", "lens_ptr": "*i32"}
    for one_run in (True, False):
        constants = dict(GROUP=4, GROUP_ROWS=16, HEAD_DIM=128, PAGE=16, BLOCK_N=cut.block_n, ONE_RUN=one_run,
                         Q_SCALED=query == "fp8e4nv", KV_SCALED=cache == "fp8e4nv", DOT_TYPE=dot,
                         FP8_SCORES=fp8_scores, WIDE=False)
        compile_for_hopper(m._paged_decode_runs_kernel, pointers, constants, cut.warps, cut.stages)
combine = {"acc_ptr": "*fp32", "stats_ptr": "*fp32", "lens_ptr": "*i32", "out_ptr": "*bf16"}
compile_for_hopper(m._paged_decode_combine_kernel, combine, dict(HEAD_DIM=128, CHUNK=16, BLOCK_N=32), 4)
print("compiled")
"""


def test_the_kernels_compile_for_hopper_at_the_engines_cuts():
    import os
    import subprocess
    import sys

    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-c", _HOPPER_COMPILE], capture_output=True, text=True, env=env,
                            timeout=600)
    if "No such file" in result.stderr and "ptxas" in result.stderr:
        pytest.skip("this Triton has no ptxas to compile for NVIDIA GPUs")
    assert result.returncode == 0 and "compiled" in result.stdout, result.stderr[-3000:]


@needs_triton
def test_the_combine_takes_more_runs_than_it_holds_at_once_in_chunks():
    from trl_turbo.kernels.paged_decode_attention import COMBINE_CHUNK, paged_decode_attention, run_length

    lengths = [300, 3, 0, 37]
    query, keys, values, table, lens, scales = _case(lengths, seed=9)
    runs = 40  # 300 tokens in runs of one 16-token tile: 19 runs hold tokens, more than one chunk
    assert -(-300 // run_length(300, runs, 16)) > COMBINE_CHUNK
    result = paged_decode_attention(query, keys, values, table, lens, softmax_scale=0.25, max_seq_len=300,
                                    config=(16, 4, 2, runs))
    assert_within_naive_error(result, _naive(query, keys, values, table, lens, scales, 0.25),
                              _exact(query, keys, values, table, lens, scales, 0.25))
    assert torch.count_nonzero(result[2]) == 0
