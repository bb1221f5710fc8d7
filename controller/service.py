"""gRPC face of the controller for agents: one stream per agent (or per rack's relay,
`relayed.py`), its messages fed into the coordinator under one lock."""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from typing import Protocol

import grpc

from recover.common.netaddr import is_loopback
from recover.controller import authz
from recover.controller.coordinator import Coordinator
from recover.controller.gate import Gate, Malformed, SerializedOnce
from recover.controller.jobstate import RegistrationRefused
from recover.controller.leader import LeaderElection, LostLeadership
from recover.controller.store import StoreError
from recover.proto import pb, rpc

log = logging.getLogger("recover.controller")


REJECTED_EVENTS_FIRST = 20
REJECTED_EVENTS_EVERY = 1000

BEAT_EVERY_S = 0.5
"""Longest an agent goes without a message from its leader: a quarter of the agents' default
leader timeout (2 s), so three beats may be late or lost before one looks elsewhere."""
KEEPALIVE_SERVER_OPTIONS = [
    # Agents ping every second to notice a stopped leader; let them.
    ("grpc.http2.min_recv_ping_interval_without_data_ms", 500),
    ("grpc.http2.max_ping_strikes", 0),
    ("grpc.keepalive_permit_without_calls", 1),
]


class Outbox(Protocol):
    """Where an agent's messages go: its session's queue, or its relay (None: end it)."""

    def put_nowait(self, message: pb.ControllerMessage | None) -> None: ...


def due_for_beat(agents: Iterable[str], last_sent: Mapping[str, float], now: float,
                 every_s: float) -> list[str]:
    """The agents that heard nothing from us for `every_s` (never: due)."""
    return [a for a in agents if now - last_sent.get(a, -math.inf) >= every_s]


def rank_peers(coordinator: Coordinator, replica: int) -> list[str | None]:
    """By rank, the host of the agent holding it, for a replica spanning agents (else none:
    every rank is on the reporting agent's host)."""
    info = coordinator.replicas.get(replica)
    if info is None or not info.satellites:
        return []
    home = coordinator.agents.get(info.agent_id)
    per_agent = home.slots if home is not None else 0
    peers: list[str | None] = []
    for agent_id in info.agents:
        agent = coordinator.agents.get(agent_id)
        peers += [agent.peer or None if agent is not None else None] * per_agent
    return peers


