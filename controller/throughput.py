"""How fast each replica computes a microbatch, from what the workers report.

The controller plans quotas in proportion to throughput (`quotas.py`, `policy.py`'s
`ProportionalPolicy`); this module turns the workers' reports into the per-replica seconds
per microbatch those plans need. It holds no clock and does no I/O: the caller feeds it
observations (replica, microbatches computed, compute seconds), one per member per
committed step, and takes a frozen `Speeds` snapshot to hand to a policy, which therefore
stays a pure function of its arguments.

Smoothing: the median of each replica's last `window` observations (default 5), not an
EWMA. Why:

- Outliers are one-sided and isolated: a first step on cold caches, a checkpoint, a GC
  pause, a noisy neighbour for one step. The median of 5 ignores up to 2 of them
  outright, with no tuning knob; an EWMA lets every one of them through, damped.
- A *real* change (thermal throttling, a GPU clocked down) must be followed quickly
  and fully: the median of 5 moves to the new speed after 3 observations, whatever the
  factor. An EWMA that clips samples above 3x its estimate (the usual outlier guard)
  would treat a genuine 4x slowdown as noise and converge to it only slowly.
- It is exactly reproducible (no floating-point recurrence) and its value is always
  one actually observed, which makes plans and their reasons easy to check.

With an even number of observations (the first steps after a join) the *lower* of the
two middle values is taken: the outlier to expect then is the cold first step, which
is always slow, never fast.

Each replica's *lead* is smoothed the same way: the time from handling a commit to
starting the next step's first microbatch (`pb.Reduced.lead_s`). A replica that runs
an evaluation or writes a checkpoint after every commit starts its share that much later
than the others, and a plan that ignores it hands that replica *more* microbatches: its
microbatches run while the others, done with theirs, leave it the cores (measured: 5-7
of 16 to the replica evaluating, against 3-4 each to the others).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field

DEFAULT_WINDOW = 5
"""Observations kept per replica: 2 outliers in 5 are ignored, a real change shows after 3."""


def low_median(values: Iterable[float]) -> float | None:
    """The median of `values`, the lower middle one when their number is even; None if empty.

    Always one of the values themselves (never an average of two), so an estimate is a
    time that was actually measured.
    """
    ordered = sorted(values)
    if not ordered:
        return None
    return ordered[(len(ordered) - 1) // 2]


def _checked(pairs: tuple[tuple[int, float], ...], what: str,
             zero_ok: bool) -> dict[int, float]:
    """`pairs` as replica -> seconds, each finite and > 0 (>= 0 when `zero_ok`), each
    replica once; else ValueError naming the replica and `what` the seconds are."""
    checked: dict[int, float] = {}
    for replica, value in pairs:
        seconds = float(value)
        if not math.isfinite(seconds) or seconds < 0 or (seconds == 0 and not zero_ok):
            raise ValueError(f"replica {replica}: {what} must be finite and "
                             f"{'>=' if zero_ok else '>'} 0, got {seconds}")
        checked[int(replica)] = seconds
    if len(checked) != len(pairs):
        raise ValueError(f"a replica appears twice in {pairs}")
    return checked


@dataclass(frozen=True)
class Speeds(Mapping[int, float]):
    """A frozen snapshot: replica id -> measured seconds per microbatch (measured ones only).

    What a policy is handed, so that a plan is a pure function of (members, M, speeds).
    A member absent from it has not been measured yet; `seconds_for` fills it in with
    the median of the measured ones (a replica that just joined or was just promoted is
    planned like a typical one until its own reports arrive).
    """

    pairs: tuple[tuple[int, float], ...] = ()
    """(replica, seconds per microbatch), by replica id."""
    leads: tuple[tuple[int, float], ...] = ()
    """(replica, seconds from a commit to its next first microbatch), measured ones only."""
    _by_replica: dict[int, float] = field(init=False, repr=False, compare=False, hash=False)
    _leads: dict[int, float] = field(init=False, repr=False, compare=False, hash=False)

    def __post_init__(self) -> None:
        checked = _checked(self.pairs, "seconds per microbatch", zero_ok=False)
        leads = _checked(self.leads, "a lead", zero_ok=True)
        object.__setattr__(self, "pairs", tuple(sorted(checked.items())))
        object.__setattr__(self, "_by_replica", checked)
        object.__setattr__(self, "leads", tuple(sorted(leads.items())))
        object.__setattr__(self, "_leads", leads)

    @classmethod
    def of(cls, seconds_per_mb: Mapping[int, float],
           leads: Mapping[int, float] | None = None) -> Speeds:
        """A snapshot from plain mappings (tests, callers that measure elsewhere)."""
        return cls(tuple(seconds_per_mb.items()), tuple((leads or {}).items()))

    def __getitem__(self, replica: int) -> float:
        return self._by_replica[replica]

    def __iter__(self) -> Iterator[int]:
        return (r for r, _ in self.pairs)

    def __len__(self) -> int:
        return len(self.pairs)

    def median(self) -> float | None:
        """The typical replica's seconds per microbatch (`low_median`); None if nobody is measured."""
        return low_median(self._by_replica.values())

    def seconds_for(self, members: Iterable[int]) -> dict[int, float] | None:
        """Seconds per microbatch for each of `members`, in their order, the unmeasured ones
        at the median of the measured *members* (of all measured replicas when no member
        is); None when nobody at all is measured (then only a uniform plan makes sense)."""
        members = list(members)
        typical = low_median(self._by_replica[m] for m in members if m in self._by_replica)
        if typical is None:
            typical = self.median()
        if typical is None:
            return None
        return {m: self._by_replica.get(m, typical) for m in members}

    def lead_for(self, members: Iterable[int]) -> dict[int, float]:
        """Each member's lead (seconds from a commit to its first microbatch), the unmeasured
        ones at the median of the measured members'; all 0 when no member's is measured
        (then plans are what they were without leads)."""
        members = list(members)
        typical = low_median(self._leads[m] for m in members if m in self._leads) or 0.0
        return {m: self._leads.get(m, typical) for m in members}


