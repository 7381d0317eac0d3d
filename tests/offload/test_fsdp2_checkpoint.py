"""Two CPU processes (gloo): trl_turbo's checkpoint function (with its offloader) and the tiled MLP inside decoder
layers that FSDP2 shards, installed as a run installs them (before accelerate wraps the model), against FSDP2 with
transformers' own checkpointing.

From transformers 5.23 a layer checkpoints its `forward`, inside FSDP2's hooks, so FSDP2 has gathered the layer's
parameters when trl_turbo's function is called and gathers them again (its pre-backward hook) before the recompute.
Checked per rank after one forward and backward of a LoRA model, checkpointing enabled again once FSDP2 has
wrapped it (as TRL does around each generation): the checkpoint function's gradients (FSDP2's
reduce-scattered shards, gathered whole) equal transformers' checkpointing bitwise, the tiled MLP's within float
reassociation, with the same number of all-gathers, and the offloader moved the saved layer inputs. The automatic
memory plan, against a faked budget, plans at the first layer while FSDP2 holds the other layers as DTensors: a roomy
budget keeps every layer, a tight one offloads them all, both bitwise, each reserving room for gathered layers.
(A run under FSDP2 turns both features on from transformers 5.23: `distributed.VERSION_GATES`.)
"""

from __future__ import annotations

import textwrap

import pytest
from packaging.version import Version

from trl_turbo import versions
from trl_turbo.offload.memory_plan import SHARDED_RESERVE_LAYERS
from trl_turbo.testing.multi_gpu import per_rank_reports

SCRIPT = textwrap.dedent(
    """
    import json, sys, warnings
    warnings.simplefilter("ignore")
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    import torch.distributed.fsdp._fully_shard._fsdp_param_group as param_group
    from peft import LoraConfig, get_peft_model

    import trl_turbo  # noqa: F401
    from trl_turbo.offload.checkpoint import CheckpointOffloader
    from trl_turbo.offload import tiled_mlp
    from trl_turbo.offload.install import CheckpointingRuntime, install_runtime, install_tiled_mlp
    from trl_turbo.offload.memory_plan import MemoryPlanner, reserve_margin
    from trl_turbo.testing.models import tiny_model
    from trl_turbo.testing.multi_gpu import leave_finished_process

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    gathers = [0]
    unshard = param_group.FSDPParamGroup.unshard

    def counting_unshard(self, *args, **kwargs):
        if not self.is_unsharded:
            gathers[0] += 1
        return unshard(self, *args, **kwargs)

    param_group.FSDPParamGroup.unshard = counting_unshard
    tiles = [0]
    tiled_apply = tiled_mlp._TiledMLP.apply

    def counting_tiled(*args):
        tiles[0] += 1
        return tiled_apply(*args)

    tiled_mlp._TiledMLP.apply = counting_tiled


    def step(variant):
        model = tiny_model("llama", vocab_size=64, hidden_size=32, layers=3, intermediate_size=64, seed=0)
        torch.manual_seed(0)
        model = get_peft_model(model, LoraConfig(r=4, target_modules="all-linear", init_lora_weights=False))
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        base = model.base_model.model
        offloader = planner = None
        if variant != "transformers":
            offloader = CheckpointOffloader(1 << 30, min_bytes=0)
            if variant.startswith("planned"):
                # the automatic plan against a faked device budget: roomy keeps every layer's activations (layer 0
                # measures them while FSDP2 holds the other layers' parameters as DTensors), tight offloads them all
                free = 1 << 40 if variant == "planned-roomy" else 0
                planner = MemoryPlanner(layer_count=3, parameters=model.parameters, can_offload=True,
                                        budget=lambda device: (free, 0, 1 << 40))
            install_runtime(base, CheckpointingRuntime(offloader, planner))
        if variant == "tiled":
            install_tiled_mlp(base, tile_tokens=8)
        for layer in base.model.layers:
            fully_shard(layer)
        fully_shard(model)
        # TRL enables checkpointing again around each generation, after accelerate wrapped the model: trl_turbo's
        # function must come back on the wrapped layers (whose class FSDP2 has swapped)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()
        torch.manual_seed(1 + rank)
        ids = torch.randint(4, 64, (2, 24))
        gathers[0] = tiles[0] = 0
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        grads = {name: p.grad.full_tensor() for name, p in model.named_parameters() if p.requires_grad}
        moved = offloader.take_stats().offloaded_bytes if offloader is not None else 0
        kept = planner.current.kept_layers if planner is not None else -1
        # the planner's reserve for FSDP2's gathered layers, beyond the margin of an unsharded model
        reserve = planner.last_budget[2] - reserve_margin(1 << 40) if planner is not None else -1
        # DTensors count whole; the reserve counts them as a bf16 mixed-precision policy gathers them, in 16 bits
        whole = sum(p.numel() * min(p.element_size(), 2) for p in model.parameters())
        # and room for the gradients the backward allocates: this rank's shards of the adapter's (the first layer's
        # gathered while its forward is planned, their gradients landing on its shards)
        trainable = sum(p.to_local().numel() * p.element_size() for p in model.parameters() if p.requires_grad)
        return loss.item(), grads, gathers[0], moved, tiles[0], kept, reserve, whole, trainable


    variants = ("transformers", "turbo", "tiled", "planned-roomy", "planned-tight")
    results = {variant: step(variant) for variant in variants}
    reference = results["transformers"][1]
    report = {"loss": {v: r[0] for v, r in results.items()}, "gathers": {v: r[2] for v, r in results.items()},
              "offloaded_bytes": {v: r[3] for v, r in results.items()},
              "tiled_calls": {v: r[4] for v, r in results.items()},
              "kept_layers": {v: r[5] for v, r in results.items()},
              "sharded_reserve": {v: r[6] for v, r in results.items()}, "model_bytes": results["turbo"][7],
              "trainable_shard_bytes": results["turbo"][8],
              "trainable": len(reference)}
    for variant in variants[1:]:
        grads = results[variant][1]
        report[f"{variant}_missing"] = sorted(set(reference) - {n for n, g in grads.items() if g is not None})
        report[f"{variant}_max_abs"] = max(float((grads[n] - reference[n]).abs().max()) for n in reference)
        report[f"{variant}_max_rel"] = max(float((grads[n] - reference[n]).norm() / reference[n].norm())
                                           for n in reference)
    with open(sys.argv[1] + f".{rank}", "w") as handle:
        json.dump(report, handle)
    leave_finished_process()
    """
)


