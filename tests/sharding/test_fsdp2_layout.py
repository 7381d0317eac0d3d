"""Two CPU processes (gloo), FSDP2 with trl_turbo's `shard_placement_fn`: each rank's local shard of every shared
projection is the slice `tp_layout` says vLLM's TP rank holds, and the packed q|k|v and gate|up tensors vLLM's rank
would hold are those shards stacked.

A tiny Llama (4 heads, hidden 64, intermediate 128, 2 layers) is sharded per decoder layer and at the root over a
1-D mesh of the 2 ranks (the TP group), as `fsdp2_prepare_model` does with accelerate's auto-wrap policy. Two
models: 2 KV heads and a 128-token vocabulary (everything but the norms shared), and 1 KV head with a 100-token tied
vocabulary (k/v replicated by vLLM and the vocabulary padded: own copies, FSDP2's default Shard(0)). The sharded
model's logits equal the unsharded model's and backward runs, so Shard(1) on o_proj/down_proj gathers back right.
Launched with `torch.distributed.run`, as the other multi-process tests; slow variants run 4 processes: as 2
"nodes" of 2 on a (replicate, shard) = (2, 2) HSDP mesh from `hsdp_mesh`, and as one tensor-parallel group of 4.
"""

from __future__ import annotations

import json
import sys
import textwrap

import pytest

from trl_turbo.testing.multi_gpu import fresh_rendezvous_env, run_launch

SCRIPT = textwrap.dedent(
    """
    import copy, json, os, sys, warnings
    warnings.simplefilter("ignore")
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate, Shard

    from trl_turbo.sharding.mesh_shape import device_mesh, hsdp_mesh
    from trl_turbo.sharding.shard_placement import ShardPlacementFn, applied_shard_dims, model_facts, plan_model
    from trl_turbo.sharding.tp_layout import tp_layout
    from trl_turbo.testing.models import tiny_model
    from trl_turbo.testing.multi_gpu import leave_finished_process

    dist.init_process_group("gloo")
    layout = hsdp_mesh(*map(int, sys.argv[2:5]))  # nodes, GPUs per node, T
    assert layout.world_size == int(os.environ["WORLD_SIZE"])
    across = (Replicate(),) if layout.is_hsdp else ()  # HSDP: replicated over shard groups, sharded within
    mesh = device_mesh(layout, "cpu")
    rank = dist.get_rank()
    tp_rank = layout.coordinates(rank)[1]
    report = {}
    tp = layout.tp_size
    for case, (kv_heads, vocab, tied) in {"gqa": (tp, 128, False), "mqa_padded_tied": (1, 100, True)}.items():
        model = tiny_model("llama", vocab_size=vocab, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                           num_key_value_heads=kv_heads, head_dim=16, layers=2, tie_word_embeddings=tied)
        reference = copy.deepcopy(model)
        full = {name: param.detach().clone() for name, param in model.named_parameters()}
        facts = model_facts(model)
        plan = plan_model(model, layout.tp_size)
        planned = {p.name: p for p in plan.params}
        fn = ShardPlacementFn(model, plan)
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh, shard_placement_fn=fn)
        fully_shard(model, mesh=mesh, shard_placement_fn=fn)
        assert not fn.unplanned, fn.unplanned
        assert applied_shard_dims(model) == plan.shard_dims(), (applied_shard_dims(model), plan.shard_dims())

        packed = {}
        for name, param in model.named_parameters():
            local = param.to_local()
            sliced = tp_layout(name, full[name].shape, facts, tp, tp_rank)
            if planned[name].kind == "shared":
                s = sliced.slice
                assert param.placements == (*across, Shard(sliced.fsdp_dim)), (name, param.placements)
                assert torch.equal(local, full[name].narrow(s.dim, s.start, s.length)), name
                sizes = list(full[name].shape)
                sizes[s.dim] = s.local_size
                target = packed.setdefault(sliced.vllm_name, torch.full(sizes, float("nan")))
                target.narrow(s.dim, s.offset, s.length).copy_(local)
            else:
                assert param.placements == (*across, Shard(0)), (name, param.placements)
                if sliced.slice is not None and sliced.slice.dim is not None:  # FSDP2's chunk is not vLLM's slice
                    vllm_rows = full[name].narrow(sliced.slice.dim, sliced.slice.start, sliced.slice.length)
                    assert local.shape != vllm_rows.shape or not torch.equal(local, vllm_rows), name

        # vLLM's rank tp_rank: qkv = [q_r | k_r | v_r] (QKVParallelLinear), gate_up = [gate_r | up_r]
        attn, mlp = "model.layers.1.self_attn", "model.layers.1.mlp"
        q_rows, kv_rows, mlp_cols = 4 // tp * 16, max(kv_heads // tp, 1) * 16, 128 // tp
        if kv_heads == tp:
            expected_qkv = torch.cat([full[f"{attn}.q_proj.weight"][tp_rank * q_rows:(tp_rank + 1) * q_rows],
                                      full[f"{attn}.k_proj.weight"][tp_rank * kv_rows:(tp_rank + 1) * kv_rows],
                                      full[f"{attn}.v_proj.weight"][tp_rank * kv_rows:(tp_rank + 1) * kv_rows]])
            assert torch.equal(packed[f"{attn}.qkv_proj.weight"], expected_qkv)
        else:  # only q is shared; k and v rows stay vLLM's own (NaN here)
            assert torch.equal(packed[f"{attn}.qkv_proj.weight"][:q_rows],
                               full[f"{attn}.q_proj.weight"][tp_rank * q_rows:(tp_rank + 1) * q_rows])
            assert packed[f"{attn}.qkv_proj.weight"][q_rows:].isnan().all()
        rows = slice(tp_rank * mlp_cols, (tp_rank + 1) * mlp_cols)
        expected_gate_up = torch.cat([full[f"{mlp}.gate_proj.weight"][rows], full[f"{mlp}.up_proj.weight"][rows]])
        assert torch.equal(packed[f"{mlp}.gate_up_proj.weight"], expected_gate_up)
        assert torch.equal(packed[f"{mlp}.down_proj.weight"], full[f"{mlp}.down_proj.weight"][:, rows])

        ids = torch.randint(0, vocab, (2, 12), generator=torch.Generator().manual_seed(0))
        logits = model(input_ids=ids).logits
        torch.testing.assert_close(logits, reference(input_ids=ids).logits)
        logits.pow(2).mean().backward()
        for name, param in model.named_parameters():
            assert param.grad is not None and param.grad.to_local().shape == param.to_local().shape, name
        report[case] = {"shared": sorted(p.name for p in plan.of_kind("shared")),
                        "own_copy": {p.name: [p.obstacle.value, p.vllm_copy_bytes] for p in plan.of_kind("own_copy")}}
    if rank == 0:
        with open(sys.argv[1], "w") as handle:
            json.dump(report, handle)
    leave_finished_process()
    """
)


