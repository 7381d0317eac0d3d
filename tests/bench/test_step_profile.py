"""The training-step profile's pure parts: kernel classes, stream busy time, and what the compute stream's idle time
waited behind (the profiler itself runs on the GPU)."""

from __future__ import annotations

import pytest

from trl_turbo.bench import e2e
from trl_turbo.bench.step_profile import Kernel, classify, format_step, summarize_step, union_us

COMPUTE, NCCL, COPIES = 7, 20, 24


@pytest.mark.parametrize(("name", "kind"), [
    ("ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)", "communication"),
    ("ncclDevKernel_ReduceScatter_Sum_bf16_RING_LL", "communication"),
    ("Memcpy HtoD (Pinned -> Device)", "host copy"),
    ("Memcpy DtoH (Device -> Pinned)", "host copy"),
    ("Memcpy DtoD (Device -> Device)", "memory"),
    ("void at::native::(anonymous namespace)::multi_tensor_apply_kernel<FusedAdamMathFunctor>", "optimizer"),
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", "gemm"),
    ("void pytorch_flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel", "attention"),
])
def test_a_training_steps_kernels_are_classed_by_name(name, kind):
    assert classify(name) == kind


def test_overlapping_intervals_merge():
    assert union_us([(5, 7), (0, 2), (1, 3), (7, 8)]) == [(0, 3), (5, 8)]


def test_the_compute_streams_idle_time_is_split_by_what_other_streams_ran_meanwhile():
    kernels = [
        Kernel("gemm_a", COMPUTE, 0, 100),
        Kernel("ncclDevKernel_AllGather", NCCL, 50, 160),  # 60 µs of it while the compute stream waits (100-160)
        Kernel("gemm_b", COMPUTE, 160, 200),
        Kernel("Memcpy HtoD (Pinned -> Device)", COPIES, 200, 230),  # all of it exposed
        Kernel("gemm_c", COMPUTE, 230, 300),
        Kernel("gemm_d", COMPUTE, 340, 400),  # 40 µs before it: nothing on the GPU (the host)
        Kernel("ncclDevKernel_AllGather", NCCL, 400, 500),  # a longer stream of its own: not the compute stream
    ]
    summary = summarize_step(kernels, wall_s=600e-6)  # the step began 100 µs before its first kernel
    assert summary["compute_stream"] == COMPUTE
    assert summary["compute_busy_ms"] == pytest.approx(0.270)
    # idle: 100 before the first kernel, 100-160, 200-230, 300-340, 400-500
    assert summary["compute_idle_ms"] == pytest.approx(0.330)
    assert summary["idle_behind_ms"]["communication"] == pytest.approx(0.160)
    assert summary["idle_behind_ms"]["host copy"] == pytest.approx(0.030)
    assert summary["idle_with_gpu_empty_ms"] == pytest.approx(0.140)
    assert summary["streams"][str(NCCL)]["busy_ms"] == pytest.approx(0.210)
    assert summary["streams"][str(COMPUTE)]["classes_ms"] == {"gemm": pytest.approx(0.270)}
    scaled = summarize_step([k._replace(start_us=1e3 * k.start_us, end_us=1e3 * k.end_us) for k in kernels], 0.6)
    assert format_step(scaled) == ("step profile: 600 ms; compute stream busy 270 ms, idle 330 ms (behind "
                                   "communication 160 ms, host copy 30 ms; GPU empty 140 ms)")
    empty = summarize_step([], wall_s=1.0)
    assert empty["compute_stream"] is None and "no kernel" in format_step(empty)


def test_a_profiled_step_is_not_one_of_the_timed_ones():
    steps = [{"step_s": 9.0, "peak_gib": 1.0}, {"step_s": 2.0, "peak_gib": 1.0},
             {"step_s": 3.0, "peak_gib": 1.0, "profile": {}}]
    assert e2e.summarize(steps, warmup=1)["step_s"] == 2.0
