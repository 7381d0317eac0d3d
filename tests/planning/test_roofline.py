"""The roofline model's bytes and FLOPs, counted by hand on a small made-up spec, and its reading of committed e2e
rows."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from trl_turbo.bench.roofline import row_generation, row_roofline, shape_spec
from trl_turbo.planning.model_spec import ModelSpec
from trl_turbo.planning.roofline import (
    Generation,
    decode_bytes,
    decode_weight_bytes,
    generation_floor_s,
    prefill_flops,
    rank_kv_bytes_per_token,
    training_flops,
)

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"

SPEC = ModelSpec(model_type="llama", hidden_size=8, layers=2, intermediate_size=16, vocab_size=10, query_width=8,
                 key_value_width=4, norms_per_layer=2, parameters=1000, layer_linear_parameters=600,
                 lora_parameters=50, adapted_parameters=600, head_dim=2, key_value_heads=2,
                 max_position_embeddings=64)


def test_decode_reads_the_weights_every_step_and_the_growing_kv_cache() -> None:
    generation = Generation(sequences=3, prompt_len=4, completion_len=5)
    weights = 600 * 2 + 10 * 8 * 2  # layers' linear weights and the LM head, 16-bit
    assert decode_weight_bytes(SPEC, generation) == weights
    kv = 2 * 2 * 2 * 2 * 2  # K and V, 2 layers, 2 heads of 2, 16-bit
    assert rank_kv_bytes_per_token(SPEC, generation) == kv
    # the prefill samples the first token; decode steps t = 1..4 read 3 sequences x (4 + t) cached tokens
    assert decode_bytes(SPEC, generation) == 4 * weights + 3 * sum(4 + t for t in range(1, 5)) * kv
    assert decode_bytes(SPEC, Generation(sequences=3, prompt_len=4, completion_len=1)) == 0


def test_tensor_parallel_ranks_read_their_share_and_fp8_halves_the_layers() -> None:
    tp2 = Generation(sequences=3, prompt_len=4, completion_len=5, tp=2)
    assert decode_weight_bytes(SPEC, tp2) == (600 * 2 + 160) / 2
    assert rank_kv_bytes_per_token(SPEC, tp2) == 2 * 2 * 1 * 2 * 2  # one of the two heads
    tp4 = Generation(sequences=3, prompt_len=4, completion_len=5, tp=4)
    # fewer heads than ranks: one replicated head each
    assert rank_kv_bytes_per_token(SPEC, tp4) == rank_kv_bytes_per_token(SPEC, tp2)
    fp8 = Generation(sequences=3, prompt_len=4, completion_len=5, weight_dtype="fp8", kv_bytes=1)
    assert decode_weight_bytes(SPEC, fp8) == 600 + 160  # the LM head stays 16-bit
    assert rank_kv_bytes_per_token(SPEC, fp8) == 16
    lora = Generation(sequences=3, prompt_len=4, completion_len=5, adapter_parameters=50)
    assert decode_weight_bytes(SPEC, lora) == 600 * 2 + 160 + 100


def test_flops_of_prefill_and_training() -> None:
    generation = Generation(sequences=3, prompt_len=4, completion_len=5, tp=2)
    # 4 prompt tokens through the layers, causal attention over them, the LM head for the last token only
    forward_prompt = 2 * 600 * 4 + 2 * 2 * 4 * 4 * 8 + 2 * 80
    assert prefill_flops(SPEC, generation) == 3 * forward_prompt / 2
    assert generation_floor_s(SPEC, generation, 100.0, 10.0) == pytest.approx(
        decode_bytes(SPEC, generation) / 100 + prefill_flops(SPEC, generation) / 10)
    linear, attention = 2 * 680 * 9, 2 * 2 * 81 * 8
    assert training_flops(SPEC, 3, 9, full_finetuning=False) == 3 * (2 * linear + 3 * attention)
    assert training_flops(SPEC, 3, 9, full_finetuning=True) == 3 * (3 * linear + 3 * attention)


def test_a_committed_row_reads_its_workload() -> None:
    path = RESULTS / "e2e-llama-3.1-8b-realistic-2gpu-tp2-20261127-182947.json"
    data = json.loads(path.read_text())
    spec = shape_spec("llama-3.1-8b", 16)
    turbo = next(row for row in data["rows"] if row["variant"] == "turbo")
    generation = row_generation(turbo, data["config"], spec)
    # FSDP2 + TP=2: the group's engine samples both ranks' 8 x 8 sequences, each rank holding half of everything
    assert (generation.sequences, generation.tp, generation.weight_dtype) == (128, 2, "bf16")
    hardware = {"read_bytes_per_s": 4.8e12, "bf16_flops_per_s": 989e12}
    roofline = row_roofline(turbo, data["config"], hardware)
    assert roofline["generation_over_floor"] == pytest.approx(
        turbo["generate_s"] / generation_floor_s(spec, generation, 4.8e12, 989e12))
    assert roofline["train_s"] == pytest.approx(turbo["step_s"] - turbo["generate_s"] - turbo["sync_s"])
    assert 0 < roofline["train_mfu"] < 1 and roofline["generation_over_floor"] > 1
    assert row_roofline({**turbo, "ok": False}, data["config"], hardware) is None


def test_the_ceilings_are_measured_only_on_a_gpu() -> None:
    import torch

    from trl_turbo.bench import hardware

    assert hardware.measure(torch.device("cpu")) is None
    assert hardware.measure_apart(torch.device("cpu")) is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_ceilings_measured_apart_leave_nothing_on_the_device() -> None:
    from trl_turbo.bench import hardware

    device = torch.device("cuda", 0)
    torch.cuda.init()
    before = torch.cuda.mem_get_info(device)[0]
    ceilings = hardware.measure_apart(device)
    assert ceilings["read_bytes_per_s"] > 1e12 and ceilings["bf16_flops_per_s"] > 1e14
    assert abs(torch.cuda.mem_get_info(device)[0] - before) < 64 << 20  # the child's buffers left with it
