"""Comparing floats that two computation paths produced: equal up to rounding.

Bitwise equality (``torch.equal``) is the right assertion only where the same code runs
twice on the same machine: a resume against an uninterrupted run, ranks against each
other, a rerun with the same seed, a copy or a cast. Two different paths (an in-place,
preallocated buffer against a fresh tensor, a batched kernel against a loop), or a fixture
written on another CPU, may differ in the last bits: the BLAS kernel MKL picks depends on
the instruction set and on memory alignment, and the order of a reduction with it.

Tests that compare across paths are marked ``numerics``; ``.ci/run`` runs them a second
time under ``MKL_CBWR=COMPATIBLE`` (another kernel choice) to check that the tolerance
holds.
"""

from __future__ import annotations

import torch

#: Units of rounding allowed per term of the reduction behind a value.
ULPS = 4


def rounding_tolerance(dtype: torch.dtype, terms: int, ulps: int = ULPS) -> float:
    """The relative error that ``terms`` rounded operations of ``ulps`` units each may
    add up to in ``dtype`` (``ulps * terms * eps``)."""
    return ulps * terms * torch.finfo(dtype).eps


def assert_equal_up_to_rounding(
    actual: torch.Tensor, expected: torch.Tensor, *, terms: int, ulps: int = ULPS, msg=None
) -> None:
    """``actual`` equals ``expected`` (dtype and shape too) within
    :func:`rounding_tolerance` relative to each value, or to the largest magnitude of
    ``expected`` for values near zero (a difference of rounding scales with the operands,
    not with the result)."""
    tol = rounding_tolerance(expected.dtype, terms, ulps)
    scale = expected.abs().max().item() if expected.numel() else 0.0
    torch.testing.assert_close(actual, expected, rtol=tol, atol=tol * max(scale, 1e-30), msg=msg)
