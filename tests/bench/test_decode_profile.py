"""The decode profile's pure parts: kernel names classed as the profile reports them, the per-step summary, and the
kernels read out of a profiler's averages (the probe itself runs on the GPU: `bench e2e --profile-decode`)."""

from __future__ import annotations

import argparse
from types import SimpleNamespace

import pytest

from trl_turbo.bench import e2e
from trl_turbo.bench.decode_profile import (
    OTHER,
    classify,
    decode_kernels,
    decode_wall_s,
    format_profile,
    kernel_totals,
    measure,
    prefill_steps,
    short_tokens,
    summarize,
    uneven_kernels,
    waves,
)

# Kernel names as CUDA profiles of vLLM 0.24's decode show them (abridged)
KERNELS = {
    "void flash::flash_fwd_splitkv_kernel<Flash_fwd_kernel_traits<128, 64, 128>>": "attention",
    "void vllm::reshape_and_cache_flash_kernel<__nv_bfloat16>": "attention",
    "_paged_decode_runs_kernel": "attention",  # trl_turbo's own decode attention, as Triton names it
    "_paged_decode_combine_kernel": "attention",
    "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize64x64x64_warpgroupsize1x1x1": "gemm",
    "nvjet_tst_64x8_64x16_4x1_v_bz_TNT": "gemm",
    "void gemv2T_kernel_val<int, int, __nv_bfloat16, 128, 16, 4, 4>": "gemm",
    "void cutlass::device_kernel<vllm::cutlass_3x_scaled_mm_sm90_fp8<cutlass::float_e4m3_t>>": "gemm",
    "void vllm::dynamic_per_token_scaled_fp8_quant_kernel<__nv_bfloat16>": "fp8 quantization",
    "void vllm::fused_add_rms_norm_kernel<__nv_bfloat16, 8>": "norm",
    "triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_0": "norm",
    "void vllm::act_and_mul_kernel<__nv_bfloat16, &vllm::silu_kernel>": "activation",
    "void vllm::rotary_embedding_kernel<__nv_bfloat16, true>": "rotary",
    "void at::native::(anonymous namespace)::cunn_SoftMaxForward<4, float>": "sampling",
    "void at::native::sbtopk::gatherTopK<float, unsigned int, 2>": "sampling",
    "Memcpy DtoD (Device -> Device)": "memory",
    "void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>>": OTHER,
}


@pytest.mark.parametrize("kernel", sorted(KERNELS))
def test_kernels_are_classed_by_name(kernel):
    assert classify(kernel) == KERNELS[kernel]


def test_the_summary_is_per_decode_step_with_the_gap_outside_kernels():
    kernels = [("nvjet_tst_64x8", 3000.0, 200), ("sm90_xmma_gemm_bf16", 1000.0, 100),
               ("flash_fwd_splitkv_kernel", 800.0, 100), ("rms_norm_kernel", 200.0, 300)]
    summary = summarize(kernels, steps=100, wall_s=0.060)
    assert summary["ms_per_step"] == pytest.approx(0.6)
    assert summary["kernel_ms_per_step"] == pytest.approx(0.05)
    assert summary["gap_ms_per_step"] == pytest.approx(0.55)
    classes = summary["classes"]
    assert list(classes) == ["gemm", "attention", "norm"]  # largest first
    assert classes["gemm"]["ms_per_step"] == pytest.approx(0.04) and classes["gemm"]["launches_per_step"] == 3
    assert [k["name"] for k in classes["gemm"]["top_kernels"]] == ["nvjet_tst_64x8", "sm90_xmma_gemm_bf16"]
    assert classes["gemm"]["top_kernels"][0]["launches_per_step"] == 2
    assert sum(entry["share"] for entry in classes.values()) == pytest.approx(1.0)
    assert "0.60 ms/step" in format_profile(8, summary) and "gemm 0.04 ms" in format_profile(8, summary)


