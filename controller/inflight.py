"""The step in flight, as the controller gathers it between two commits: which members have
reduced it and what they reported, when each resumed after a rebuild, how fast each one
computes (the quota policies' input), and the work-stealing book.

The coordinator (controller/coordinator.py) hands every report of the step here and gets a
decision back: stale (fenced), a member to drop, wait, or every member reduced (commit).
Nothing here writes the store or sends a message; the coordinator carries the decisions out.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from recover.controller import reports, stealflow
from recover.controller.jobstate import JobState, StepProgress
from recover.controller.stealing import Decisions, Steal
from recover.controller.throughput import Speeds, ThroughputEstimator
from recover.controller.view import JobView
from recover.proto import pb


@dataclass(frozen=True)
class Stale:
    """A report of an older generation or step, or from a non-member: counted, not used."""


@dataclass(frozen=True)
class Drop:
    """The member reported microbatches the plan never gave it: drop it like a crash."""

    reason: str


@dataclass(frozen=True)
class Complete:
    """Every member reduced the step: commit it with these reports, in member order."""

    reported: list[pb.Reduced]


ReducedDecision = Stale | Drop | Complete | None
"""What a `Reduced` report decides (None: wait for the other members)."""


class StepInFlight:
    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        self.progress = StepProgress()
        self.throughput = ThroughputEstimator()
        """Each replica's seconds per microbatch, from its reports (quota policies use it)."""
        self._speeds: Speeds | None = None
        """The last snapshot of `throughput` (it changes only when a step commits)."""
        self.steals = stealflow.StealBook()
        """Work-stealing: what the members of the step in flight reported of their progress."""
        self._last_pace: dict[int, float] = {}
        """Each member's mean seconds per microbatch in the step that last committed: a
        quiet member's own reference for news at the next step's start (common/stealnews.py),
        so the book starts from it too."""

    def speeds(self) -> Speeds:
        """Measured seconds per microbatch of each replica measured so far (a snapshot)."""
        if self._speeds is None:
            self._speeds = self.throughput.snapshot()
        return self._speeds

    # ------------------------------------------------------------ boundaries

    def new_generation(self) -> None:
        """A generation starts: what the members reported in the last one no longer counts."""
        self.progress = StepProgress()

    def generation_started(self, view: JobView) -> None:
        """The new generation is stored: its members start stealing from their new plan."""
        self.steals.begin(view, self._clock(), self.speeds())

    def step_committed(self, next_view: JobView | None) -> None:
        """A step committed; `next_view` is the view whose plan the next step follows (None:
        no next step is planned yet)."""
        self.progress.reduced.clear()
        self.steals.begin(next_view, self._clock(), {**self.speeds(), **self._last_pace})

    def member_failed(self, replica: int) -> None:
        self.throughput.forget(replica)  # replica ids are never reused
        self._last_pace.pop(replica, None)
        self._speeds = None

    # ------------------------------------------------------------ reports

    def resumed(self, view: JobView, replica: int, msg: pb.Resumed) -> float | None:
        """When the last of the members that resumed so far did (None: a stale report)."""
        if msg.generation != view.generation or replica not in view.members:
            return None
        self.progress.resumed[replica] = msg.at
        return max(self.progress.resumed.values())

    def reduced(self, view: JobView, replica: int, msg: pb.Reduced) -> ReducedDecision:
        if (view.state is not JobState.RUNNING or msg.generation != view.generation
                or msg.step != view.step or replica not in view.members):
            return Stale()  # fencing: a report from an older generation or step must not count
        wrong = reports.unplanned_ids(replica, view.step, view.plan.get(replica, ()),
                                      msg.microbatch_ids)
        if wrong is not None:
            return Drop(f"{wrong}: dropped like a crash")
        self.progress.reduced[replica] = msg
        if not set(self.progress.reduced) >= set(view.members):
            return None
        reported = [self.progress.reduced[m] for m in view.members]
        self._measure(view.members, reported)
        return Complete(reported)

    def _measure(self, members: tuple[int, ...] | list[int], reported: list[pb.Reduced]) -> None:
        """Each member's speed in the step about to commit (its microbatches and compute time
        add up over the generations of the step, so a recovery keeps the ratio true). An
        exact-mode redo restarts the step's microbatches but not the time: left out."""
        self._last_pace = {}
        for member, report in zip(members, reported, strict=True):
            if not report.overflow and not report.scale_epoch:
                self.throughput.observe(member, len(report.microbatch_ids), report.compute_s)
                self.throughput.observe_lead(member, report.lead_s)
                if report.microbatch_ids:
                    self._last_pace[member] = report.compute_s / len(report.microbatch_ids)
        self._speeds = None

    def progress_reported(self, view: JobView, replica: int, msg: pb.Progress) -> bool:
        """Whether a member's progress may change what work-stealing decides."""
        return replica in view.members and self.steals.progress(replica, msg, self._clock())

    def released(self, replica: int, msg: pb.Released) -> Steal | None:
        """A giver's acknowledgement of a steal (None: stale)."""
        return self.steals.released(replica, msg, self._clock())

    def moves(self) -> tuple[Decisions, dict[int, tuple[int, ...]]] | None:
        """The steals (and closed shares) to announce now, with every member's share."""
        moves = self.steals.decide(self._clock())
        if not (moves.steals or moves.close):
            return None
        return moves, {m: member.share for m, member in self.steals.members.items()}
