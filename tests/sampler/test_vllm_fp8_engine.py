"""GPU + vLLM: `turbo_vllm_sampling='fp8'` (with an fp8 KV cache) inside a real GRPOTrainer run, one engine per process:
vLLM's linear layers are fp8 and rewritten from the live adapter each generation, the training model's weights never
change, the fp8 copy is unmapped with the KV cache while training runs, the rollout check stays quiet, and the toy
task is learned as with 16-bit sampling (`test_vllm_engine.py`)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from trl_turbo.testing import vllm_checks
from trl_turbo.vllm.engine_plan import engine_state

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
              pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vLLM"),
              pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.get_device_capability() < (8, 9),
                                 reason="needs an fp8 GPU")]
CAP = 16
STEPS = 50


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    trainer = vllm_checks.build_trainer("llama", tmp_path_factory.mktemp("tiny-llama-fp8"), steps=STEPS,
                                        completion_cap=CAP, turbo_vllm_sampling="fp8",
                                        turbo_vllm_kv_cache_dtype="fp8",
                                        vllm_importance_sampling_mode="token_truncate")
    state = engine_state(trainer.vllm_generation)
    result = {"trainer": trainer, "sampling": vllm_checks.sampling_mode(trainer), "state": state}
    result.update(vllm_checks.train_recording(trainer))
    print({k: v for k, v in result.items() if k.startswith("gaps")},
          {"released_gib": state.standby.bytes / 2**30, "kv_gib": state.standby.kv_bytes / 2**30,
           "fp8_copy_gib": state.fp8.copy_bytes / 2**30, "resident_gib": state.standby.resident_bytes / 2**30})
    return result


def test_fp8_sampling_never_changes_the_base_weights(run):
    assert run["sampling"] == "fp8"  # vLLM's fp8 layers, no LoRA slots
    assert run["changed_after_training"] == []
    assert run["rollout_alarms"] == 0  # the fp8 gap sets the alarm's floor; healthy steps never trip it
    logs = [log for log in run["trainer"].state.log_history if "vllm/quantize_s" in log]
    assert len(logs) == STEPS and all(log["vllm/fp8_copy_gib"] > 0 for log in logs)
    # the 16-bit linear weights were parked on the host while vLLM sampled, and brought back every step
    assert all(log["vllm/parked_host_gib"] > 0 and log["vllm/unpark_s"] > 0 for log in logs)


def test_vllm_samples_from_the_live_adapter_through_fp8(run):
    for adapter_gap, base_gap in (run["gaps_before"], run["gaps_after"]):
        assert base_gap > 2 * adapter_gap, (adapter_gap, base_gap)


def test_the_fp8_copy_is_released_with_the_kv_cache(run):
    standby = run["state"].standby
    fp8 = run["state"].fp8
    released_weights = standby.bytes - standby.kv_bytes
    assert released_weights >= 0.9 * fp8.copy_bytes, (released_weights, fp8.copy_bytes, standby.resident_bytes)
    used = run["used"][5:]
    assert max(used) - min(used) <= 256 << 20, [u >> 20 for u in run["used"]]


def test_importance_sampling_is_sane_and_the_task_is_learned(run):
    logs = run["trainer"].state.log_history
    ratios = [log["sampling/importance_sampling_ratio/mean"] for log in logs
              if "sampling/importance_sampling_ratio/mean" in log]
    assert ratios and all(0.8 < r < 1.25 for r in ratios), ratios
    lengths = [log["completions/mean_length"] for log in logs if "completions/mean_length" in log]
    first, last = sum(lengths[:5]) / 5, sum(lengths[-5:]) / 5
    assert last >= first + 3, lengths
