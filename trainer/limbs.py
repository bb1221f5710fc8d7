"""Integers summed exactly by a float32 reduction: each split into small signed limbs.

Why: in fast mode a model's integer buffers (BatchNorm's `num_batches_tracked`) are summed
as float64 integers, exact to 2**53, while its gradients are float32: two dtypes, so two
allreduces a step, and on a small model the second one cost ~10 % of the step (BENCHMARKS.md
section 15). So each integer rides in the float32 buffer as `LIMBS` balanced digits of base
64 (each in [-32, 31]); a float32 sum of W such digits is an integer of magnitude at most
32 * W, exact while that stays below 2**24, so for up to `MAX_SUMMANDS` summands (replicas)
the digits' sums, put back together in int64, are the exact sum, whatever the order of the
reduction. A generation has at most `--replicas` plus `--spares` members, each at most
65,536 (client/jobsettings.py): far below the bound.

The digits of all values come out of one shift-and-mask of the value plus a bias whose
base-64 digits are all 32 (no carry to propagate, so no loop over digits: at a BatchNorm
model's few counters a digit-by-digit loop cost more than the rest of the buffers' work).
"""

from __future__ import annotations

import torch

BASE_BITS = 6
LIMBS = 10
"""10 balanced digits of base 64 cover every integer a float64 holds exactly (|x| < 2**53)
with the bias added (below 2**60)."""
MAX_SUMMANDS = (1 << 24) // (1 << (BASE_BITS - 1))
"""A float32 sum of this many digits (|digit| <= 32) stays exact (524,288)."""
_HALF = 1 << (BASE_BITS - 1)
_BIAS = sum(_HALF << (BASE_BITS * k) for k in range(LIMBS))
"""Every base-64 digit 32: v + _BIAS has digit k equal to v's balanced digit k plus 32."""
_MASK = (1 << BASE_BITS) - 1


_SHIFTS: dict[torch.device, torch.Tensor] = {}
_WEIGHTS: dict[torch.device, torch.Tensor] = {}


def _shifts(device: torch.device) -> torch.Tensor:
    """Digit k's bit offset, as a column (made once per device: this runs every step)."""
    if device not in _SHIFTS:
        _SHIFTS[device] = torch.arange(LIMBS, dtype=torch.int64, device=device).mul_(
            BASE_BITS).unsqueeze(1)
    return _SHIFTS[device]


def _weights(device: torch.device) -> torch.Tensor:
    """Digit k's place value, 64**k, as a column."""
    if device not in _WEIGHTS:
        _WEIGHTS[device] = torch.ones(LIMBS, 1, dtype=torch.int64, device=device) << _shifts(device)
    return _WEIGHTS[device]


SMALL = 64
"""Up to this many values (a BatchNorm model's counters) digits are made in Python: three
torch ops instead of nine, and each op right after a backward costs ~5 us; the same digits."""


def split(values: torch.Tensor, out: torch.Tensor) -> None:
    """Write the digits of `values` (float64 holding integers below 2**53 in magnitude) into
    `out` (float32, LIMBS * values.numel(), digit k of every value before digit k+1's)."""
    if values.numel() <= SMALL:
        flat = values if values.dim() == 1 else values.reshape(-1)
        biased = [int(v) + _BIAS for v in flat.tolist()]
        out.copy_(torch.tensor([((b >> (BASE_BITS * k)) & _MASK) - _HALF
                                for k in range(LIMBS) for b in biased], dtype=out.dtype))
        return
    biased = values.reshape(-1).to(torch.int64) + _BIAS  # exact: integers below 2**60
    digits = ((biased.unsqueeze(0) >> _shifts(values.device)) & _MASK) - _HALF
    out.copy_(digits.reshape(-1))


def join(digits: torch.Tensor, n: int) -> torch.Tensor:
    """The integers (as float64) whose digit sums `digits` holds: the inverse of `split`,
    and of a sum of `split`s, exact for sums of up to MAX_SUMMANDS values (int64 arithmetic
    wraps modulo 2**64 on the way, and the exact sum fits)."""
    if n <= SMALL:  # Python's integers: exact, no wrapping needed
        sums = [int(d) for d in digits[:LIMBS * n].tolist()]
        return torch.tensor([sum(sums[k * n + i] << (BASE_BITS * k) for k in range(LIMBS))
                             for i in range(n)], dtype=torch.float64, device=digits.device)
    total = (digits[:LIMBS * n].reshape(LIMBS, n).to(torch.int64) * _weights(digits.device)).sum(0)
    return total.to(torch.float64)
