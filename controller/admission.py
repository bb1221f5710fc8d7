"""Admission policy: may a new agent join the job, and which replica ids does it host?

A pure function of what the controller knows, returning the decision and its
reason (the reason is what a refused agent prints), tested table-style.
Replicas join only before training starts: rejoining a running job is not
supported yet, and during a leader takeover only the agents the previous
leader knew may come back (takeover.py).
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

from recover.controller.jobstate import JobState


@dataclass(frozen=True)
class Admission:
    replica_ids: tuple[int, ...]
    """The replica ids the agent hosts; empty when it is refused."""
    reason: str
    """Why, for the agent's error message and the events log."""

    @property
    def admitted(self) -> bool:
        return bool(self.replica_ids)


def admit_agent(agent_id: str, host: str, slots: int, *, job_id: str, job_state: JobState,
                taking_over: bool, known_agents: Collection[str], wanted_replicas: int,
                hosted_replicas: int) -> Admission:
    """Replica ids are handed out in registration order: 0..R-1 over all agents."""
    if taking_over:
        return Admission((), f"job {job_id} is taking over after a leader change")
    if job_state is not JobState.WAITING:
        return Admission((), f"job {job_id} is {job_state}; replicas cannot join a started job yet")
    if agent_id in known_agents:
        return Admission((), f"agent id {agent_id!r} is already registered")
    if slots < 1:
        return Admission((), f"an agent needs at least one slot, got {slots}")
    if slots > wanted_replicas - hosted_replicas:
        return Admission((), f"job needs {wanted_replicas} replicas and has {hosted_replicas}; "
                             f"{slots} more slots do not fit")
    ids = tuple(range(hosted_replicas, hosted_replicas + slots))
    return Admission(ids, f"agent {agent_id} on {host}: replicas {list(ids)}")
