"""Two CPU processes (gloo): `wholes_of` gathers every DTensor sharded on dim 0 over one mesh dimension in one
all-gather, and each whole equals the DTensor's own `full_tensor()`: uneven rows (a rank holding fewer, or none),
1-D and 2-D tensors, a 2-D (HSDP-shaped) mesh, FSDP2's own parameters; replicated DTensors and plain tensors pass
through."""

from __future__ import annotations

import textwrap

from trl_turbo.testing.multi_gpu import per_rank_reports

SCRIPT = textwrap.dedent(
    """
    import json, sys, warnings
    warnings.simplefilter("ignore")
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.debug import CommDebugMode
    from trl_turbo.sharding.dtensor import wholes_of
    from trl_turbo.testing.models import tiny_model
    from trl_turbo.testing.multi_gpu import leave_finished_process

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    gathers = [0]
    all_gather = dist.all_gather_into_tensor

    def counting(*args, **kwargs):
        gathers[0] += 1
        return all_gather(*args, **kwargs)

    dist.all_gather_into_tensor = counting
    torch.manual_seed(0)
    flat = init_device_mesh("cpu", (2,))
    hsdp = init_device_mesh("cpu", (1, 2), mesh_dim_names=("replicate", "shard"))
    whole = [torch.randn(32), torch.randn(5, 3), torch.randn(1, 4), torch.randn(7)]
    tensors = [distribute_tensor(t, flat, [Shard(0)]) for t in whole]
    tensors += [distribute_tensor(whole[1], hsdp, [Replicate(), Shard(0)]),
                distribute_tensor(whole[0], flat, [Replicate()]), whole[3]]
    expected = [t.full_tensor() if hasattr(t, "full_tensor") else t for t in tensors]
    gathers[0] = 0
    with CommDebugMode() as comm:  # every collective, DTensor's own included
        got = wholes_of(tensors)
    report = {"gathers": gathers[0], "collectives": comm.get_total_counts(),
              "equal": [bool(torch.equal(a, b)) for a, b in zip(got, expected)],
              "shapes": [list(g.shape) for g in got]}

    model = tiny_model("llama", vocab_size=64, hidden_size=32, layers=2, intermediate_size=64, seed=0)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    params = [p.detach() for p in model.parameters()]
    expected = [p.full_tensor() for p in params]
    gathers[0] = 0
    with CommDebugMode() as comm:
        got = wholes_of(params)
    report["model_gathers"] = gathers[0]
    report["model_collectives"] = comm.get_total_counts()
    report["model_equal"] = all(torch.equal(a, b) for a, b in zip(got, expected))
    report["model_tensors"] = len(params)
    with open(sys.argv[1] + f".{rank}", "w") as handle:
        json.dump(report, handle)
    leave_finished_process()
    """
)


def test_dim0_shards_are_gathered_whole_in_one_collective_per_mesh_dimension(tmp_path):
    for report in per_rank_reports(SCRIPT, tmp_path):
        assert report["equal"] == [True] * 7
        assert report["shapes"] == [[32], [5, 3], [1, 4], [7], [5, 3], [32], [7]]
        # the four on the flat mesh in one, the HSDP-shaped one in another; the replicated and the plain need none
        assert report["gathers"] == report["collectives"] == 2
        assert report["model_equal"] and report["model_tensors"] > 10
        assert report["model_gathers"] == report["model_collectives"] == 1


HSDP_SCRIPT = """
import json, sys, warnings
warnings.simplefilter("ignore")
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.distributed.tensor.debug import CommDebugMode
from trl_turbo.sharding.dtensor import wholes_of
from trl_turbo.testing.multi_gpu import leave_finished_process

dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
whole = [torch.randn(7, 3), torch.randn(4), torch.randn(1, 5)]
tensors = [distribute_tensor(t, mesh, [Replicate(), Shard(0)]) for t in whole]
with CommDebugMode() as comm:
    got = wholes_of(tensors)
report = {"equal": all(torch.equal(a, b) for a, b in zip(got, whole)), "collectives": comm.get_total_counts()}
with open(sys.argv[1] + f".{rank}", "w") as handle:
    json.dump(report, handle)
leave_finished_process()
"""


def test_hsdp_shards_are_gathered_within_their_shard_group(tmp_path):
    """Four CPU processes, a 2 x 2 mesh (replicated over the first dimension, sharded over the second, as HSDP lays
    FSDP2's parameters out): one gather over the shard group gives every whole tensor on every rank."""
    for report in per_rank_reports(HSDP_SCRIPT, tmp_path, processes=4):
        assert report == {"equal": True, "collectives": 1}
