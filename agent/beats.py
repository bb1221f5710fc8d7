"""An agent's heartbeats to its leader, sent only when nothing else was.

Any message proves the agent alive to the controller, so in a training job the reports
carry that proof and almost no beat is sent; at thousands of agents every message costs
the leader's one core (BENCHMARKS.md section 5, "Beats only where nothing else was said").
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable


def beat_in(last_sent: float, now: float, period: float) -> float:
    """Seconds until a heartbeat is due, the last message having gone at `last_sent`
    (<= 0: now). Never more than `period`, whatever the clocks say."""
    return min(last_sent + period - now, period)


async def beat_when_silent(period_s: float, last_sent: Callable[[], float],
                           beat: Callable[[], None]) -> None:
    """Call `beat` whenever `period_s` passed since `last_sent()` (monotonic), forever."""
    while True:
        wait = beat_in(last_sent(), time.monotonic(), period_s)
        if wait <= 0:
            beat()
            wait = period_s
        await asyncio.sleep(wait)
