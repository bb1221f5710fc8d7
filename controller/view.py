"""The job's state as one immutable value, `JobView`, and how it changes: a `Draft`.

Every change to the job is a transition: a function that takes a draft of the current
view, changes it, and lists the effects it asks for (store writes, messages, events;
`effects.py`). `Draft.freeze()` returns the new view and those effects; the coordinator
(the one driver) keeps the view and carries out the effects in order. Transitions are
pure: they read the clock, the plan policy and the ledger's facts from the draft, never
from the world, so they are tested table-style without a network or a process.

What is not in the view, on purpose, because it changes per message and copying a view
there would cost O(replicas) per heartbeat or report at 1,000 agents: heartbeat times
(the failure detector's input), the reports of the step in flight, and the append-only
logs (events, failures, the ledger). The coordinator keeps those and hands transitions
what they need as `Facts`.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from types import MappingProxyType
from typing import Any

from recover.controller import effects
from recover.controller.jobstate import JobState
from recover.controller.joins import Join, JoinPhase
from recover.controller.policy import PlanPolicy
from recover.controller.worker_errors import ErrorKey
from recover.proto import pb

EMPTY: Mapping[Any, Any] = MappingProxyType({})


def _empty() -> Mapping[Any, Any]:
    return EMPTY


class ReplicaState(StrEnum):
    """A replica's lifecycle. One id per worker process: a lost id is never reused (a
    restart on the same slot is a new replica, which joins).

    ASSIGNED -> READY       its worker built the model and reported ready
    READY    -> MEMBER      the job starts with it (a member of generation 1)
    READY    -> JOINING     the job runs already: it gets a live member's state (joinflow.py)
    JOINING  -> SPARE       caught up while the job has its members: a hot spare
    SPARE    -> JOINING     a spare's stream of steps broke: another donor is tried
    JOINING | SPARE -> MEMBER   it enters a generation (after a commit, or in place of
                            lost members inside the step)
    MEMBER   -> JOINING     admitted, but its donor died a step short: out of the step, it
                            joins again from another member (losses.py)
    JOINING  -> READY       its join was abandoned: it is stopped, its exit is recorded
    live     -> LOST        its process, its agent or its reports failed (a failure record)
    live     -> RETIRED     it left without a failure: drained, refused, spares reduced

    A MEMBER stays one until the next generation leaves it out; a member lost mid-step is
    LOST but still listed in `JobView.members` until the generation that replaces it.
    """

    ASSIGNED = "assigned"
    READY = "ready"
    JOINING = "joining"
    SPARE = "spare"
    MEMBER = "member"
    LOST = "lost"
    RETIRED = "retired"


GONE = (ReplicaState.LOST, ReplicaState.RETIRED)


@dataclass(frozen=True)
class Replica:
    replica_id: int
    agent_id: str
    slot: int = 0
    """Its slot on the agent (a restart gets a new replica on the same slot)."""
    state: ReplicaState = ReplicaState.ASSIGNED
    pid: int = 0
    transfer_address: str = ""
    """Where it accepts a donor's state (from its `ready`)."""
    transfer_tls_sha256: str = ""
    """The certificate its transfer listener presents (from its `ready`; empty: plain TCP)."""
    satellites: tuple[str, ...] = ()
    """A replica spanning agents: the agents holding its ranks after `agent_id`'s, in rank
    order, each as many as `agent_id` (admission.spans). Every one of them gets the
    replica's commands; losing any loses the replica."""

    @property
    def agents(self) -> tuple[str, ...]:
        """Every agent holding ranks of it, the one with rank 0 first."""
        return (self.agent_id, *self.satellites)

    @property
    def alive(self) -> bool:
        return self.state not in GONE

    @property
    def ready(self) -> bool:
        return self.state not in (ReplicaState.ASSIGNED, *GONE)


@dataclass(frozen=True)
class Agent:
    agent_id: str
    host: str
    replicas: tuple[int, ...]
    alive: bool = True
    subject: str = ""
    """The identity that registered it (certificate or token; empty in plaintext): only it
    may rejoin as this agent."""
    waiting: tuple[int, ...] = ()
    """Its slots without a replica, waiting for room in the job (admission.py)."""
    slots: int = 0
    peer: str = ""
    """The host its session comes from (empty: unknown): its ranks' transfer addresses must
    be there, and a replica spanning agents meets at `peer:store_port` of its first agent."""
    store_port: int = 0
    """Where it listens for the store of a spanning replica whose rank 0 it holds."""

    @property
    def replica_store(self) -> str:
        host = self.peer or "127.0.0.1"
        return f"[{host}]:{self.store_port}" if ":" in host else f"{host}:{self.store_port}"


@dataclass(frozen=True)
class TakeoverWait:
    """A new leader waiting for the agents of the job to rejoin (takeover.py)."""

    persisted: Any
    """The `records.PersistedJob` it was rebuilt from."""
    deadline: float
    expected: frozenset[str]
    """Agents whose rejoin it waits for: those hosting members or joiners."""
    rejoined: frozenset[str] = frozenset()
    joiners: frozenset[int] = frozenset()
    """Replicas that were joining (or spares) when the old leader went: their joins start
    over once their agents rejoin (their transfer endpoints are in `replicas`)."""


