"""The decode-gemm benchmark's pure parts: which products one decoder layer runs, their byte floors, which tilings the
sweep tries, and the per-decode-step sum (the timings run on the GPU)."""

from __future__ import annotations

import argparse

import pytest
import torch

from trl_turbo.bench import decode_gemm
from trl_turbo.bench.decode_gemm import linear_shapes, product_bytes, summarize, sweep_configs
from trl_turbo.bench.roofline import shape_spec


def test_one_decoder_layers_products_are_vllms_fused_linears_and_cover_its_linear_weights():
    spec = shape_spec("llama-3.1-8b", None)
    shapes = linear_shapes(spec)
    assert shapes == {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
    assert sum(n * k for n, k in shapes.values()) * spec.layers == spec.layer_linear_parameters


def test_a_products_floor_is_its_weight_once_plus_16_bit_activations_in_and_out():
    assert product_bytes(8, 4096, 1024, 1) == 4096 * 1024 + 2 * 8 * 1024 + 2 * 8 * 4096
    assert product_bytes(8, 4096, 1024, 2) - product_bytes(8, 4096, 1024, 1) == 4096 * 1024


def test_the_sweep_keeps_every_run_of_k_two_tiles_long_and_the_programs_bounded():
    configs = sweep_configs(4096, 4096, 2112)
    assert len(set(configs)) == len(configs)
    assert {config[5] for config in configs} == {False, True}  # both operand orders
    for block_n, block_k, _, _, split, _ in configs:
        if split > 1:
            assert 4096 // split >= 2 * block_k
            assert -(-4096 // block_n) * split <= 2112
    splits = {config[4] for config in configs if config[1] == 128 and config[0] == 64}
    assert splits == {1, 2, 4, 8, 16}
    assert {config[4] for config in sweep_configs(4096, 384, 2112)} == {1}  # K too short to split
    assert sweep_configs(4096, 4096, 2112) == configs  # the same order on every run
    first_quarter = configs[:len(configs) // 4]  # what a budget cut short at a quarter has timed
    assert {config[0] for config in first_quarter} == {64, 128} and {config[4] for config in first_quarter} > {1}


def test_a_decode_steps_sum_counts_each_linear_once_per_layer_and_only_complete_row_counts():
    rows = [{"linear": "a", "rows": 8, "seconds": {"x": 1e-6, "y": 2e-6}},
            {"linear": "b", "rows": 8, "seconds": {"x": 3e-6, "y": 4e-6}},
            {"linear": "a", "rows": 64, "seconds": {"x": 5e-6}}]  # b at 64 rows never measured
    assert summarize(rows, 32) == {"8": {"x": pytest.approx(32 * 4e-3), "y": pytest.approx(32 * 6e-3)}}


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without CUDA")
def test_without_a_gpu_it_refuses_before_measuring():
    args = argparse.Namespace(shape="llama-3.1-8b", linears=None, rows="8", sweep_budget_s=1.0, out="/tmp/unused")
    with pytest.raises(SystemExit, match="needs a CUDA GPU"):
        decode_gemm.run(args)


def test_a_timed_sweep_sorts_what_ran_records_what_raised_and_stops_at_its_budget():
    from trl_turbo.bench.decode_gemm import LaunchConfig, timed_sweep

    configs = [LaunchConfig(64, 128, 4, 3, split) for split in (1, 2, 4, 8)]

    def time_one(config):
        if config.split_k == 2:
            raise AssertionError  # no message: the record names the exception
        if config.split_k == 4:
            raise RuntimeError("out of resource: shared memory\nmore detail")
        return 1.0 / config.split_k, 0.5

    swept = timed_sweep(configs, time_one, budget_s=60.0)
    assert [entry["config"]["split_k"] for entry in swept["sweep"]] == [8, 1]  # fastest first
    assert [entry["error"] for entry in swept["sweep_failed"]] == ["AssertionError()",
                                                                   "out of resource: shared memory"]
    assert swept["sweep_complete"] and swept["sweep"][0]["max_abs_error"] == 0.5
    assert timed_sweep(configs, time_one, budget_s=-1.0) == {"sweep": [], "sweep_failed": [],
                                                               "sweep_complete": False}
