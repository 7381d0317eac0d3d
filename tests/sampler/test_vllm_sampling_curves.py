"""GPU + vLLM: "merged" and "lora" sampling train the same loss curve. Each run is a child process (one vLLM engine
per process) training the toy task for 30 steps from the same seed; the engine samples with the same seed, so two
modes that sample from the same policy draw nearly the same completions.

The tolerance rule, applied to training runs: the step-by-step distance between the merged and the LoRA curve is at
most twice the distance between two LoRA runs whose sampling seeds differ (the run-to-run noise of the established
path), and merged's sampler/trainer log-prob gap is at most twice LoRA's."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from trl_turbo.testing import vllm_checks

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
              pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vLLM")]


@pytest.fixture(scope="module")
def curves(tmp_path_factory):
    runs = {("lora", 0): None, ("merged", 0): None, ("lora", 1): None}
    for sampling, seed_offset in runs:
        runs[sampling, seed_offset] = vllm_checks.run_in_child(
            "llama", tmp_path_factory.mktemp(f"{sampling}-{seed_offset}"), None, sampling, "curve", str(seed_offset))
    return runs


def _distance(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b) and a
    return sum(abs(x - y) for x, y in zip(a, b)) / len(a)


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def test_merged_and_lora_train_the_same_curve(curves):
    lora, merged, reseeded = curves["lora", 0], curves["merged", 0], curves["lora", 1]
    assert (lora["sampling"], merged["sampling"]) == ("lora", "merged")
    for key in ("loss", "reward"):
        noise = _distance(lora[key], reseeded[key])
        assert _distance(merged[key], lora[key]) <= 2 * noise, (key, merged[key], lora[key], reseeded[key])


def test_merged_samples_as_close_to_the_policy_as_lora(curves):
    lora, merged = curves["lora", 0], curves["merged", 0]
    assert _mean(merged["logp_gap"]) <= 2 * _mean(lora["logp_gap"]), (merged["logp_gap"], lora["logp_gap"])


def test_both_modes_learn(curves):
    for run in (curves["lora", 0], curves["merged", 0]):
        assert _mean(run["reward"][-5:]) > _mean(run["reward"][:5]), run["reward"]
