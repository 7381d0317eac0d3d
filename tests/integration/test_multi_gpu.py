"""Two GPUs through `accelerate launch` with TRL's shipped configs: every strategy trains with trl_turbo's features
and follows the one-GPU run of the same global batch.

Each run is `trl_turbo.testing.multi_gpu` (completions fixed by prompt, so the split over ranks cannot change the
samples): 10 steps of a 4-layer LoRA model with hidden size 2048, in fp32 (`--mixed_precision no`; the strategies'
bf16 recipes differ from one GPU's autocast, which would hide a real divergence). Each launch is bounded by a
timeout, so a hang fails the test. Set TRL_TURBO_RESULTS_DIR to keep every run's JSON (losses, metrics, per-GPU
peak memory).
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from trl_turbo.distributed import Strategy, checkpointing_strategies
from trl_turbo.testing.multi_gpu import fresh_rendezvous_env

STRATEGIES = ("multi_gpu", "zero2", "zero3", "fsdp2")
WHOLE_PARAMETERS = ("multi_gpu", "zero2")  # one engine per rank, whole weights
CONFIG_STRATEGY = {"multi_gpu": Strategy.DDP, "zero2": Strategy.ZERO2, "zero3": Strategy.ZERO3,
                   "fsdp2": Strategy.FSDP2}
LAUNCH_TIMEOUT_S = 420

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices"),
]


def _run(command: list[str], out: Path) -> dict:
    result = subprocess.run(command, capture_output=True, text=True, timeout=LAUNCH_TIMEOUT_S,
                            env=fresh_rendezvous_env())
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-6000:]
    data = json.loads(out.read_text())
    results_dir = os.environ.get("TRL_TURBO_RESULTS_DIR")
    if results_dir:
        Path(results_dir).mkdir(parents=True, exist_ok=True)
        shutil.copy(out, Path(results_dir) / out.name)
    return data


@pytest.fixture(scope="module")
def one_gpu(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("one") / "one_gpu.json"
    env_command = [sys.executable, "-m", "trl_turbo.testing.multi_gpu", "--out", str(out)]
    return _run(["env", "CUDA_VISIBLE_DEVICES=0", *env_command], out)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_two_gpus_follow_the_one_gpu_loss_curve(tmp_path, one_gpu, strategy):
    if strategy.startswith("zero") and importlib.util.find_spec("deepspeed") is None:
        pytest.skip("needs deepspeed")
    import trl

    config = Path(trl.__file__).parent / "accelerate_configs" / f"{strategy}.yaml"
    out = tmp_path / f"two_gpus_{strategy}.json"
    run = _run([sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config), "--num_processes",
                "2", "--mixed_precision", "no", "-m", "trl_turbo.testing.multi_gpu", "--out", str(out)], out)
    assert run["processes"] == 2 and len(run["losses"]) == len(one_gpu["losses"]) == 10
    assert len(run["peak_gib_per_rank"]) == 2 and all(p > 0 for p in run["peak_gib_per_rank"])
    torch.testing.assert_close(torch.tensor(run["losses"]), torch.tensor(one_gpu["losses"]), rtol=2e-3, atol=2e-5)
    # offloaded checkpointing and the tiled MLP: on wherever the installed libraries support them (FSDP2: from
    # transformers 5.23)
    checkpointing = CONFIG_STRATEGY[strategy] in checkpointing_strategies()
    assert run["turbo_checkpointing"] is checkpointing
    if checkpointing:
        assert min(run["metrics"]["offload/offloaded_gib"]) > 0  # checkpoints did go to the host


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vLLM")
@pytest.mark.parametrize("strategy", WHOLE_PARAMETERS)
def test_every_rank_shares_weights_with_its_own_engine(tmp_path, strategy):
    """Shared weights + standby on 2 ranks (TRL's colocate: one engine per rank): on each rank one copy of the base
    weights before and after 3 steps (DDP's and DeepSpeed's start-up broadcasts write into vLLM's tensors in place),
    vLLM's samples scored by that rank's live adapter, adapter syncs in milliseconds."""
    if strategy.startswith("zero") and importlib.util.find_spec("deepspeed") is None:
        pytest.skip("needs deepspeed")
    import trl

    config = Path(trl.__file__).parent / "accelerate_configs" / f"{strategy}.yaml"
    process = subprocess.run([sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config),
                              "--num_processes", "2", "-m", "trl_turbo.testing.vllm_checks", "llama", str(tmp_path)],
                             capture_output=True, text=True, timeout=LAUNCH_TIMEOUT_S, env=fresh_rendezvous_env())
    results = [json.loads(line.split("RESULT ", 1)[1]) for line in process.stdout.splitlines() if "RESULT " in line]
    assert process.returncode == 0 and len(results) == 2, process.stdout[-3000:] + process.stderr[-6000:]
    print(results)
    assert sorted(r["rank"] for r in results) == [0, 1]
    expected = {"frozen_matrices": 2 * 7 + 2, "second_copies": []}
    for result in results:
        assert result["copies_before"] == expected and result["copies_after"] == expected
        for adapter_gap, base_gap in (result["gaps_before"], result["gaps_after"]):
            assert adapter_gap < 0.05 and base_gap > 4 * adapter_gap, (adapter_gap, base_gap)
        assert len(result["weight_sync_s"]) == 3 and max(result["weight_sync_s"]) < 0.5


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vLLM")
@pytest.mark.parametrize("sampling", ["merged", "lora", "full", "fp8", "full-fp8"])
def test_fsdp2_shards_are_the_tensor_parallel_engine_weights(tmp_path, sampling):
    """TRL's fsdp2.yaml, `vllm_tensor_parallel_size=2`, shared weights + standby. LoRA: on each rank FSDP2's shard of
    every projection lives in its vLLM TP rank's memory and still equals the checkpoint's slice after 3 steps (with
    "merged", after 3 merges into the shards and bit-exact restores); vLLM samples from the live adapter (log-prob
    gap to the sharded policy with its adapter, far from the one without). Full fine-tuning ("full"): FSDP2's fp32
    shards are cast into vLLM's slices at each sync, rank-locally; vLLM samples the trained policy, not the
    checkpoint it started from. "fp8": vLLM's projections are fp8, written per rank from FSDP2's shards, which stay
    the checkpoint's slices and leave the device while vLLM samples. "full-fp8": full fine-tuning with the
    projections' fp8 copy written per rank from the trained shards, nothing cast into them."""
    results = _sharded_checks(tmp_path, sampling)
    for result in results:
        assert result["sampling"] == sampling
        # 2 layers x 7 projections share (or, full fine-tuning's fp32 masters, are cast; fp8's are written into its
        # own fp8 tensors); the norms and the vocabulary-padded embeddings and head keep own copies
        if sampling == "full":
            assert result["shared"] == 0 and result["casts"] == 2 * 7
        elif sampling == "full-fp8":
            assert result["shared"] == 0 and result["casts"] == 0 and result["kept"] == 2 * 7
        elif sampling == "fp8":
            assert result["shared"] == result["shards_in_vllm"] == 0 and result["kept"] == 2 * 7
            assert result["differing_from_checkpoint"] == [] and min(result["parked_host_gib"]) > 0
        else:
            assert result["shared"] == 2 * 7 and result["shards_in_vllm"] == result["shared"]
            assert result["differing_from_checkpoint"] == []
        policy_gap, other_gap = result["gaps_after"]  # to the live policy; to its base (LoRA) or its start (full)
        if sampling.endswith("fp8"):  # the sampler's policy is the quantized one (as with one GPU)
            assert other_gap > 2 * policy_gap, (policy_gap, other_gap)
        else:
            assert policy_gap < 0.05 and other_gap > 4 * policy_gap, (policy_gap, other_gap)
        assert len(result["weight_sync_s"]) == 3 and max(result["weight_sync_s"]) < 0.5
        assert sampling in ("full", "fp8", "full-fp8") or min(result["shared_weights_gib"]) > 0
        # vLLM's greedy tokens are the policy's best wherever it has a clear best (what HF's greedy generate picks);
        # fp8's rounding may flip a few of them
        greedy = result["greedy"]
        allowed = greedy["compared"] // 10 if sampling.endswith("fp8") else 0
        assert greedy["mismatched"] <= allowed and greedy["compared"] >= greedy["positions"] // 4, greedy
        assert greedy["other_mismatched"] > 0, greedy  # the policy it must not sample from reads them otherwise
        # full fine-tuning's fp32 masters: vLLM's 16-bit copies leave the device with the KV cache while training
        assert sampling != "full" or min(result["released_copies_gib"]) > 0, result["released_copies_gib"]


def _sharded_checks(tmp_path: Path, *arguments: str) -> list[dict]:
    """`trl_turbo.testing.sharded_checks` under TRL's fsdp2.yaml on 2 GPUs; each rank's RESULT."""
    import trl

    config = Path(trl.__file__).parent / "accelerate_configs" / "fsdp2.yaml"
    process = subprocess.run([sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config),
                              "--num_processes", "2", "-m", "trl_turbo.testing.sharded_checks", str(tmp_path),
                              *arguments],
                             capture_output=True, text=True, timeout=LAUNCH_TIMEOUT_S, env=fresh_rendezvous_env())
    results = [json.loads(line.split("RESULT ", 1)[1]) for line in process.stdout.splitlines() if "RESULT " in line]
    assert process.returncode == 0 and len(results) == 2, process.stdout[-3000:] + process.stderr[-6000:]
    print(results)
    return results


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vLLM")
def test_a_generation_failing_inside_vllm_leaves_every_shard_bit_exact(tmp_path):
    """Merged sampling per shard, 20 steps; after step 10 one generation fails inside vLLM (after the merge into the
    shards). Every shard equals its checkpoint slice right after the failure and after the last step, and training
    goes on."""
    for result in _sharded_checks(tmp_path, "merged", "fault"):
        assert result["fault"] == {"raised": True, "differing_right_after": []}, result["fault"]
        assert result["differing_from_checkpoint"] == [] and result["shards_in_vllm"] == result["shared"] == 2 * 7
        assert len(result["losses"]) == 20
