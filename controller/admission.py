"""Admission policy: who may bring replicas into the job, and when the job starts.

Pure functions of what the controller knows, returning the decision and its
reason (the reason is what a refused agent prints, and what the events log
says), tested table-style. The job wants `replicas` members plus `spares`
hot spares (its capacity); an agent's slots, a dead worker's replacement and a
new host's slots all get fresh replica ids while the job is below capacity.
Slots beyond it are not refused, as a cluster delivers hosts with more slots than a
job still needs and replacements staged ahead: they are registered and *wait*, and
the controller gives them replicas, in order, when the job has room again
(`waiting_slots`).
A replica of more ranks than an agent has slots spans agents (`spans`): each agent of it
holds the same number of its ranks, the first one rank 0 and the store its ranks meet on.
Such an agent's slots wait until enough agents of its size wait too (`fill_waiting` forms
the replica from them, in the order they came) and the job has room.
Replicas that arrive after the start join with live state transfer
(joins.py). During a leader takeover only the agents the previous leader knew
may come back (takeover.py).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

from recover.controller.jobstate import TERMINAL, JobState


@dataclass(frozen=True)
class Admission:
    replica_ids: tuple[int, ...]
    """The replica ids granted; empty when refused or when every slot waits."""
    reason: str
    """Why, for the agent's error message and the events log."""
    waiting_slots: tuple[int, ...] = ()
    """Slots admitted without a replica (the first slot of each replica's ranks): the job
    has no room for them yet."""

    @property
    def admitted(self) -> bool:
        return bool(self.replica_ids or self.waiting_slots)


@dataclass(frozen=True)
class Capacity:
    """How many replicas the job wants and has, and the next free replica id."""

    wanted: int
    """Members (`replicas`) plus hot spares."""
    live: int
    """Replicas alive now: members, joiners, spares, and any not started yet."""
    next_id: int
    """Ids are never reused: a replacement is a new replica (old reports cannot be mistaken
    for its own)."""

    def room(self) -> int:
        return max(self.wanted - self.live, 0)


def _closed(job_id: str, job_state: JobState, taking_over: bool) -> str | None:
    if taking_over:
        return f"job {job_id} is taking over after a leader change"
    if job_state in TERMINAL:
        return f"job {job_id} is {job_state}"
    return None


def admit_agent(agent_id: str, host: str, slots: int, *, job_id: str, job_state: JobState,
                taking_over: bool, known_agents: Collection[str], capacity: Capacity,
                ranks_per_replica: int = 1) -> Admission:
    """A new agent's slots: fresh replica ids, as many as the job has room for, one per
    `ranks_per_replica` slots; the slots beyond that wait for room. An agent with fewer
    slots than a replica has ranks holds part of one (`spans`): it waits for the others."""
    closed = _closed(job_id, job_state, taking_over)
    if closed is not None:
        return Admission((), closed)
    if agent_id in known_agents:
        return Admission((), f"agent id {agent_id!r} is already registered")
    ranks = max(ranks_per_replica, 1)
    if slots < 1:
        return Admission((), f"an agent needs at least one slot, got {slots}")
    if slots < ranks and ranks % slots:
        return Admission((), f"{slots} slots do not hold a whole part of a replica of {ranks} "
                             "ranks (--ranks-per-replica): a replica spanning agents has the "
                             "same number of ranks on each, so give a divisor of it")
    if slots < ranks:
        return Admission((), f"agent {agent_id} on {host}: its {slots} slot"
                             f"{'s hold' if slots > 1 else ' holds'} part of a replica of "
                             f"{ranks} ranks spanning {ranks // slots} agents; it waits for "
                             "the others", waiting_slots=(0,))
    if slots % ranks:
        return Admission((), f"{slots} slots do not hold whole replicas of {ranks} ranks "
                             "(--ranks-per-replica): give a multiple of it")
    wanted = slots // ranks
    granted = min(wanted, capacity.room())
    ids = tuple(range(capacity.next_id, capacity.next_id + granted))
    waiting = tuple(index * ranks for index in range(granted, wanted))
    joins = " (they join the running job)" if ids and job_state is JobState.RUNNING else ""
    given = f"replicas {list(ids)}{joins}" if ids else "no replica"
    wait = "" if not waiting else (
        f"; slots {list(waiting)} wait for room (the job wants {capacity.wanted} replicas "
        f"and has {capacity.live + granted})")
    return Admission(ids, f"agent {agent_id} on {host}: {given}{wait}", waiting)


