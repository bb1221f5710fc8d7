"""Integers summed exactly by a float32 reduction: each split into small signed limbs.

Why: in fast mode a model's integer buffers (BatchNorm's `num_batches_tracked`) are summed
as float64 integers, exact to 2**53, while its gradients are float32: two dtypes, so two
allreduces a step, and on a small model the second one cost ~10 % of the step (BENCHMARKS.md
section 15). Split into base-128 digits in [-64, 64], each integer rides in the float32
buffer as `LIMBS` digits in base 64 (each in [-32, 32]); a float32 sum of W such digits is an
integer of magnitude at most 32 * W, exact while that stays below 2**24, so for up to
`MAX_SUMMANDS` summands (replicas) the digits' sums, put back together in int64, are the
exact sum, whatever the order of the reduction. A generation has at most `--replicas` plus
`--spares` members, each at most 65,536 (client/jobsettings.py): far below the bound.
"""

from __future__ import annotations

import torch

BASE_BITS = 6
LIMBS = 9
"""9 balanced digits of base 64 cover every integer a float64 holds exactly (|x| < 2**53)."""
MAX_SUMMANDS = (1 << 24) // (1 << (BASE_BITS - 1))
"""A float32 sum of this many digits (|digit| <= 32) stays exact (524,288)."""


def split(values: torch.Tensor, out: torch.Tensor) -> None:
    """Write the digits of `values` (float64 holding integers below 2**53 in magnitude) into
    `out` (float32, LIMBS * values.numel(), digit k of every value before digit k+1's)."""
    n = values.numel()
    rest = values.to(torch.float64).reshape(-1).clone()
    for k in range(LIMBS):
        # rest / 64 is exact (a power of two); round half to even keeps each digit in
        # [-32, 32] and the quotient an integer.
        quotient = torch.round(rest / (1 << BASE_BITS))
        out[k * n:(k + 1) * n].copy_(rest - quotient * (1 << BASE_BITS))
        rest = quotient


def join(digits: torch.Tensor, n: int) -> torch.Tensor:
    """The integers (as float64) whose digit sums `digits` holds: the inverse of `split`,
    and of a sum of `split`s, exact for sums of up to MAX_SUMMANDS values."""
    total = torch.zeros(n, dtype=torch.int64, device=digits.device)
    for k in reversed(range(LIMBS)):
        total = total * (1 << BASE_BITS) + digits[k * n:(k + 1) * n].to(torch.int64)
    return total.to(torch.float64)