@pytest.mark.skipif(Version(versions.installed_version("transformers")) < Version("5.23"),
                    reason="transformers before 5.23 checkpoints a layer's __call__, with FSDP2's hooks inside")
def test_checkpoint_function_and_tiled_mlp_inside_fsdp2_layers(tmp_path):
    for report in per_rank_reports(SCRIPT, tmp_path):
        assert report["trainable"] == 3 * 7 * 2  # LoRA A and B on 7 projections of 3 layers
        for variant in ("turbo", "tiled", "planned-roomy", "planned-tight"):
            assert report[f"{variant}_missing"] == []
        for variant in ("turbo", "planned-roomy", "planned-tight"):
            assert report["loss"][variant] == report["loss"]["transformers"]
            assert report[f"{variant}_max_abs"] == 0.0  # the same arithmetic: bitwise
        assert report["kept_layers"]["planned-roomy"] == 3 and report["kept_layers"]["planned-tight"] == 0
        assert report["offloaded_bytes"]["planned-tight"] > 0 and report["offloaded_bytes"]["planned-roomy"] == 0
        assert report["gathers"]["planned-tight"] == report["gathers"]["transformers"]
        # under FSDP2 the plan keeps SHARDED_RESERVE_LAYERS layers' worth of the whole model free besides its margin
        expected = SHARDED_RESERVE_LAYERS * (report["model_bytes"] // 3) + report["trainable_shard_bytes"]
        assert report["sharded_reserve"]["planned-roomy"] == report["sharded_reserve"]["planned-tight"] == expected
        assert report["tiled_max_rel"] < 1e-5  # per-tile sums, fp32
        assert report["gathers"]["turbo"] == report["gathers"]["tiled"] == report["gathers"]["transformers"]
        assert report["offloaded_bytes"]["turbo"] > 0 and report["offloaded_bytes"]["tiled"] > 0
        # the tiled MLP's autograd Function ran in each of the 3 layers' recompute (the no-grad forward tiles without
        # it), and only where installed
        assert report["tiled_calls"]["tiled"] == 3 and report["tiled_calls"]["turbo"] == 0
