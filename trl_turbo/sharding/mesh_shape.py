"""The device mesh that makes each FSDP2 shard group a vLLM tensor-parallel group: HSDP (replicate, shard).

Design: one layout serves both sides. With T = vLLM's tensor-parallel size, the mesh is `(world / T, T)`, row-major
over global ranks (torchrun numbers them node by node), so shard group g is ranks `[g*T, (g+1)*T)`: exactly the
contiguous groups TRL's colocate mode builds for vLLM (`new_subgroups_by_enumeration`), the groups vLLM itself forms
under `distributed_executor_backend="external_launcher"` (vLLM 0.24 `parallel_state.initialize_model_parallel`:
`arange(world).reshape(-1, dp, pp, pcp, tp)`, TP innermost), and the mesh accelerate builds from
`ParallelismConfig(dp_replicate_size=world/T, dp_shard_size=T)` (dims ordered dp_replicate, dp_shard). A rank's index
in its shard group, `rank % T`, is then its vLLM TP rank, which is what `tp_layout` needs. Gradients are
reduce-scattered within a group and all-reduced across groups (replicate dim: same shard index on every group).
T must divide the GPUs per node: a TP group does an all-reduce per layer in generation, and the FSDP2 shard group an
all-gather per layer in training, both over NVLink only within a node; a group straddling nodes is refused, with
the sizes that fit named.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

DIM_NAMES: tuple[str, str] = ("dp_replicate", "dp_shard")


@dataclass(frozen=True)
class MeshLayout:
    """`nodes` x `gpus_per_node` ranks as a (replicate, shard) mesh whose shard groups are the TP groups."""

    nodes: int
    gpus_per_node: int
    tp_size: int

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def shape(self) -> tuple[int, int]:
        """(replicate, shard) sizes."""
        return self.world_size // self.tp_size, self.tp_size

    @property
    def dim_names(self) -> tuple[str, str]:
        return DIM_NAMES

    @property
    def is_hsdp(self) -> bool:
        """More than one shard group: gradients are also all-reduced across groups."""
        return self.shape[0] > 1

    def mesh(self) -> list[list[int]]:
        """The global ranks as the mesh holds them: row g = shard group g."""
        return [list(range(g * self.tp_size, (g + 1) * self.tp_size)) for g in range(self.shape[0])]

    def shard_groups(self) -> list[list[int]]:
        """FSDP2 shard groups = vLLM tensor-parallel groups."""
        return self.mesh()

    def replicate_groups(self) -> list[list[int]]:
        """Ranks holding the same shard (same TP rank), one per shard group."""
        return [list(range(s, self.world_size, self.tp_size)) for s in range(self.tp_size)]

    def coordinates(self, rank: int) -> tuple[int, int]:
        """(shard group index, index within it = vLLM TP rank) of a global rank."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside a world of {self.world_size}")
        return divmod(rank, self.tp_size)

    def node_of(self, rank: int) -> int:
        return rank // self.gpus_per_node

    def accelerate_sizes(self) -> dict[str, int]:
        """accelerate's ParallelismConfig sizes that build this mesh."""
        return {"dp_replicate_size": self.shape[0], "dp_shard_size": self.shape[1]}

    def fsdp_mesh_shape(self) -> tuple[int, ...]:
        """The mesh to give `fully_shard`: 1-D (plain FSDP) when there is one shard group, else 2-D (HSDP)."""
        return self.shape if self.is_hsdp else (self.tp_size,)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def hsdp_mesh(nodes: int, gpus_per_node: int, tp_size: int) -> MeshLayout:
    """The (replicate, shard) layout for `nodes` x `gpus_per_node` ranks and vLLM tensor-parallel size `tp_size`;
    raises ValueError when a TP group would not fit within one node."""
    for what, value in (("nodes", nodes), ("GPUs per node", gpus_per_node), ("vllm_tensor_parallel_size", tp_size)):
        if value < 1:
            raise ValueError(f"{what} must be >= 1, got {value}")
    if gpus_per_node % tp_size:
        raise ValueError(
            f"vllm_tensor_parallel_size={tp_size} does not divide the {gpus_per_node} GPUs per node: its "
            "tensor-parallel groups, which are also the FSDP2 shard groups, must each lie within one node. Set "
            f"vllm_tensor_parallel_size to one of {', '.join(map(str, _divisors(gpus_per_node)))}.")
    return MeshLayout(nodes, gpus_per_node, tp_size)


def trl_tp_groups(world_size: int, tp_size: int) -> list[list[int]]:
    """The groups TRL's colocate mode gives vLLM (trl/generation/vllm_generation.py: consecutive ranks)."""
    return [list(range(i * tp_size, (i + 1) * tp_size)) for i in range(world_size // tp_size)]


def device_mesh(layout: MeshLayout, device_type: str) -> Any:
    """torch's DeviceMesh for `fully_shard` (needs the default process group, world = layout.world_size)."""
    from torch.distributed.device_mesh import init_device_mesh

    if layout.is_hsdp:
        return init_device_mesh(device_type, layout.shape, mesh_dim_names=layout.dim_names)
    return init_device_mesh(device_type, (layout.tp_size,), mesh_dim_names=(layout.dim_names[1],))
