"""The job's state as the coordinator keeps it: lifecycle, agents, replicas, the step in flight."""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Iterable
from dataclasses import dataclass, field
from enum import StrEnum

from recover.proto import pb


class JobState(StrEnum):
    """Lifecycle of the job.

    WAITING -> RUNNING    every expected replica attached and reported ready
    WAITING -> FAILED     a worker exited before training started, or start timed out
    RUNNING -> SUCCEEDED  every live replica applied the final step
    RUNNING -> FAILED     no live replica left, or a commit broke the invariant
    """

    WAITING = "waiting"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"


TERMINAL = (JobState.SUCCEEDED, JobState.FAILED)


class RegistrationRefused(Exception):
    """An agent asked to join a job that cannot take it; the message says why."""


@dataclass
class ReplicaInfo:
    replica_id: int
    agent_id: str
    ready: bool = False
    alive: bool = True
    pid: int = 0


@dataclass
class AgentInfo:
    agent_id: str
    host: str
    replicas: list[int]
    last_heartbeat: float
    alive: bool = True


def sample_digest(sample_ids: Iterable[int]) -> str:
    """Ledger entry of a step: sha256 of its sorted sample ids as little-endian int64."""
    ids = sorted(sample_ids)
    return hashlib.sha256(struct.pack(f"<{len(ids)}q", *ids)).hexdigest()


@dataclass
class StepProgress:
    """What the current, uncommitted step has gathered in the current generation."""

    reduced: dict[int, pb.Reduced] = field(default_factory=dict)
    resumed: dict[int, float] = field(default_factory=dict)


