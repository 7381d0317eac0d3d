"""Memory for long sequences: checkpoint inputs in host memory, token-tiled MLPs, lean RMSNorms (pure torch);
`offload.install` puts them on a transformers model."""

from .checkpoint import CheckpointOffloader, OffloadStats, is_recomputing, offloaded_checkpoint
from .lean_norm import LeanRMSNormForward
from .tiled_mlp import TiledMLPForward

__all__ = [
    "CheckpointOffloader",
    "LeanRMSNormForward",
    "OffloadStats",
    "TiledMLPForward",
    "is_recomputing",
    "offloaded_checkpoint",
]