class ThroughputEstimator:
    """Per-replica seconds per microbatch: the median of the last `window` observations.

    Mutable, owned by the controller's driver; policies only ever see `snapshot()`.
    Deterministic: the same observations in the same order give the same estimates.
    """

    def __init__(self, window: int = DEFAULT_WINDOW) -> None:
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        self.window = window
        self._samples: dict[int, deque[float]] = {}
        self._lead_samples: dict[int, deque[float]] = {}

    def observe(self, replica: int, microbatches: int, compute_s: float) -> bool:
        """Record that `replica` computed `microbatches` in `compute_s` seconds of compute.

        Returns whether it counted. An observation without microbatches measures nothing
        (an idle member still takes part in the allreduce), and one with no positive,
        finite time is a worker that did not time its compute: both are ignored rather
        than raised, because they come straight from reports and must not stop a job.
        """
        if microbatches <= 0 or not math.isfinite(compute_s) or compute_s <= 0:
            return False
        samples = self._samples.setdefault(replica, deque(maxlen=self.window))
        samples.append(compute_s / microbatches)
        return True

    def observe_lead(self, replica: int, lead_s: float) -> bool:
        """Record a replica's lead in a step (`pb.Reduced.lead_s`); whether it counted (0,
        not measured, and anything not positive and finite are ignored, as in `observe`)."""
        if not math.isfinite(lead_s) or lead_s <= 0:
            return False
        self._lead_samples.setdefault(replica, deque(maxlen=self.window)).append(lead_s)
        return True

    def measured(self, replica: int) -> bool:
        return replica in self._samples

    def own_estimate(self, replica: int) -> float | None:
        """The replica's own smoothed seconds per microbatch; None if it was never measured."""
        samples = self._samples.get(replica)
        return None if samples is None else low_median(samples)

    def estimate(self, replica: int) -> float | None:
        """Seconds per microbatch: the replica's own, else the median of the measured
        replicas' estimates, else None (nobody is measured)."""
        own = self.own_estimate(replica)
        if own is not None:
            return own
        return low_median(self._own_estimates().values())

    def forget(self, replica: int) -> None:
        """Drop a replica's observations (it was lost: a replica id is never reused)."""
        self._samples.pop(replica, None)
        self._lead_samples.pop(replica, None)

    def snapshot(self, replicas: Iterable[int] | None = None) -> Speeds:
        """The measured estimates, of `replicas` only when given, as a frozen `Speeds`.

        Unmeasured replicas are left out rather than filled in here, so that a policy can
        tell (and say in its reason) which quotas rest on an assumption.
        """
        estimates = self._own_estimates()
        # Copies: the metrics' thread takes snapshots while the control loop observes.
        leads = {r: lead for r, samples in list(self._lead_samples.items())
                 if (lead := low_median(list(samples))) is not None}
        if replicas is not None:
            wanted = set(replicas)
            estimates = {r: s for r, s in estimates.items() if r in wanted}
            leads = {r: lead for r, lead in leads.items() if r in wanted}
        return Speeds.of(estimates, leads)

    def _own_estimates(self) -> dict[int, float]:
        return {r: s for r, samples in list(self._samples.items())
                if (s := low_median(list(samples))) is not None}