def spans(slots: int, ranks_per_replica: int) -> int:
    """How many agents of `slots` slots a replica spans: 1 when its ranks fit on one."""
    ranks = max(ranks_per_replica, 1)
    return ranks // slots if 0 < slots < ranks and ranks % slots == 0 else 1


@dataclass(frozen=True)
class SlotFilled:
    agent_id: str
    slot: int
    replica: int
    reason: str
    satellites: tuple[str, ...] = ()
    """A replica spanning agents: its other agents, in rank order (`agent_id` holds rank 0)."""


@dataclass(frozen=True)
class WaitingSlot:
    agent_id: str
    slot: int
    span: int = 1
    """How many agents its replica spans (`spans`): that many waiting agents of its size form
    one."""


def fill_waiting(waiting: Sequence[WaitingSlot], capacity: Capacity, why: str
                 ) -> list[SlotFilled]:
    """Which waiting slots (agents in the order they registered) get a replica now that the
    job has room (`why`), and which fresh id: as many as there is room for. Agents that hold
    part of a replica form one as soon as enough of them wait, the first holding rank 0."""
    filled: list[SlotFilled] = []
    forming: dict[int, list[str]] = {}
    for slot in waiting:
        if len(filled) >= capacity.room():
            break
        replica = capacity.next_id + len(filled)
        context = f"{why}; the job wants {capacity.wanted} and had {capacity.live}"
        if slot.span <= 1:
            filled.append(SlotFilled(slot.agent_id, slot.slot, replica,
                                     f"agent {slot.agent_id} slot {slot.slot}: new replica "
                                     f"{replica} ({context})"))
            continue
        group = forming.setdefault(slot.span, [])
        group.append(slot.agent_id)
        if len(group) == slot.span:
            filled.append(SlotFilled(group[0], 0, replica, f"agents {', '.join(group)}: new "
                                     f"replica {replica} spanning them ({context})",
                                     satellites=tuple(group[1:])))
            del forming[slot.span]
    return filled


def admit_replacement(agent_id: str, slot: int, *, agent_alive: bool, job_id: str,
                      job_state: JobState, taking_over: bool, capacity: Capacity,
                      span: int = 1) -> Admission:
    """A restarted worker on `slot` of a live agent: one fresh replica id if there is room;
    else the slot waits for room. Part of a replica spanning agents (`span` > 1) waits for
    the replica's other parts (`fill_waiting`)."""
    closed = _closed(job_id, job_state, taking_over)
    if closed is not None:
        return Admission((), closed)
    if not agent_alive:
        return Admission((), f"agent {agent_id} is not part of the job (declared lost?)")
    if span > 1:
        return Admission((), f"agent {agent_id}: its slots wait for the other agents of a "
                             f"replica spanning {span}", waiting_slots=(slot,))
    if capacity.room() < 1:
        return Admission((), f"job has its {capacity.wanted} replicas; slot {slot} waits for "
                             "room", waiting_slots=(slot,))
    return Admission((capacity.next_id,), f"agent {agent_id} slot {slot}: new replica "
                                          f"{capacity.next_id}")


@dataclass(frozen=True)
class StartDecision:
    start: bool
    reason: str


def start_decision(*, ready: int, live: int, target: int, min_replicas: int,
                   startup_failure_for_s: float | None, grace_s: float) -> StartDecision:
    """Start when every live replica is ready and there are `target` of them; after a
    worker failed during startup, also with fewer (at least `min_replicas`) once its
    replacement had `grace_s` to arrive: the late ones join the running job."""
    if ready < live:
        return StartDecision(False, f"{ready} of {live} replicas ready")
    if ready >= target:
        return StartDecision(True, f"{ready} replicas ready")
    floor = max(min_replicas, 1)
    if startup_failure_for_s is None:
        return StartDecision(False, f"{ready} of {target} replicas ready")
    if ready < floor:
        return StartDecision(False, f"{ready} replicas ready, at least {floor} needed "
                                    "(--min-replicas)")
    if startup_failure_for_s < grace_s:
        return StartDecision(False, f"{ready} of {target} ready; waiting up to {grace_s:.0f}s for "
                                    "the replacement of a worker that failed during startup")
    return StartDecision(True, f"starting with {ready} of {target} replicas (a worker failed "
                               f"during startup); the others join when they are ready")
