"""What a transition asks the coordinator to do, in order: store writes, messages, events.

Each effect is complete when a transition records it (targets, steps, generations are
resolved then), so the driver carries it out without looking at the view again. Store
writes come before the messages that depend on them in the list, which is what makes
"durable before anyone acts on it" hold (coordinator.py carries them out in order).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from recover.proto import pb


@dataclass(frozen=True)
class Send:
    agent_id: str
    message: pb.ControllerMessage


@dataclass(frozen=True)
class Broadcast:
    """One message to several agents (a new generation's view, a commit), in this order: one
    effect, not one `Send` each, since at 12,500 agents making and carrying out 12,500 effects
    took a third of a loss's transition (BENCHMARKS.md 5)."""

    agent_ids: tuple[str, ...]
    message: pb.ControllerMessage


@dataclass(frozen=True)
class Emit:
    """An event for `recover events`, the log and the store."""

    kind: str
    message: str
    step: int = -1
    generation: int = -1
    replica: int = -1
    level: int = logging.INFO
    pid: int = 0
    """The OS process the event is about (a worker's), 0: none."""


@dataclass(frozen=True)
class RecordFailure:
    """A replica failed. `phase` empty: the phase the controller observed (from the reports
    of the step in flight, which the coordinator keeps)."""

    replica: int
    cause: str
    exited: pb.WorkerExited | None
    step: int
    generation: int
    phase: str
    started: bool
    """The job had started when it failed (else the phase is "startup")."""
    during_training: bool
    """It opens (or joins) a recovery."""


@dataclass(frozen=True)
class SaveAgent:
    """Before the agent learns its replicas: a new leader must know who hosts them."""

    job: pb.JobConfig
    record: pb.AgentRecord


@dataclass(frozen=True)
class SaveJob:
    job: pb.JobConfig


@dataclass(frozen=True)
class SaveWorkload:
    workload: pb.WorkloadInfo


@dataclass(frozen=True)
class StartGeneration:
    """Store a new generation (with the events and failures that led to it) before it is
    broadcast; the reports of the step in flight start over."""

    view: pb.GenerationView


@dataclass(frozen=True)
class CommitStep:
    """Store a step's record and the plan the workers hold next, before the commit goes
    out; then the record joins the ledger."""

    record: pb.StepRecord
    next_plan: pb.Plan | None


@dataclass(frozen=True)
class SavePlan:
    """Work-stealing changed the plan of the step in flight: stored before the taker hears."""

    plan: pb.Plan


@dataclass(frozen=True)
class SaveLastStep:
    """The last record again, with every member's parameter digest."""


@dataclass(frozen=True)
class End:
    """Store the result, tell `agents`, flush the events, and let the controller exit."""

    result: pb.Shutdown
    agents: tuple[str, ...]


@dataclass(frozen=True)
class Stale:
    """A report from an older generation, step or attempt: counted, ignored."""


@dataclass(frozen=True)
class Transferred:
    """A joiner's snapshot arrived: its size and time, for metrics and the summary."""

    nbytes: int
    seconds: float


Effect = (Send | Broadcast | Emit | RecordFailure | SaveAgent | SaveJob | SaveWorkload | StartGeneration
          | CommitStep | SaveLastStep | End | Stale | Transferred)
