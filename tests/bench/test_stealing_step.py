"""bench/scripts/stealing_step.py drives the real StealBook through simulated steps: its
members must compute every microbatch exactly once (asserted inside the simulation), the
slow ones must be relieved, and the way members report and the coordinator decides now
(members report news only, decided on news, folded) must send and decide far less often
than at every microbatch without balancing the step worse."""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench" / "scripts"))
from stealing_step import one_step  # noqa: E402


@pytest.mark.parametrize("slow_after", [0, 2])
def test_decisions_on_news_balance_a_step_as_well_with_fewer_calls(slow_after: int) -> None:
    # "every": members report every microbatch and each report is decided on (as first
    # built); "news": members report news only and the coordinator decides on news, folded.
    ways = {way: [one_step(64, 8, seed=seed, latency_s=0.005, every_report=way == "every",
                           slow_after=slow_after, every_microbatch=way == "every")
                  for seed in range(6)] for way in ("every", "news")}
    for step in ways["every"] + ways["news"]:
        assert step.steals >= 4  # the 8 slow members (one in eight) gave microbatches away
        assert step.makespan / step.ideal < 1.3
    every, news = ways["every"][0], ways["news"][0]
    assert every.calls >= every.reports >= 64 * 8 > news.calls * 2
    assert news.reports * 2 < every.reports  # members report only news
    # Whole microbatches make single steps jump by a microbatch either way (BENCHMARKS 10c).
    balance = {way: statistics.median(s.makespan / s.ideal for s in steps)
               for way, steps in ways.items()}
    assert balance["news"] <= balance["every"] * 1.02
