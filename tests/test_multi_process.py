"""Two processes (CPU, gloo DDP): the patched trainer matches stock TRL step by step.

Covers what runs on CPU of the multi-GPU story: the fused loss, trl_turbo's checkpoint function, tiled MLPs and
sequence groups (each group a DDP forward/backward) under DistributedDataParallel, compared on rank 0 after the
gradient all-reduce. With several processes, offloaded checkpointing and the tiled MLP stay off for now (their
nested backward trips DDP, issue #7); the config warns about it. The processes are started by `torch.distributed.run`, the launcher `accelerate launch` uses for
several GPUs; on CPU, `accelerate launch --num_processes 2` runs one process unless MPI is set up. The
accelerator sees MULTI_CPU (gloo) because the config has `use_cpu=True`; the script asserts it.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

SCRIPT = textwrap.dedent(
    """
    import os, sys, warnings
    warnings.simplefilter("ignore")
    import torch
    from trl_turbo.testing import parity

    variant, out = sys.argv[1], sys.argv[2]
    overrides = {"gradient_checkpointing": True, "per_device_train_batch_size": 2}
    if variant == "turbo":
        overrides.update(turbo_forward_token_budget=20, turbo_tiled_mlp_tokens=8)
    from accelerate import PartialState
    assert PartialState(cpu=True).num_processes == 2, "not a 2-process run"
    records = parity.run_training(variant, overrides, steps=2, peft=True, model_kwargs={"tie_word_embeddings": False})
    if int(os.environ["RANK"]) == 0:
        torch.save([(r.loss, r.grads, r.params) for r in records], out)
    """
)


def _launch(tmp_path, variant: str) -> list:
    script = tmp_path / "run.py"
    script.write_text(SCRIPT)
    out = tmp_path / f"{variant}.pt"
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", str(script), variant, str(out)]
    result = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return torch.load(out)


@pytest.mark.slow
def test_two_process_ddp_training_matches_stock(tmp_path):
    from trl_turbo.testing.parity import StepRecord, assert_records_close

    stock = [StepRecord(loss, grads, params) for loss, grads, params in _launch(tmp_path, "stock")]
    turbo = [StepRecord(loss, grads, params) for loss, grads, params in _launch(tmp_path, "turbo")]
    assert_records_close(stock, turbo, rtol=1e-4, atol=1e-6)


def test_several_processes_warn_that_offload_and_tiles_stay_off(tmp_path, monkeypatch):
    from transformers import TrainingArguments
    from trl import GRPOConfig

    monkeypatch.setattr(TrainingArguments, "world_size", property(lambda self: 2))
    with pytest.warns(RuntimeWarning, match="not supported with several processes"):
        config = GRPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to="none",
                            per_device_train_batch_size=4, num_generations=4)
    from trl_turbo.patches.trl_checkpointing import multi_process_checkpointing_unsupported

    assert multi_process_checkpointing_unsupported(config)
