"""Triton kernels (Triton is Linux-only: importing this package raises ImportError without it)."""

from .logprob import tile_grad_coefficients, tile_logprob_stats

__all__ = ["tile_grad_coefficients", "tile_logprob_stats"]
