"""What a member of an open plan tells the controller, and what its silence means.

With work-stealing on, the controller predicts when each member ends its share, to decide
who gives unstarted microbatches to whom (controller/stealing.py). A member reports its
progress only when that is *news*: it is now on its last microbatch or idle (a taker to
be, or one to close), or it strays from the pace the controller assumes by NEWS_MARGIN of a
microbatch or more. Silence means "on schedule": the controller advances a silent member
by whole microbatches at its pace, never past the start of its last (which it reports).

Reporting every microbatch cost a message through the agent per microbatch: on equal
replicas, where nothing moves, 1-5 % of a step on two shared cores (BENCHMARKS.md 10b), and
at a thousand members a controller parsing a report per microbatch. The worker decides
(trainer/stepstate.py), the controller assumes (controller/stealing.py); both read this.
"""

from __future__ import annotations

NEWS_MARGIN = 0.25
"""A member speaks up once it is this fraction of a microbatch ahead of or behind what the
controller assumes (the controller's own margin for moving a microbatch: less would change
no decision)."""


def worth_reporting(*, left: int, elapsed_s: float, done_since: int, pace_s: float) -> bool:
    """After a microbatch: is it news? `left`: microbatches of the share not yet done;
    `elapsed_s`: since the controller last heard (a report, or the step's start);
    `done_since`: microbatches done since then; `pace_s`: the seconds per microbatch the
    controller assumes (0: it assumes nothing yet)."""
    if left <= 1 or pace_s <= 0:
        return True
    return abs(elapsed_s - done_since * pace_s) >= NEWS_MARGIN * pace_s


def assumed_done(*, left: int, elapsed_s: float, pace_s: float) -> int:
    """How many microbatches a silent member is assumed to have done since it was last
    heard of, `left` of its share then not done: on schedule, but never past the start of
    its last, which it would have reported."""
    if left <= 2 or pace_s <= 0 or elapsed_s < pace_s:
        return 0
    return min(int(elapsed_s // pace_s), left - 2)
