"""Memory for long sequences: gradient-checkpoint inputs kept in host memory, and token-tiled MLPs (pure torch)."""

from .checkpoint import CheckpointOffloader, OffloadStats, is_recomputing, offloaded_checkpoint
from .tiled_mlp import TiledMLPForward

__all__ = ["CheckpointOffloader", "OffloadStats", "TiledMLPForward", "is_recomputing", "offloaded_checkpoint"]