@dataclass(frozen=True)
class ReplicaTally:
    """Counts over `JobView.replicas`, kept by the Draft as replicas change: registering an
    agent and a worker's `ready` read them, and counting there cost O(replicas) each, so a
    job's start was quadratic in its agents (BENCHMARKS.md section 5)."""

    live: int = 0
    ready: int = 0
    """Alive and past `ready` (every ready replica is alive)."""
    next_id: int = 0
    """One past the highest replica id ever given: ids are never reused."""

    @staticmethod
    def of(replicas: Mapping[int, Replica]) -> ReplicaTally:
        return ReplicaTally(live=sum(r.alive for r in replicas.values()),
                            ready=sum(r.ready for r in replicas.values()),
                            next_id=max(replicas, default=-1) + 1)

    def changed(self, old: Replica | None, new: Replica) -> ReplicaTally:
        return ReplicaTally(
            live=self.live + new.alive - (old.alive if old is not None else False),
            ready=self.ready + new.ready - (old.ready if old is not None else False),
            next_id=max(self.next_id, new.replica_id + 1))


@dataclass(frozen=True)
class JobView:
    """Everything the leader decides with. Immutable: a transition makes a new one."""

    job: pb.JobConfig
    """The job's configuration (never edited in place: a change is a new message)."""
    state: JobState = JobState.WAITING
    reason: str = ""
    agents: Mapping[str, Agent] = field(default_factory=_empty)
    replicas: Mapping[int, Replica] = field(default_factory=_empty)
    generation: int = 0
    members: tuple[int, ...] = ()
    """The members of the generation in force (some may be lost since it began)."""
    step: int = 0
    """The step being computed: every step before it is committed."""
    plan: Mapping[int, tuple[int, ...]] = field(default_factory=_empty)
    """Who computes which microbatches of `step` (the plan the workers hold)."""
    scale_epoch: int = 0
    """Exact reduction: overflow redos of the current step so far."""
    plan_version: int = 0
    """Work-stealing: steals that changed `plan` since its generation or commit made it."""
    stolen: int = 0
    """Work-stealing: microbatches moved between members in the step in flight."""
    joins: Mapping[int, Join] = field(default_factory=_empty)
    """Replicas joining the running job (restarts, replacement hosts, hot spares)."""
    takeover: TakeoverWait | None = None
    """Set while a new leader waits for the agents to rejoin."""
    workload: pb.WorkloadInfo = field(default_factory=pb.WorkloadInfo)
    """What the workers train, from the first `ready` report."""
    errors: Mapping[ErrorKey, int] = field(default_factory=_empty)
    """Errors in the user's code so far, and the replica that reported each first."""
    stopping: str = ""
    """Why the job stops at the next step boundary (an operator's stop: operations.py)."""
    stop_pending: bool = False
    """The step the stop waited for is committed; the job stops once it is acknowledged."""
    draining: frozenset[str] = frozenset()
    """Agents whose replicas leave at the next step boundary (an operator's drain)."""
    startup_failed_at: float | None = None
    """When a worker last failed before the job started (admission.start_decision)."""
    started_at: float = 0.0
    finished_at: float = 0.0
    recoveries: int = 0
    redos: int = 0
    joined: int = 0
    abandoned: int = 0
    tally: ReplicaTally | None = None
    """Counts over `replicas` (computed when not given; the Draft keeps them current)."""

    def __post_init__(self) -> None:
        if self.tally is None:
            object.__setattr__(self, "tally", ReplicaTally.of(self.replicas))

    @property
    def counts(self) -> ReplicaTally:
        assert self.tally is not None  # set by __post_init__
        return self.tally

    @property
    def last_step_committed(self) -> bool:
        """No step is left to train: the job's last, or the one an operator stopped after."""
        return self.step >= self.job.steps or self.stop_pending

    @property
    def spares(self) -> list[int]:
        """Caught-up joiners waiting for a place."""
        return sorted(j.joiner for j in self.joins.values() if j.phase is JoinPhase.CAUGHT_UP)

    def live(self, replicas: Iterable[int]) -> list[int]:
        return [r for r in replicas if self.replicas[r].alive]


@dataclass(frozen=True)
class Facts:
    """What a transition may know besides the view: the moment, the plan policy, a source
    of fresh tokens and what the ledger says of the last committed step."""

    now: float
    policy: PlanPolicy
    token: Callable[[], str]
    rendezvous: str = ""
    """Where the members' groups meet (this leader's rendezvous store)."""
    ledger_len: int = 0
    """Steps in the ledger."""
    last_record: pb.StepRecord | None = None
    """The ledger's last step (with the parameter digests of those who applied it)."""
    unrecorded_failures: tuple[pb.FailureRecord, ...] = ()
    """Failures no step's record holds yet: the next record takes them."""


_MAPS = ("agents", "replicas", "plan", "joins", "errors")


