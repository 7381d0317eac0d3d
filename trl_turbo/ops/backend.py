"""Which implementation of an op's per-tile steps runs: the Triton kernels or the torch path.

Design decision: one rule for every op. Triton runs on CUDA tensors, and on CPU tensors only when Triton's
interpreter was switched on before the kernels were imported (`TRITON_INTERPRET=1`, the CPU test suite); the torch
path runs everywhere else (and where Triton is not installed). Tests force either with `force`, and a forced Triton
that cannot run is an error, never a silent fallback.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from types import ModuleType

import torch


class TritonOrTorch:
    """The backend choice of one op, whose kernels module is `kernels` (None: Triton is not installed)."""

    def __init__(self, kernels: ModuleType | None) -> None:
        self.kernels = kernels
        self._forced: str | None = None

    def usable(self, device: torch.device) -> bool:
        if self.kernels is None:
            return False
        return device.type == "cuda" or (device.type == "cpu" and self.kernels.INTERPRETED)

    def use_triton(self, device: torch.device) -> bool:
        if self._forced == "torch":
            return False
        if self._forced == "triton" and not self.usable(device):
            raise RuntimeError(
                f"Triton backend forced but unusable on {device.type} (CPU needs TRITON_INTERPRET=1 before import)"
            )
        return self.usable(device)

    @contextlib.contextmanager
    def force(self, name: str) -> Iterator[None]:
        """Run with `"triton"` or `"torch"` regardless of device (tests)."""
        if name not in ("triton", "torch"):
            raise ValueError(f"unknown backend {name!r}")
        previous, self._forced = self._forced, name
        try:
            yield
        finally:
            self._forced = previous