def test_only_gpu_kernels_are_read_from_the_profiler():
    events = [SimpleNamespace(key="nvjet_tst", self_device_time_total=12.5, count=3, device_type="DeviceType.CUDA"),
              SimpleNamespace(key="aten::mm", self_device_time_total=0.0, count=3, device_type="DeviceType.CPU"),
              SimpleNamespace(key="cudaLaunchKernel", self_device_time_total=0.0, count=9,
                              device_type="DeviceType.CPU")]
    profiler = SimpleNamespace(key_averages=lambda: events)
    assert kernel_totals(profiler) == [("nvjet_tst", 12.5, 3)]


def test_batch_sizes_are_positive_integers():
    assert e2e._batch_sizes("8,64") == [8, 64]
    for bad in ("0", "", "8,-1"):
        with pytest.raises(argparse.ArgumentTypeError):
            e2e._batch_sizes(bad)


def test_a_batch_larger_than_the_engine_takes_runs_in_waves():
    assert waves(64, 8) == 8 and waves(9, 8) == 2 and waves(8, 8) == 1 and waves(64, None) == 1


def test_the_decode_steps_are_the_whole_generation_less_a_shorter_one():
    # the prefill's chunks (a mixed prefill GEMM, prefill attention) are in both runs and cancel
    whole = [("flash_fwd_splitkv", 900.0, 40), ("nvjet_gemm", 5000.0, 300), ("prefill_mixed_gemm", 50.0, 3),
             ("rms_norm", 30.0, 12)]
    shorter = [("flash_fwd_splitkv", 500.0, 22), ("nvjet_gemm", 3000.0, 165), ("prefill_mixed_gemm", 50.0, 3)]
    decode = decode_kernels(whole, shorter)
    assert decode == [("flash_fwd_splitkv", 400.0, 18), ("nvjet_gemm", 2000.0, 135), ("rms_norm", 30.0, 12)]


def test_the_measured_steps_are_the_last_half_and_must_come_after_the_prefill():
    assert short_tokens(128) == 64 and short_tokens(1) == 1
    # 126,976 prompt tokens in chunks of 16384 less the 64 decode rows that may share a step: 8 steps, and one more
    assert prefill_steps(64, 1984, 16384) == 9
    assert prefill_steps(256, 496, 2048) == 72  # vLLM's scheduler takes 67 (the reviewer's simulation): a bound
    assert prefill_steps(8, 16, None) == 1
    with pytest.raises(ValueError, match="cannot prefill"):
        prefill_steps(64, 16, 64)
    scheduler = SimpleNamespace(max_num_batched_tokens=2048, max_num_seqs=64)
    engine = SimpleNamespace(vllm_config=SimpleNamespace(scheduler_config=scheduler))
    prompts = [{"prompt_token_ids": [3] * 1984}] * 128  # two waves of 64: 64 chunks of 1984 tokens, and one more
    with pytest.raises(ValueError, match="64 prompts takes up to 65 steps.*at least 132 tokens"):
        measure(SimpleNamespace(llm_engine=engine), prompts, 128, rounds=2)


def test_the_decode_wall_time_is_the_fastest_whole_run_less_the_fastest_short_run():
    # a 0.3 s host stall in one short run and one whole run: neither moves the difference
    times = {128: iter([1.0, 1.3, 1.0]), 64: iter([0.7, 1.0, 0.7])}
    calls = []

    def generate(max_tokens):
        calls.append(max_tokens)
        return next(times[max_tokens])

    assert decode_wall_s(generate, 128) == pytest.approx(0.3)
    assert calls == [128, 128, 128, 64, 64, 64]
    assert decode_wall_s(lambda max_tokens: 1.0, 128) == 0.0  # never negative


def test_kernels_not_launched_a_whole_number_of_times_per_step_are_named():
    decode = [("nvjet_gemm", 4000.0, 270), ("prefill_gemm_m4096", 900.0, 7), ("flash_fwd", 600.0, 36)]
    assert uneven_kernels(decode, steps=9) == {"prefill_gemm_m4096": pytest.approx(0.1)}