def _copy(mapping: Mapping[Any, Any]) -> dict[Any, Any]:
    """A dict of `mapping`. A frozen view's maps are read-only proxies of dicts, whose
    `copy()` copies the dict underneath in one C pass: 22x faster than `dict(proxy)`, which
    goes key by key (measured at 2,000 entries: 3 vs 67 us). It is the O(replicas) cost
    of every transition that changes a replica or an agent: at thousands of agents
    registering at once, most of the leader's time."""
    copy = getattr(mapping, "copy", None)
    copied = copy() if copy is not None else None
    return copied if isinstance(copied, dict) else dict(mapping)


class Draft:
    """A working copy of a view. Maps are copied on their first write (copy-on-write), so a
    transition that changes one replica costs O(replicas) once, not per change."""

    def __init__(self, view: JobView, facts: Facts) -> None:
        self.v = view
        """The view as changed so far (its maps may be this draft's working dicts)."""
        self.facts = facts
        self.ledger_len = facts.ledger_len
        """Steps in the ledger, counting a commit this transition asks for."""
        self._applied: set[int] | None = None
        self.effects: list[effects.Effect] = []
        self._copied: set[str] = set()

    @property
    def now(self) -> float:
        return self.facts.now

    @property
    def policy(self) -> PlanPolicy:
        return self.facts.policy

    @property
    def applied_last(self) -> set[int]:
        """Replicas that acknowledged the last committed step (read only when the end is
        near: it costs O(members))."""
        if self._applied is None:
            last = self.facts.last_record
            self._applied = {d.replica for d in last.param_sha256} if last else set()
        return self._applied

    @applied_last.setter
    def applied_last(self, replicas: set[int]) -> None:
        self._applied = replicas

    def set(self, **fields: Any) -> None:
        for name in _MAPS:
            if name in fields:
                fields[name] = dict(fields[name])
                self._copied.add(name)
        if "replicas" in fields:
            fields["tally"] = ReplicaTally.of(fields["replicas"])
        self.v = dataclasses.replace(self.v, **fields)

    def _map(self, name: str) -> dict[Any, Any]:
        if name not in self._copied:
            self.v = dataclasses.replace(self.v, **{name: _copy(getattr(self.v, name))})
            self._copied.add(name)
        working: dict[Any, Any] = getattr(self.v, name)
        return working

    def put_replica(self, replica: Replica) -> None:
        replicas = self._map("replicas")
        tally = self.v.counts.changed(replicas.get(replica.replica_id), replica)
        replicas[replica.replica_id] = replica
        self.v = dataclasses.replace(self.v, tally=tally)

    def change_replica(self, replica: int, **changes: Any) -> Replica:
        updated = dataclasses.replace(self.v.replicas[replica], **changes)
        self.put_replica(updated)
        return updated

    def put_agent(self, agent: Agent) -> None:
        self._map("agents")[agent.agent_id] = agent

    def change_agent(self, agent_id: str, **changes: Any) -> Agent:
        updated = dataclasses.replace(self.v.agents[agent_id], **changes)
        self.put_agent(updated)
        return updated

    def put_join(self, join: Join) -> None:
        """A join and its replica's state move together (SPARE once caught up)."""
        self._map("joins")[join.joiner] = join
        state = ReplicaState.SPARE if join.phase is JoinPhase.CAUGHT_UP else ReplicaState.JOINING
        if self.v.replicas[join.joiner].state is not state:
            self.change_replica(join.joiner, state=state)

    def drop_join(self, replica: int) -> None:
        if replica in self.v.joins:
            del self._map("joins")[replica]

    def note_error(self, key: ErrorKey, replica: int) -> None:
        if key not in self.v.errors:
            self._map("errors")[key] = replica

    def send(self, agent_id: str, message: pb.ControllerMessage) -> None:
        self.effects.append(effects.Send(agent_id, message))

    def send_all(self, agent_ids: tuple[str, ...], message: pb.ControllerMessage) -> None:
        """The same message to each of `agent_ids`, in order."""
        if agent_ids:
            self.effects.append(effects.Broadcast(agent_ids, message))

    def send_replica(self, replica: int, message: pb.ControllerMessage) -> None:
        """To every live agent holding ranks of `replica` (one, unless it spans agents)."""
        for agent_id in self.v.replicas[replica].agents:
            agent = self.v.agents.get(agent_id)
            if agent is not None and agent.alive:
                self.send(agent_id, message)

    def emit(self, kind: str, message: str, *, step: int = -1, generation: int = -1,
             replica: int = -1, level: int = logging.INFO, pid: int = 0) -> None:
        self.effects.append(effects.Emit(kind, message, step, generation, replica, level, pid))

    def do(self, effect: effects.Effect) -> None:
        self.effects.append(effect)

    def freeze(self) -> tuple[JobView, tuple[effects.Effect, ...]]:
        frozen = {name: MappingProxyType(getattr(self.v, name)) for name in self._copied}
        return dataclasses.replace(self.v, **frozen), tuple(self.effects)
