"""GPU + vLLM: resuming from a checkpoint with shared weights, standby and merged sampling. Three
child processes (one vLLM engine each) over the toy task: the uninterrupted run, a run stopped after its checkpoint,
and a new trainer resuming from that checkpoint in the second run's directory. The resumed steps' loss, reward and
grad norm equal the uninterrupted run's within the tolerance rule (fp32 reductions of bf16 work: rtol 1e-3), and no
phase changes a frozen base matrix. vLLM samples from the CUDA RNG, whose state the checkpoint carries; where vLLM's
sampling did not continue from it the rewards part, and this test says so."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from trl_turbo.testing import vllm_checks

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
              pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vLLM")]


@pytest.fixture(scope="module")
def phases(tmp_path_factory):
    whole = vllm_checks.run_in_child("llama", tmp_path_factory.mktemp("whole"), None, "auto", "resume", "whole")
    interrupted = tmp_path_factory.mktemp("interrupted")
    first = vllm_checks.run_in_child("llama", interrupted, None, "auto", "resume", "first")
    resumed = vllm_checks.run_in_child("llama", interrupted, None, "auto", "resume", "resumed")
    return {"whole": whole, "first": first, "resumed": resumed}


def test_every_phase_samples_merged_and_keeps_the_base_weights(phases):
    for phase in phases.values():
        assert phase["sampling"] == "merged"
        assert phase["changed_base_matrices"] == []
    assert phases["first"]["global_step"] == vllm_checks.RESUME_AT
    assert phases["resumed"]["global_step"] == phases["whole"]["global_step"] == vllm_checks.RESUME_STEPS


def test_the_resumed_run_follows_the_uninterrupted_one(phases):
    whole, resumed = phases["whole"]["curves"], phases["resumed"]["curves"]
    steps = [str(step) for step in range(vllm_checks.RESUME_AT + 1, vllm_checks.RESUME_STEPS + 1)]
    assert all(step in resumed and step in whole for step in steps), (sorted(whole), sorted(resumed))
    for step in steps:
        assert resumed[step]["reward"] == pytest.approx(whole[step]["reward"], rel=1e-3), \
            f"step {step}: the resumed run sampled other completions ({resumed[step]} vs {whole[step]})"
        for key in ("loss", "grad_norm"):
            assert resumed[step][key] == pytest.approx(whole[step][key], rel=1e-3, abs=1e-6), (step, key)
