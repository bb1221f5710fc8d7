"""bench/scripts/stealing_step.py drives the real StealBook through simulated steps: its
members must compute every microbatch exactly once (asserted inside the simulation), the
slow ones must be relieved, and the coordinator's way of deciding (on news, folded) must
decide far less often than at every report without balancing the step worse."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench" / "scripts"))
from stealing_step import one_step  # noqa: E402


@pytest.mark.parametrize("slow_after", [0, 2])
def test_decisions_on_news_balance_a_step_as_well_with_fewer_calls(slow_after: int) -> None:
    every = one_step(64, 8, seed=1, latency_s=0.005, every_report=True, slow_after=slow_after)
    news = one_step(64, 8, seed=1, latency_s=0.005, every_report=False, slow_after=slow_after)
    for step in (every, news):
        assert step.steals >= 4  # the 8 slow members (one in eight) gave microbatches away
        assert step.makespan / step.ideal < 1.3
    assert every.calls >= 64 * 8 > news.calls * 2  # every report, vs news only
    assert news.makespan <= every.makespan * 1.02
