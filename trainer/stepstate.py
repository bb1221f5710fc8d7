"""What a worker holds of the step in progress, and how the job's end reaches the loop."""

from __future__ import annotations

from dataclasses import dataclass, field

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
    open: bool = False
    """Work-stealing: the share may still change; reduce only once the controller closes it."""
    idle_reported: bool = False
    """Work-stealing: every microbatch of the share is done and the controller knows it;
    waiting for more, or for the share to close."""