def _launch(tmp_path, nodes: int, gpus_per_node: int, tp_size: int) -> dict:
    script = tmp_path / "fsdp2_layout.py"
    script.write_text(SCRIPT)
    out = tmp_path / "report.json"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
               str(nodes * gpus_per_node), str(script), str(out), str(nodes), str(gpus_per_node), str(tp_size)]
    result = run_launch(command, cwd=tmp_path, timeout=600, env=fresh_rendezvous_env())
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    return json.loads(out.read_text())


def _check_report(report: dict, tp_size: int = 2) -> None:
    gqa, mqa = report["gqa"], report["mqa_padded_tied"]
    assert len(gqa["shared"]) == 2 + 2 * 7 and {v[0] for v in gqa["own_copy"].values()} == {"replicated"}
    # vLLM pads the 100-token vocabulary to 128 rows: each rank's own copy holds 128 / T rows of 64 fp32 columns
    assert mqa["own_copy"]["model.embed_tokens.weight"] == ["vocab_padded", 128 // tp_size * 64 * 4]
    assert mqa["own_copy"]["model.layers.0.self_attn.k_proj.weight"] == ["kv_replicated", 16 * 64 * 4]
    assert "lm_head.weight" not in mqa["own_copy"] and "lm_head.weight" not in mqa["shared"]  # tied: planned once


def test_fsdp2_local_shards_are_vllm_tp_slices(tmp_path):
    """One TP group of 2 ranks, a 1-D mesh (plain FSDP2)."""
    _check_report(_launch(tmp_path, 1, 2, 2))


@pytest.mark.slow
def test_hsdp_shards_follow_the_rank_within_its_group(tmp_path):
    """4 processes as 2 'nodes' of 2, T=2: a (2, 2) HSDP mesh; ranks 2 and 3 hold TP ranks 0 and 1's slices (their
    index in the shard group, not their global rank), replicated over the two groups."""
    _check_report(_launch(tmp_path, 2, 2, 2))


@pytest.mark.slow
def test_four_ranks_are_one_tp_group_of_four(tmp_path):
    """4 processes, T=4 (a 70B model's layout on 4 GPUs): one head of 4 and a quarter of the MLP per rank, the 4 KV
    heads one per rank (the MQA case's one KV head replicated)."""
    _check_report(_launch(tmp_path, 1, 4, 4), tp_size=4)
