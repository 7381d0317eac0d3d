"""Two CPU processes (gloo): FSDP2-wrapped modules by their own class, and put back on their shards after a forward
that left them gathered (`reshard_after_forward=False`, and the root, which FSDP2 never reshards after forward)."""

from __future__ import annotations

import textwrap

from trl_turbo.sharding.fsdp_modules import own_class_name, reshard_all
from trl_turbo.testing.multi_gpu import per_rank_reports

SCRIPT = textwrap.dedent(
    """
    import json, sys, warnings
    warnings.simplefilter("ignore")
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    from trl_turbo.sharding.fsdp_modules import own_class_name, reshard_all
    from trl_turbo.testing.models import tiny_model
    from trl_turbo.testing.multi_gpu import leave_finished_process

    dist.init_process_group("gloo")
    model = tiny_model("llama", vocab_size=64, hidden_size=32, layers=2, intermediate_size=64, seed=0)
    for layer in model.model.layers:
        fully_shard(layer, reshard_after_forward=False)
    fully_shard(model)
    ids = torch.randint(4, 64, (2, 12), generator=torch.Generator().manual_seed(dist.get_rank()))
    with torch.no_grad():
        model(input_ids=ids)
    gathered = sorted(n for n, p in model.named_parameters() if not isinstance(p, DTensor))
    modules = reshard_all(model)
    still = sorted(n for n, p in model.named_parameters() if not isinstance(p, DTensor))
    again = reshard_all(model)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    report = {"gathered": gathered, "modules": modules, "still_gathered": still, "again": again,
              "layer_class": own_class_name(model.model.layers[0]),
              "wrapped_class": type(model.model.layers[0]).__name__,
              "loss_finite": bool(torch.isfinite(loss)),
              "grads": sum(p.grad is not None for p in model.parameters())}
    with open(sys.argv[1] + f".{dist.get_rank()}", "w") as handle:
        json.dump(report, handle)
    leave_finished_process()
    """
)


def test_reshard_all_puts_gathered_layers_and_the_root_back_on_their_shards(tmp_path):
    for report in per_rank_reports(SCRIPT, tmp_path):
        # the forward left the layers (reshard_after_forward=False) and the root's embedding gathered
        assert any(".layers." in name for name in report["gathered"]), report["gathered"]
        assert "model.embed_tokens.weight" in report["gathered"]
        assert report["still_gathered"] == [] and report["modules"] == report["again"] == 3  # 2 layers + root
        assert report["wrapped_class"] == "FSDPLlamaDecoderLayer" and report["layer_class"] == "LlamaDecoderLayer"
        assert report["loss_finite"] and report["grads"] > 0  # training goes on from the shards


def test_without_fsdp2_nothing_is_resharded_and_classes_are_their_own():
    import torch

    model = torch.nn.Sequential(torch.nn.Linear(2, 2))
    assert reshard_all(model) == 0
    assert own_class_name(model[0]) == "Linear"
