"""Should a slot whose worker died get a new one, and when? A pure, table-tested decision.

A worker that dies (a crash, a kill, the hang watchdog) leaves its slot idle;
the agent asks the controller for a new replica on it, which then joins the
running job with live state transfer. Restarts back off exponentially, so a
slot that keeps failing (a bad GPU) does not churn the job, and stop after
`max_restarts` per slot within `--restart-window`: a slot that then stays
healthy for a whole window starts afresh (as a Kubernetes pod's back-off
resets), so a weeks-long job does not run out of restarts one rare crash at a
time. A worker that failed the workload's contract would fail the same way
again: its slot is not restarted.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

BASE_DELAY_S = 0.5
"""Delay before a slot's first restart; each further one doubles it."""
MAX_DELAY_S = 30.0
RESTART_WINDOW_S = 1800.0
"""Default --restart-window: restarts older than this no longer count against a slot."""


@dataclass(frozen=True)
class RestartDecision:
    restart: bool
    delay_s: float
    reason: str


def recent_restarts(times: Sequence[float], now: float, window_s: float) -> int:
    """How many of a slot's restarts (at `times`) still count at `now`."""
    return sum(1 for t in times if now - t < window_s)


def decide_restart(slot: int, restarts: int, max_restarts: int, *, job_over: bool,
                   deterministic_error: bool, window_s: float = RESTART_WINDOW_S
                   ) -> RestartDecision:
    """`restarts`: how many times this slot was restarted within the last `window_s`."""
    if job_over:
        return RestartDecision(False, 0.0, "the job is over")
    if deterministic_error:
        return RestartDecision(False, 0.0, f"slot {slot}: the worker broke the workload's "
                                           "contract; a new one would do the same")
    if restarts >= max_restarts:
        return RestartDecision(False, 0.0, f"slot {slot}: restarted {restarts} times in the last "
                                           f"{window_s:.0f}s already (--max-restarts "
                                           f"{max_restarts}, --restart-window {window_s:.0f})")
    delay = min(BASE_DELAY_S * 2 ** restarts, MAX_DELAY_S)
    return RestartDecision(True, delay, f"slot {slot}: restart {restarts + 1} of {max_restarts} "
                                        f"in {delay:.1f}s")
