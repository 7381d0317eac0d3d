"""The HSDP mesh layout: which global ranks form each TP/shard group, across node counts and TP sizes."""

from __future__ import annotations

import pytest

from trl_turbo.sharding.mesh_shape import hsdp_mesh, trl_tp_groups

CASES = {
    # (nodes, GPUs per node, T): (shape, shard groups, replicate groups)
    (1, 2, 2): ((1, 2), [[0, 1]], [[0], [1]]),
    (1, 4, 2): ((2, 2), [[0, 1], [2, 3]], [[0, 2], [1, 3]]),
    (1, 4, 4): ((1, 4), [[0, 1, 2, 3]], [[0], [1], [2], [3]]),
    (1, 8, 4): ((2, 4), [[0, 1, 2, 3], [4, 5, 6, 7]], [[0, 4], [1, 5], [2, 6], [3, 7]]),
    (1, 8, 8): ((1, 8), [list(range(8))], [[r] for r in range(8)]),
    (2, 8, 8): ((2, 8), [list(range(8)), list(range(8, 16))], [[r, r + 8] for r in range(8)]),
    (2, 8, 2): ((8, 2), [[2 * g, 2 * g + 1] for g in range(8)], [list(range(0, 16, 2)), list(range(1, 16, 2))]),
    (4, 8, 8): ((4, 8), [list(range(8 * n, 8 * n + 8)) for n in range(4)], [[r, r + 8, r + 16, r + 24]
                                                                           for r in range(8)]),
    (4, 8, 4): ((8, 4), [list(range(4 * g, 4 * g + 4)) for g in range(8)], [list(range(s, 32, 4))
                                                                           for s in range(4)]),
}


@pytest.mark.parametrize(("key", "expected"), CASES.items(), ids=lambda v: str(v))
def test_groups(key, expected):
    shape, shard_groups, replicate_groups = expected
    layout = hsdp_mesh(*key)
    assert layout.shape == shape
    assert layout.shard_groups() == shard_groups
    assert layout.replicate_groups() == replicate_groups
    assert layout.shard_groups() == trl_tp_groups(layout.world_size, layout.tp_size)
    assert layout.is_hsdp == (shape[0] > 1)
    for group in layout.shard_groups():  # a TP group never straddles nodes
        assert len({layout.node_of(rank) for rank in group}) == 1
        assert [layout.coordinates(rank)[1] for rank in group] == list(range(layout.tp_size))


def test_16_nodes_of_8():
    layout = hsdp_mesh(16, 8, 8)
    assert layout.world_size == 128 and layout.shape == (16, 8)
    assert layout.shard_groups()[5] == list(range(40, 48))
    assert layout.replicate_groups()[3] == list(range(3, 128, 8))
    assert layout.coordinates(93) == (11, 5) and layout.node_of(93) == 11
    assert layout.accelerate_sizes() == {"dp_replicate_size": 16, "dp_shard_size": 8}
    layout2 = hsdp_mesh(16, 8, 2)
    assert layout2.shape == (64, 2) and layout2.shard_groups()[63] == [126, 127]
    assert {layout2.node_of(r) for r in layout2.replicate_groups()[1]} == set(range(16))


def test_one_group_is_plain_fsdp():
    assert hsdp_mesh(1, 2, 2).fsdp_mesh_shape() == (2,)
    assert hsdp_mesh(2, 8, 8).fsdp_mesh_shape() == (2, 8)


@pytest.mark.parametrize(("gpus", "tp", "fits"), [(8, 3, "1, 2, 4, 8"), (8, 16, "1, 2, 4, 8"), (6, 4, "1, 2, 3, 6")])
def test_a_tp_group_across_nodes_is_refused(gpus, tp, fits):
    with pytest.raises(ValueError, match=rf"does not divide the {gpus} GPUs per node.*one of {fits}\."):
        hsdp_mesh(2, gpus, tp)


def test_nonpositive_sizes_are_refused():
    with pytest.raises(ValueError, match="nodes must be >= 1"):
        hsdp_mesh(0, 8, 2)


@pytest.mark.parametrize("key", [(2, 8, 8), (4, 8, 2), (1, 8, 4)])
def test_accelerate_builds_the_same_mesh(key):
    """accelerate's ParallelismConfig with these sizes orders its mesh dims (dp_replicate, dp_shard) and sizes them
    as we do, so its `fsdp_dim_names` mesh is this one."""
    from accelerate.parallelism_config import ParallelismConfig

    layout = hsdp_mesh(*key)
    config = ParallelismConfig(**layout.accelerate_sizes())
    names, shape = config._get_mesh()
    assert tuple(names) == layout.dim_names and tuple(shape) == layout.shape
