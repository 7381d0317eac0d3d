"""The low-precision tolerance rule of every kernel test, after flash-attention's: against an exact (fp64 or fp32)
reference, a result computed in bf16/fp16 may be off by at most twice what the naive low-precision torch computation
of the same inputs is off by, plus a tiny floor. One function, so the rule cannot drift between test files."""

from __future__ import annotations

import torch


def max_error(value: torch.Tensor, exact: torch.Tensor) -> float:
    """Largest absolute difference, computed in fp64."""
    return (value.double() - exact.double()).abs().max().item()


def assert_within_naive_error(result: torch.Tensor, naive: torch.Tensor, exact: torch.Tensor, *,
                              floor: float = 1e-6, what: str = "") -> None:
    """|result - exact| <= 2 * |naive - exact| + floor, elementwise maxima."""
    error, naive_error = max_error(result, exact), max_error(naive, exact)
    assert error <= 2 * naive_error + floor, f"{what}: error {error:.3g} > 2 x naive error {naive_error:.3g} + {floor}"
