"""GPU + vLLM: the shared-weight engine for every supported model family, 16-bit (llama is covered at length by
test_vllm_engine.py) and bitsandbytes 4-bit (NF4 with double quantization; FP4 for llama). Each family runs in a child
process (one vLLM engine per process): one copy of the base weights, vLLM's samples scored by the live adapter before
and after three GRPO steps, adapter sync in milliseconds. Models vLLM cannot share with (8-bit, 4-bit with bf16 storage,
a family outside the shared layouts) get a separate 16-bit copy holding the training model's dequantized values, with
the same checks of samples and sync."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from trl_turbo.families import SHARED_WEIGHT_MODEL_TYPES
from trl_turbo.testing import vllm_checks

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
              pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vLLM")]
# Matrices of the tiny models: 7 projections in each of 2 layers, the embedding, and the LM head unless tied
TIED = {"gemma", "gemma2", "gemma3_text"}


CASES = ([(arch, None) for arch in SHARED_WEIGHT_MODEL_TYPES if arch != "llama"]
         + [(arch, "nf4") for arch in SHARED_WEIGHT_MODEL_TYPES] + [("llama", "fp4")])
# vLLM holds a separate copy: 8-bit, non-uint8 4-bit storage, a family whose vLLM layout trl_turbo does not map
COPY_CASES = [("llama", "int8"), ("llama", "nf4-bf16storage"), ("phi3", None)]
# Training's 8-bit layers multiply row-quantized int8 activations with the int8 weights (outlier columns in fp16),
# vLLM bf16 activations with the dequantized weights: the activations' 8-bit rounding widens the log-prob gap that
# 4-bit and 16-bit layers (same weights, same activation precision) keep below 0.05.
ADAPTER_GAP_BOUND = {"int8": 0.1}


def _checks(arch, quantization, tmp_path, sampling="auto", *extra):
    return vllm_checks.run_in_child(arch, tmp_path, quantization, sampling, *extra)


@pytest.mark.parametrize(("arch", "quantization"), CASES, ids=[f"{a}-{q or 'bf16'}" for a, q in CASES])
def test_family_shares_weights_and_samples_from_the_adapter(arch, quantization, tmp_path):
    result = _checks(arch, quantization, tmp_path)
    expected = {"frozen_matrices": 2 * 7 + (1 if arch in TIED else 2), "second_copies": []}
    assert result["copies_before"] == expected and result["copies_after"] == expected
    assert result["four_bit_matrices"] == (2 * 7 if quantization else 0)  # the projections; embedding, head 16-bit
    assert result["sampling"] == ("lora" if quantization else "merged")  # auto: merged wherever it can serve
    assert result["changed_base_matrices"] == []  # bit for bit, after merges and restores around every generation
    assert result["rollout_alarms"] == 0  # a healthy run never trips the alarm
    for adapter_gap, base_gap in (result["gaps_before"], result["gaps_after"]):
        assert adapter_gap < 0.05 and base_gap > 4 * adapter_gap, (adapter_gap, base_gap)
    assert len(result["weight_sync_s"]) == 3 and max(result["weight_sync_s"]) < 0.5


def test_lora_sampling_from_shared_16bit_weights(tmp_path):
    result = _checks("llama", None, tmp_path, sampling="lora")
    assert result["sampling"] == "lora" and result["copies_after"]["second_copies"] == []
    assert result["rollout_alarms"] == 0
    for adapter_gap, base_gap in (result["gaps_before"], result["gaps_after"]):
        assert adapter_gap < 0.05 and base_gap > 4 * adapter_gap, (adapter_gap, base_gap)
    assert result["changed_base_matrices"] == []


@pytest.mark.parametrize("sampling", ["merged", "lora"])
def test_rollout_alarm_trips_when_the_adapter_never_reaches_vllm(sampling, tmp_path):
    result = _checks("llama", None, tmp_path, sampling, "stale")
    assert result["sampling"] == sampling
    assert result["alarms"] == 1 and result["tripped_at_step"] is not None and result["tripped_at_step"] <= 6, result


@pytest.mark.parametrize(("arch", "quantization"), COPY_CASES, ids=[f"{a}-{q or 'bf16'}" for a, q in COPY_CASES])
def test_family_without_a_shared_layout_samples_from_a_separate_copy(arch, quantization, tmp_path):
    result = _checks(arch, quantization, tmp_path)
    assert result["separate_copy"] and result["fallback_warnings"] == 1  # named once, at config time
    assert result["sampling"] == "lora"
    for copies in (result["copies_before"], result["copies_after"]):  # no training tensor lives in vLLM's
        assert copies["frozen_matrices"] > 0 and len(copies["second_copies"]) == copies["frozen_matrices"]
    # vLLM's rows hold each frozen matrix's dequantized training values, before and after training
    assert result["copy_mismatches_before"] == [] and result["copy_mismatches_after"] == []
    bound = ADAPTER_GAP_BOUND.get(quantization, 0.05)
    for adapter_gap, base_gap in (result["gaps_before"], result["gaps_after"]):
        assert adapter_gap < bound and base_gap > 4 * adapter_gap, (adapter_gap, base_gap)
    assert len(result["weight_sync_s"]) == 3 and max(result["weight_sync_s"]) < 0.5
    assert result["separate_copy_gib"] and min(result["separate_copy_gib"]) > 0
