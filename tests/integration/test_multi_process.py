"""Two processes (CPU, gloo DDP): the patched trainer matches stock TRL step by step, and the decisions and metrics
that involve every rank agree.

Covers what runs on CPU of the multi-GPU story: the fused loss, trl_turbo's checkpoint function (parameter gradients
handed to DDP's outer backward pass), tiled MLPs and sequence groups (each group a DDP forward/backward) under
DistributedDataParallel, compared on rank 0 after the gradient all-reduce; the group count agreed over ranks whose
completions have different lengths, or where one rank's micro-batch cannot be split; metrics reduced over ranks. The
processes are started by `torch.distributed.run`, the launcher `accelerate launch` uses for several GPUs; on CPU,
`accelerate launch --num_processes 2` runs one process unless MPI is set up. The accelerator sees MULTI_CPU (gloo)
because the config has `use_cpu=True`; the script asserts it.
"""

from __future__ import annotations

import sys
import textwrap

import pytest
import torch

from trl_turbo.testing.multi_gpu import run_launch

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
    from trl_turbo.testing.multi_gpu import leave_finished_process
    leave_finished_process()
    """
)


def _launch(tmp_path, variant: str) -> list:
    script = tmp_path / "run.py"
    script.write_text(SCRIPT)
    out = tmp_path / f"{variant}.pt"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(script),
               variant, str(out)]
    result = run_launch(command, cwd=tmp_path, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return torch.load(out)


@pytest.mark.slow
def test_two_process_ddp_training_matches_stock(tmp_path):
    from trl_turbo.testing.parity import StepRecord, assert_records_close

    stock = [StepRecord(loss, grads, params) for loss, grads, params in _launch(tmp_path, "stock")]
    turbo = [StepRecord(loss, grads, params) for loss, grads, params in _launch(tmp_path, "turbo")]
    assert_records_close(stock, turbo, rtol=1e-4, atol=1e-6)


COLLECTIVES_SCRIPT = textwrap.dedent(
    """
    import types
    import torch
    from accelerate import Accelerator
    from accelerate.utils import DistributedType
    from trl_turbo.grpo.step_metrics import reduced_over_ranks
    from trl_turbo.grpo.sequence_groups import sequence_groups

    accelerator = Accelerator(cpu=True)
    rank = accelerator.process_index
    assert accelerator.num_processes == 2 and accelerator.distributed_type == DistributedType.MULTI_CPU
    trainer = types.SimpleNamespace(
        args=types.SimpleNamespace(turbo_forward_token_budget=64), model=types.SimpleNamespace(training=True),
        accelerator=accelerator, top_entropy_quantile=1.0, loss_type="dapo", use_adaptive_entropy=False,
        aux_loss_enabled=False)
    # 6 sequences per rank; rank 0's completions are padded to 28 tokens (6 x 32 > 64: 3 groups of 2), rank 1's to
    # 4 (6 x 8 fits): alone, rank 1 would run one forward and rank 0 three.
    completion = 28 if rank == 0 else 4
    inputs = {"prompt_ids": torch.zeros(6, 4, dtype=torch.long),
              "completion_ids": torch.zeros(6, completion, dtype=torch.long)}
    groups = sequence_groups(trainer, inputs)
    assert [(g.start, g.stop) for g in groups] == [(0, 2), (2, 4), (4, 6)], groups
    # Rank 1's micro-batch carries images (rows are patches, not sequences): no rank splits, and none hangs
    images = {"pixel_values": torch.zeros(10, 8)} if rank == 1 else {}
    assert sequence_groups(trainer, {**inputs, **images}) is None
    reduced = reduced_over_ranks(accelerator,
                                 {"offload/offloaded_gib": float(rank), "offload/host_peak_gib": 3.0 * rank},
                                 frozenset({"offload/host_peak_gib"}))
    assert reduced == {"offload/offloaded_gib": 0.5, "offload/host_peak_gib": 3.0}, reduced
    open(f"rank{rank}.ok", "w").close()
    from trl_turbo.testing.multi_gpu import leave_finished_process
    leave_finished_process()
    """
)


def test_group_count_and_metrics_agree_across_ranks(tmp_path):
    script = tmp_path / "collectives.py"
    script.write_text(COLLECTIVES_SCRIPT)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(script)]
    result = run_launch(command, cwd=tmp_path, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert (tmp_path / "rank0.ok").exists() and (tmp_path / "rank1.ok").exists()


@pytest.mark.slow
def test_two_processes_follow_the_one_process_loss_curve(tmp_path):
    """The harness the 2-GPU tests use (completions fixed by prompt), on CPU: with the same global batch, two gloo
    DDP processes with every CPU-capable trl_turbo feature train like one process."""
    import json

    base = [sys.executable, "-m", "trl_turbo.testing.multi_gpu", "--steps", "2", "--out"]
    runs = {}
    two_processes = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    for name, launcher in (("one", []), ("two", two_processes)):
        out = tmp_path / f"{name}.json"
        command = [sys.executable, *launcher, *base[1:], str(out)] if launcher else [*base, str(out)]
        result = run_launch(command, cwd=tmp_path, timeout=900)
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
        runs[name] = json.loads(out.read_text())
    assert runs["two"]["processes"] == 2 and runs["two"]["turbo_checkpointing"]
    assert runs["one"]["metrics"]["reward"] == runs["two"]["metrics"]["reward"]  # the same samples
    torch.testing.assert_close(torch.tensor(runs["two"]["losses"]), torch.tensor(runs["one"]["losses"]),
                               rtol=1e-4, atol=1e-6)
