"""trainer/limbs.py: integers carried through a float32 sum as exact digits."""

from __future__ import annotations

import random

import pytest
import torch

from recover.client.jobsettings import MAX_REPLICAS
from recover.trainer.limbs import LIMBS, MAX_SUMMANDS, join, split

EXTREMES = [0, 1, -1, 31, 32, -32, 33, 63, 64, -65, 2**52, -(2**52), 2**53 - 1, -(2**53 - 1),
            12_345_678_901_234, -987_654_321]


def digits_of(values: list[int]) -> torch.Tensor:
    out = torch.empty(LIMBS * len(values), dtype=torch.float32)
    split(torch.tensor(values, dtype=torch.float64), out)
    return out


def test_every_integer_a_float64_holds_comes_back_from_its_digits() -> None:
    digits = digits_of(EXTREMES)
    assert digits.abs().max() <= 32  # what keeps a sum of many of them exact in float32
    assert torch.equal(join(digits, len(EXTREMES)), torch.tensor(EXTREMES, dtype=torch.float64))


@pytest.mark.parametrize("summands", [2, 1000, 4096])
def test_a_float32_sum_of_digits_is_the_exact_sum_in_any_order(summands: int) -> None:
    rng = random.Random(summands)
    values = [[rng.randint(-2**44, 2**44) for _ in range(6)] for _ in range(summands)]
    exact = [sum(column) for column in zip(*values, strict=True)]
    parts = [digits_of(v) for v in values]
    for order in (parts, parts[::-1], rng.sample(parts, len(parts))):
        total = torch.zeros(LIMBS * 6, dtype=torch.float32)
        for part in order:
            total += part
        assert join(total, 6).to(torch.int64).tolist() == exact


def test_the_worst_case_sum_stays_exact_up_to_the_bound() -> None:
    # Every summand's digits at their extreme (-32 or 32): the sum of MAX_SUMMANDS of them
    # is 2**24 in magnitude, the last value float32 holds exactly.
    worst = torch.full((LIMBS,), 32.0)
    assert float(worst[0] * MAX_SUMMANDS) == 2**24
    assert torch.equal(torch.tensor(2**24, dtype=torch.float32) - 1 + 1,
                       torch.tensor(2**24, dtype=torch.float32))


def test_a_generation_never_has_more_members_than_the_digits_allow() -> None:
    # Members are at most --replicas plus --spares, each bounded by the job's settings.
    assert 2 * MAX_REPLICAS <= MAX_SUMMANDS


@pytest.mark.parametrize("count", [1, 16, 64, 65, 300])
def test_the_python_and_the_tensor_digits_are_the_same(count: int,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    # A few counters (a BatchNorm model's) take the Python path, many the tensor one: same
    # digits and same sums, the extremes included.
    from recover.trainer import limbs

    rng = random.Random(count)
    values = (EXTREMES + [rng.randint(-(2**53) + 1, 2**53 - 1) for _ in range(count)])[:count]
    made = {}
    for small in (0, 10_000):
        monkeypatch.setattr(limbs, "SMALL", small)
        digits = digits_of(values)
        total = digits + digits_of(values[::-1])
        made[small] = (digits, join(digits, count), join(total, count))
    assert all(torch.equal(a, b) for a, b in zip(made[0], made[10_000], strict=True))
    assert made[0][1].tolist() == [float(v) for v in values]
