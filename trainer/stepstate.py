"""What a worker holds of the step in progress, and how the job's end reaches the loop."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from recover.common.stealnews import worth_reporting
from recover.proto import pb
from recover.trainer.reduction import Reduced

ORPHAN_WAIT_S = 60.0
"""How long a worker whose group failed waits for a new generation before giving up."""


class TrainingEnded(Exception):
    """The controller ended the job (shutdown)."""

    def __init__(self, shutdown: pb.Shutdown) -> None:
        super().__init__(shutdown.reason)
        self.shutdown = shutdown


@dataclass
class StepState:
    """What this worker holds of the current, uncommitted step."""

    step: int
    planned: bool = False
    """A plan of this step arrived (after a commit without one, a new generation brings it)."""
    assigned: list[int] = field(default_factory=list)
    """My microbatches in the latest plan of this step (a superset of `done`)."""
    original: set[int] = field(default_factory=set)
    """My microbatches in the step's first plan: the rest were reassigned to me."""
    done: list[int] = field(default_factory=list)
    """Microbatches already accumulated into the parameters' .grad, in order."""
    sample_ids: list[int] = field(default_factory=list)
    tokens: int = 0
    scale_epoch: int = 0
    """Exact reduction: the fixed-point scale the accumulation was made at."""
    reduced: Reduced | None = None
    """The reduced gradient (a copy) awaiting the commit."""
    compute_s: float = 0.0
    committed_at: float | None = None
    """When the commit of the step before was handled (perf_counter), if this step followed it."""
    lead_s: float = 0.0
    """From `committed_at` to this step's first work (0: not measured): pb.Reduced.lead_s."""
    open: bool = False
    """Work-stealing: the share may still change; reduce only once the controller closes it."""
    idle_reported: bool = False
    """Work-stealing: every microbatch of the share is done and the controller knows it;
    waiting for more, or for the share to close."""
    heard_at: float | None = None
    """Work-stealing: when the controller last heard of this step's progress (perf_counter:
    a report, the commit that began the step); None: it assumes nothing of this member
    (a new generation or a join), so the next microbatch is reported."""
    heard_done: int = 0
    """How many microbatches were done then."""
    pace_s: float = 0.0
    """The seconds per microbatch the controller assumes of this member: the last reported
    microbatch's time; at a step's start, this member's mean of the step before (the
    controller has it from the member's reduction report); 0: unknown."""

    def heard(self, at: float, pace_s: float = 0.0) -> None:
        """The controller now knows this step's progress as of `at` (and this pace, if > 0)."""
        self.heard_at, self.heard_done = at, len(self.done)
        if pace_s > 0:
            self.pace_s = pace_s

    def is_news(self, now: float) -> bool:
        """After a microbatch of an open share: must the controller hear of it?"""
        if self.heard_at is None:
            return True
        return worth_reporting(left=len(self.assigned) - len(self.done),
                               elapsed_s=now - self.heard_at,
                               done_since=len(self.done) - self.heard_done, pace_s=self.pace_s)

    def adopt_share(self, microbatch_ids: list[int], still_open: bool) -> bool:
        """Work-stealing: the share of this step is now `microbatch_ids` (more, stolen for
        this member, or the same closed); True when it grew. A share that drops a
        microbatch already accumulated is a protocol error."""
        missing = [mb for mb in self.done if mb not in microbatch_ids]
        if missing:
            raise RuntimeError(f"a share update of step {self.step} drops microbatches "
                               f"{missing} this worker already accumulated")
        grown = any(mb not in self.assigned for mb in microbatch_ids)
        if grown and len(self.done) >= len(self.assigned):
            self.heard(time.perf_counter())  # the controller counts an idle taker's time anew
        self.assigned = self.done + [mb for mb in microbatch_ids if mb not in self.done]
        self.open, self.idle_reported = still_open, False
        return grown

    def release_unstarted(self, asked: list[int]) -> list[int]:
        """Work-stealing: give back those of `asked` not started (commands are handled
        between microbatches, so every one not done is not started); what is given back
        is exactly what this worker will never compute."""
        unstarted = set(self.assigned[len(self.done):])
        released = [mb for mb in asked if mb in unstarted]
        self.assigned = [mb for mb in self.assigned if mb not in released]
        return released