class AgentSessions(rpc.AgentSessionServicer):
    """Owns the per-agent outgoing queues and feeds reports into the coordinator.

    Every coordinator call runs under one lock: the coordinator awaits store
    writes mid-transition and must not interleave two transitions. A
    controller that does not lead (a standby, or a leader that lost its lease)
    has no coordinator: it refuses sessions and names the leader it knows of.
    """

    def __init__(self, gate: Gate | None = None) -> None:
        self.gate = gate or Gate()
        self.gate.reject = lambda verdict: self.reject(self._coordinator, verdict)
        self.lock = asyncio.Lock()
        self.election: LeaderElection | None = None
        self.collector: object | None = None
        self.deposed = asyncio.Event()
        """Set when a send or write was refused because the lease may be gone."""
        self.refused_sends = 0
        """Commands not sent because our lease may have expired (a deposed leader's)."""

        self._coordinator: Coordinator | None = None
        self._queues: dict[str, Outbox] = {}
        self._last_sent: dict[str, float] = {}
        """Agent -> when we last sent it anything (monotonic): any message shows we lead."""
        self._via_relay: set[str] = set()
        """Agents whose relay beats them (it hears the leader for them all: relayed.py)."""
        self.release_hooks: list[Callable[[], None]] = []
        """Called when we stop leading (the relays' streams end too)."""
        self.serializer = SerializedOnce()
        """The sessions' response serializer: a broadcast is serialized once, not per agent."""

    @property
    def coordinator(self) -> Coordinator | None:
        return self._coordinator

    def lead(self, coordinator: Coordinator) -> None:
        self._coordinator = coordinator
        self.deposed.clear()

    def release(self) -> None:
        """Stop leading: end every agent stream so the agents look for the new leader."""
        self._coordinator = None
        for queue in self._queues.values():
            queue.put_nowait(None)
        self._queues.clear()
        self._last_sent.clear()
        self._via_relay.clear()
        for hook in self.release_hooks:
            hook()

    def beat(self, every_s: float = BEAT_EVERY_S) -> None:
        """Tell every agent that heard nothing from us for `every_s` that we still lead (they
        look for a new leader after their leader timeout of silence). An agent fed commits
        and plans needs no beat: any message shows the same. Agents behind relays are not
        beaten here (their relays are): with none direct, nothing is scanned (at 12,500
        relayed agents the scan took 1.6 ms of the leader's loop four times a second)."""
        if len(self._via_relay) == len(self._queues):
            return
        beat = pb.ControllerMessage(heartbeat=pb.Heartbeat(sent_at=time.time()))
        direct = (a for a in self._queues if a not in self._via_relay)
        for agent_id in due_for_beat(direct, self._last_sent, time.monotonic(), every_s):
            self.send(agent_id, beat)

    def send(self, agent_id: str, message: pb.ControllerMessage) -> None:
        self.send_all((agent_id,), message)

    def send_all(self, agent_ids: tuple[str, ...], message: pb.ControllerMessage) -> None:
        """`message` to each of `agent_ids`, the lease checked once for all (at 12,500 agents a
        plan's broadcast is on a loss's critical path: BENCHMARKS.md 5)."""
        election = self.election
        if election is None or not election.holds():
            # Never act on a lease that may be gone (we were stopped, or cut off):
            # whatever we meant to say may contradict the new leader.
            self.deposed.set()
            self.refused_sends += len(agent_ids)
            return
        message.term = election.term
        queues, last_sent, now = self._queues, self._last_sent, time.monotonic()
        for agent_id in agent_ids:
            queue = queues.get(agent_id)
            if queue is not None:
                queue.put_nowait(message)
                last_sent[agent_id] = now

    async def leader_hint(self) -> str:
        election = self.election
        try:
            leader = await election.leader() if election is not None else None
        except StoreError:
            leader = None
        if leader is None:
            return "no leader right now (an election is under way); try again"
        return f"not the leader; leader: {leader.address} (term {leader.term})"

    async def Session(  # noqa: N802 (gRPC method name)
        self, request_iterator: AsyncIterator[pb.AgentMessage], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.ControllerMessage]:
        identity = await self.gate.admit(context, "Session")
        subject = identity.subject if identity.proof != "none" else ""
        peer = authz.peer_host(context.peer() or "")
        coordinator = self._coordinator
        if coordinator is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, await self.leader_hint())
            return
        queue: asyncio.Queue[pb.ControllerMessage | None] = asyncio.Queue()
        agent_id: str | None = None
        refused: list[tuple[grpc.StatusCode, str]] = []

        async def read() -> None:
            nonlocal agent_id
            try:
                async for message in request_iterator:
                    if isinstance(message, Malformed):
                        verdict = authz.Verdict(False, f"not a valid {message.expected} message",
                                                authz.Reason.MALFORMED)
                        self.reject(coordinator, verdict)
                        refused.append((grpc.StatusCode.INVALID_ARGUMENT, verdict.reason))
                        return
                    kind = message.WhichOneof("kind")
                    if kind == "register" and agent_id is None:
                        refusal = await self.register(coordinator, message.register, queue,
                                                      subject, peer=peer or "")
                        if refusal is not None:
                            refused.append(refusal)
                            return
                        agent_id = message.register.agent_id
                    elif agent_id is None:
                        refused.append((grpc.StatusCode.FAILED_PRECONDITION,
                                        "the first message of a session must be `register`"))
                        return
                    else:
                        await self.dispatch(coordinator, agent_id, kind, message, peer)
            except (grpc.aio.AioRpcError, asyncio.CancelledError):
                pass
            except LostLeadership:
                self.deposed.set()
            finally:
                queue.put_nowait(None)

        reader = asyncio.create_task(read())
        try:
            while (out := await queue.get()) is not None:
                yield out
                if out.WhichOneof("kind") == "shutdown":
                    break
            if refused:
                await context.abort(*refused[0])
        finally:
            reader.cancel()
            if agent_id is not None:
                await self.session_over(coordinator, agent_id, queue)

    async def register(self, coordinator: Coordinator, reg: pb.RegisterAgent, outbox: Outbox,
                       subject: str, via_relay: bool = False, peer: str = ""
                       ) -> tuple[grpc.StatusCode, str] | None:
        """Bind `reg.agent_id` to `outbox` and register the agent; why not (a status code and
        a reason for the agent), or None. LostLeadership: no answer, the agent looks for
        the leader."""
        async with self.lock:
            known = coordinator.agents.get(reg.agent_id)
            if reg.resume and reg.agent_id in self._via_relay and known is not None \
                    and known.subject == subject:
                # Its relay died and the leader has not heard yet, and it came back through
                # another: the new session wins (the old relay's end then leaves it alone).
                self._unbind(reg.agent_id, self._queues[reg.agent_id])
            verdict = authz.may_register(reg.agent_id, self._queues, subject,
                                         known.subject if known else None)
            if not verdict.allowed:
                self.reject(coordinator, verdict)
                return grpc.StatusCode.PERMISSION_DENIED, verdict.reason
            # Installed only now that no live session holds this id, so a refusal never
            # touches another agent's session.
            self._queues[reg.agent_id] = outbox
            if via_relay:
                self._via_relay.add(reg.agent_id)
            try:
                await coordinator.register_agent(
                    reg.agent_id, reg.host, reg.slots,
                    list(reg.replica_ids) if reg.resume else None, subject,
                    peer=peer, store_port=reg.replica_store_port, seen_generation=reg.generation)
            except RegistrationRefused as refusal:
                self._unbind(reg.agent_id, outbox)
                return grpc.StatusCode.FAILED_PRECONDITION, str(refusal)
            except LostLeadership:
                self._unbind(reg.agent_id, outbox)
                raise
        return None

    def _unbind(self, agent_id: str, outbox: Outbox) -> None:
        if self._queues.get(agent_id) is outbox:
            del self._queues[agent_id]
            self._last_sent.pop(agent_id, None)
            self._via_relay.discard(agent_id)

    async def session_over(self, coordinator: Coordinator, agent_id: str, outbox: Outbox,
                           why: str = "session closed") -> None:
        """An agent's session ended: the agent is lost (unless this term is over)."""
        await self.sessions_over(coordinator, [(agent_id, outbox, why)])

    async def sessions_over(self, coordinator: Coordinator,
                            ended: list[tuple[str, Outbox, str]]) -> None:
        """Sessions that ended together (agent, its outbox, why): their agents are lost in one
        transition, so in one new generation."""
        # A session that is no longer the agent's (it came back on another) ends nothing.
        ended = [(a, outbox, why) for a, outbox, why in ended if self._queues.get(a) is outbox]
        if coordinator is not self._coordinator or not ended:
            return
        for agent_id, outbox, _ in ended:
            self._unbind(agent_id, outbox)
        async with self.lock:
            try:
                await coordinator.agents_lost([(agent_id, why) for agent_id, _, why in ended])
            except LostLeadership:
                self.deposed.set()

    def sessions_detached(self, ended: list[tuple[str, Outbox]]) -> list[str]:
        """Sessions cut by their relay's death, not their agents': the agents stay in the job,
        silent, until they come back on another session (`takeover.reattach`) or the failure
        detector gives them up (the agent timeout). Returns those detached."""
        detached = [a for a, outbox in ended if self._queues.get(a) is outbox]
        for agent_id, outbox in ended:
            self._unbind(agent_id, outbox)
        return detached

    @staticmethod
    def _about(kind: str | None, message: pb.AgentMessage) -> tuple[int, str]:
        """(the replica a message concerns, what it is) for authorization."""
        if kind == "worker_exited":
            return message.worker_exited.replica, "worker_exited"
        if kind == "report":
            return message.report.replica, message.report.WhichOneof("kind") or ""
        return -1, kind or ""

    def reject(self, coordinator: Coordinator | None, verdict: authz.Verdict) -> None:
        """Count and log a refusal (never raise: a bad client must not hurt the job)."""
        code = verdict.code or authz.Reason.FORBIDDEN
        if coordinator is None:  # a standby: no job to record it in
            log.warning("rejected: %s: %s", code, verdict.reason)
            return
        count = coordinator.rejected[code] = coordinator.rejected.get(code, 0) + 1
        # A flood of bad calls must not grow the event log without bound: the first few of
        # each reason are events, then one in every REJECTED_EVENTS_EVERY (the metric counts all).
        if count <= REJECTED_EVENTS_FIRST or count % REJECTED_EVENTS_EVERY == 0:
            so_far = f" ({count} so far)" if count > REJECTED_EVENTS_FIRST else ""
            coordinator.events.emit("rejected", f"{code}{so_far}: {verdict.reason}",
                                    level=logging.WARNING)

    async def dispatch(self, coordinator: Coordinator, agent_id: str, kind: str | None,
                       message: pb.AgentMessage, peer: str | None = None) -> None:
        if kind == "heartbeat":
            coordinator.heartbeat(agent_id)
            return
        async with self.lock:
            if coordinator is not self._coordinator:
                return  # this term is over
            coordinator.heartbeat(agent_id)  # any message proves the agent alive
            replica, what = self._about(kind, message)
            agent = coordinator.agents.get(agent_id)
            verdict = authz.may_report(agent_id, what, replica, agent.replicas if agent else ())
            if not verdict.allowed:
                self.reject(coordinator, verdict)
                return
            if kind == "worker_exited":
                await coordinator.worker_exited(message.worker_exited)
            elif kind == "replica_request":
                await coordinator.replica_request(agent_id, message.replica_request)
            elif kind == "report":
                report = message.report
                which = report.WhichOneof("kind")
                if which == "reduced":
                    for applied in report.reduced.applied:  # earlier steps' (folded in)
                        await coordinator.applied(report.replica, applied)
                    await coordinator.reduced(report.replica, report.reduced)
                elif which == "applied":
                    await coordinator.applied(report.replica, report.applied)
                elif which == "resumed":
                    await coordinator.resumed(report.replica, report.resumed)
                elif which == "progress":
                    await coordinator.progress(report.replica, report.progress)
                elif which == "released":
                    await coordinator.released(report.replica, report.released)
                elif which == "ready":
                    named = authz.may_name_transfer(report.ready.transfer_address, peer,
                                                    is_loopback,
                                                    rank_peers(coordinator, report.replica))
                    if not named.allowed:  # it gets no donor: the newcomer is dropped
                        self.reject(coordinator, named)
                        await coordinator.members_lost([report.replica], named.reason,
                                                       cause="refused")
                        return
                    await coordinator.worker_ready(report.replica, report.ready)
                elif which == "join_progress":
                    coordinator.joins.progress(report.replica, report.join_progress)
                elif which == "join_failed":
                    await coordinator.joins.failed(report.replica, report.join_failed)
                elif which == "checkpoint_written":
                    written = report.checkpoint_written
                    believed = authz.may_record_checkpoint(
                        written, coordinator.job.checkpoint.dir, len(coordinator.steps))
                    if not believed.allowed:
                        self.reject(coordinator, believed)
                        return
                    coordinator.checkpoint_written(report.replica, written)
