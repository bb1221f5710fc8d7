"""The job's lifecycle, the step in flight's reports, and the messages and records built
from them (the job's state itself is `view.JobView`)."""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Iterable
from dataclasses import dataclass, field
from enum import StrEnum

from recover.controller.policy import PlanDecision
from recover.proto import pb


class JobState(StrEnum):
    """Lifecycle of the job.

    WAITING -> RUNNING    every expected replica reported ready (or, after a worker failed
                          during startup, at least min_replicas did: admission.py)
    WAITING -> FAILED     a worker's script failed before training started, or start timed out
    RUNNING -> SUCCEEDED  every live replica applied the final step
    RUNNING -> FAILED     no live replica left, or a commit broke the invariant
    WAITING -> STOPPED    an operator stopped it (operations.py)
    RUNNING -> STOPPED    an operator stopped it: at the step boundary after the request
    """

    WAITING = "waiting"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    STOPPED = "stopped"


TERMINAL = (JobState.SUCCEEDED, JobState.FAILED, JobState.STOPPED)


class RegistrationRefused(Exception):
    """An agent asked to join a job that cannot take it; the message says why."""


class RejoinUnexpected(RegistrationRefused):
    """An agent asked to rejoin the leader that has run the job since it started (no takeover
    waits for it): the leader lost it, and the refusal tells it to stop its workers. Said
    only by a leader that confirms it still leads (Coordinator.register_agent)."""


def sample_digest(sample_ids: Iterable[int]) -> str:
    """Ledger entry of a step: sha256 of its sorted sample ids as little-endian int64."""
    ids = sorted(sample_ids)
    return hashlib.sha256(struct.pack(f"<{len(ids)}q", *ids)).hexdigest()


def plan_message(step: int, generation: int, scale_epoch: int, decision: PlanDecision, *,
                 open_shares: bool = False, version: int = 0) -> pb.Plan:
    """`open_shares`: work-stealing may still move microbatches (pb.Plan.open)."""
    plan = pb.Plan(step=step, generation=generation, reason=decision.reason,
                   scale_epoch=scale_epoch, open=open_shares, version=version)
    add = plan.assignments.add  # in place: half the time of building each Assignment apart
    for replica, ids in decision.assignment.items():
        add(replica=replica, microbatch_ids=ids)
    return plan


def step_record(job: pb.JobConfig, step: int, generation: int, members: list[int],
                reports: list[pb.Reduced], committed_at: float, loss: float) -> pb.StepRecord:
    """The ledger entry of a step about to commit, from its members' reduction reports (in
    the order of `members`; `loss`: the one they agree on, reports.agree_on_loss)."""
    sample_ids = sorted(s for r in reports for s in r.sample_ids)
    return pb.StepRecord(
        step=step, generation=generation,
        microbatches=sum(len(r.microbatch_ids) for r in reports),
        sample_digest=sample_digest(sample_ids),
        loss=loss, committed_at=committed_at,
        tokens=sum(r.tokens for r in reports),
        compute_s=max(r.compute_s for r in reports), reduce_s=min(r.reduce_s for r in reports),
        sample_ids=sample_ids if job.record_sample_ids else [], replicas=len(reports),
        loads=[pb.ReplicaLoad(replica=m, microbatches=len(r.microbatch_ids))
               for m, r in zip(members, reports, strict=True)])


@dataclass
class StepProgress:
    """What the current, uncommitted step has gathered in the current generation."""

    reduced: dict[int, pb.Reduced] = field(default_factory=dict)
    resumed: dict[int, float] = field(default_factory=dict)


