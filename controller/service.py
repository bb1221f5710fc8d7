"""gRPC face of the controller: one stream per agent, and the user's Control API."""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping

import grpc

from recover.common.netaddr import is_loopback
from recover.controller import authz
from recover.controller.coordinator import Coordinator
from recover.controller.gate import Gate, Malformed
from recover.controller.jobstate import RegistrationRefused
from recover.controller.leader import LeaderElection, LostLeadership
from recover.controller.operations import Decision
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


def due_for_beat(agents: Iterable[str], last_sent: Mapping[str, float], now: float,
                 every_s: float) -> list[str]:
    """The agents that heard nothing from us for `every_s` (never: due)."""
    return [a for a in agents if now - last_sent.get(a, -math.inf) >= every_s]


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
        self._queues: dict[str, asyncio.Queue[pb.ControllerMessage | None]] = {}
        self._last_sent: dict[str, float] = {}
        """Agent -> when we last sent it anything (monotonic): any message shows we lead."""

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

    def beat(self, every_s: float = BEAT_EVERY_S) -> None:
        """Tell every agent that heard nothing from us for `every_s` that we still lead (they
        look for a new leader after their leader timeout of silence). An agent fed commits
        and plans needs no beat: any message shows the same."""
        beat = pb.ControllerMessage(heartbeat=pb.Heartbeat(sent_at=time.time()))
        for agent_id in due_for_beat(self._queues, self._last_sent, time.monotonic(), every_s):
            self.send(agent_id, beat)

    def send(self, agent_id: str, message: pb.ControllerMessage) -> None:
        election = self.election
        if election is None or not election.holds():
            # Never act on a lease that may be gone (we were stopped, or cut off):
            # whatever we meant to say may contradict the new leader.
            self.deposed.set()
            self.refused_sends += 1
            return
        message.term = election.term
        queue = self._queues.get(agent_id)
        if queue is not None:
            queue.put_nowait(message)
            self._last_sent[agent_id] = time.monotonic()

    async def _leader_hint(self) -> str:
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
            await context.abort(grpc.StatusCode.UNAVAILABLE, await self._leader_hint())
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
                        reg = message.register
                        async with self.lock:
                            known = coordinator.agents.get(reg.agent_id)
                            verdict = authz.may_register(reg.agent_id, self._queues, subject,
                                                         known.subject if known else None)
                            if not verdict.allowed:
                                self.reject(coordinator, verdict)
                                refused.append((grpc.StatusCode.PERMISSION_DENIED, verdict.reason))
                                return
                            # Installed only now that no live session holds this id, so a
                            # refusal never touches another agent's session.
                            self._queues[reg.agent_id] = queue
                            try:
                                await coordinator.register_agent(
                                    reg.agent_id, reg.host, reg.slots,
                                    list(reg.replica_ids) if reg.resume else None, subject)
                            except RegistrationRefused as refusal:
                                if self._queues.get(reg.agent_id) is queue:
                                    del self._queues[reg.agent_id]
                                refused.append((grpc.StatusCode.FAILED_PRECONDITION, str(refusal)))
                                return
                            except LostLeadership:  # no answer: the agent looks for the leader
                                if self._queues.get(reg.agent_id) is queue:
                                    del self._queues[reg.agent_id]
                                raise
                        agent_id = reg.agent_id
                    elif agent_id is None:
                        refused.append((grpc.StatusCode.FAILED_PRECONDITION,
                                        "the first message of a session must be `register`"))
                        return
                    else:
                        await self._dispatch(coordinator, agent_id, kind, message, peer)
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
            if agent_id is not None and coordinator is self._coordinator:
                if self._queues.get(agent_id) is queue:
                    del self._queues[agent_id]
                    self._last_sent.pop(agent_id, None)
                async with self.lock:
                    try:
                        await coordinator.agent_lost(agent_id, "session closed")
                    except LostLeadership:
                        self.deposed.set()

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

    async def _dispatch(self, coordinator: Coordinator, agent_id: str, kind: str | None,
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
                                                    is_loopback)
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


class ControlService(rpc.ControlServicer):
    """Read-only user API: status, events, the run's report. A standby answers
    status with its role and the leader's address, and refuses the rest."""

    def __init__(self, sessions: AgentSessions) -> None:
        self._sessions = sessions
        self._gate = sessions.gate
        self.election: LeaderElection | None = None

    async def _standby_status(self) -> pb.JobStatus:
        election = self.election
        status = pb.JobStatus(state="standby", role="standby")
        try:
            leader = await election.leader() if election is not None else None
        except StoreError:
            leader = None
        if leader is not None:
            status.leader, status.term = leader.address, leader.term
            status.reason = f"standing by; leader {leader.address} (term {leader.term})"
        else:
            status.reason = "standing by; no leader right now"
        return status

    async def _leading(self, context: grpc.aio.ServicerContext) -> Coordinator:
        coordinator = self._sessions.coordinator
        if coordinator is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, (await self._standby_status()).reason)
        assert coordinator is not None
        return coordinator

    async def Status(self, request: pb.StatusRequest, context: grpc.aio.ServicerContext  # noqa: N802
                     ) -> pb.JobStatus:
        await self._gate.admit(context, "Status", request)
        coordinator = self._sessions.coordinator
        if coordinator is None:
            return await self._standby_status()
        status = job_status(coordinator)
        if self.election is not None:
            status.role, status.term, status.leader = "leader", self.election.term, self.election.address
        return status

    async def Events(self, request: pb.EventsRequest, context: grpc.aio.ServicerContext  # noqa: N802
                     ) -> pb.EventList:
        await self._gate.admit(context, "Events", request)
        coordinator = await self._leading(context)
        return pb.EventList(events=coordinator.events.since(request.after_seq))

    async def Report(self, request: pb.ReportRequest, context: grpc.aio.ServicerContext  # noqa: N802
                     ) -> pb.RunReport:
        await self._gate.admit(context, "Report", request)
        return run_report(await self._leading(context))

    async def Stop(self, request: pb.StopRequest, context: grpc.aio.ServicerContext  # noqa: N802
                   ) -> pb.OperatorReply:
        identity = await self._gate.admit(context, "Stop", request)
        return await self._operate(context, lambda c: c.request_stop(identity.subject,
                                                                     request.reason))

    async def Drain(self, request: pb.DrainRequest, context: grpc.aio.ServicerContext  # noqa: N802
                    ) -> pb.OperatorReply:
        identity = await self._gate.admit(context, "Drain", request)
        return await self._operate(context, lambda c: c.request_drain(
            request.agent_id, identity.subject, request.reason))

    async def SetSpares(self, request: pb.SparesRequest,  # noqa: N802
                        context: grpc.aio.ServicerContext) -> pb.OperatorReply:
        identity = await self._gate.admit(context, "SetSpares", request)
        return await self._operate(context, lambda c: c.set_spares(request.spares,
                                                                   identity.subject))

    async def _operate(self, context: grpc.aio.ServicerContext,
                       action: Callable[[Coordinator], Awaitable[Decision]]) -> pb.OperatorReply:
        coordinator = await self._leading(context)
        async with self._sessions.lock:  # one transition at a time, as for agents' reports
            if coordinator is not self._sessions.coordinator:
                await context.abort(grpc.StatusCode.UNAVAILABLE, "leadership changed; try again")
            try:
                decision = await action(coordinator)
            except LostLeadership:
                self._sessions.deposed.set()
                await context.abort(grpc.StatusCode.UNAVAILABLE, "leadership changed; try again")
        return pb.OperatorReply(accepted=decision.accepted, reason=decision.reason)


def join_intervals(events: list[pb.Event]) -> list[pb.JoinInterval]:
    """Each replica's way in, from the event log: its first join attempt to its entry."""
    started: dict[int, float] = {}
    intervals = []
    for event in events:
        if event.kind == "join-started":
            started.setdefault(event.replica, event.at)
        elif event.kind in ("replica-joined", "spare-promoted") and event.replica in started:
            intervals.append(pb.JoinInterval(replica=event.replica,
                                             started_at=started.pop(event.replica),
                                             entered_at=event.at,
                                             spare=event.kind == "spare-promoted"))
    return intervals


def run_report(c: Coordinator) -> pb.RunReport:
    """Everything the leader knows of the run, for `recover run`, `recover summary` and
    the controller's own summary.json."""
    return pb.RunReport(
        job=c.job, status=job_status(c), steps=c.steps, failures=c.failures,
        started_at=c.started_at, finished_at=c.finished_at, workload=c.workload,
        last_checkpoint=c.last_checkpoint, joins=join_intervals(c.events.since(0)),
        recovery_timings=[pb.RecoveryTiming(**{f"{phase}_s": seconds for phase, seconds
                                               in timing.items()})
                          for timing in c.recovery.timings])


def job_status(c: Coordinator) -> pb.JobStatus:
    now = c.finished_at or c.now()
    speeds = c.speeds()
    return pb.JobStatus(
        job_id=c.job.job_id,
        state=str(c.state),
        reason=c.reason,
        generation=c.generation,
        steps_committed=len(c.steps),
        steps_total=c.job.steps,
        live_replicas=[r for r, info in sorted(c.replicas.items())
                       if info.alive and r not in c.joins.joins],
        load=[pb.ReplicaLoad(replica=r, microbatches=len(ids), microbatch_s=speeds.get(r, 0.0))
              for r, ids in sorted(c.plan.items())],
        recoveries=c.recoveries,
        last_loss=c.steps[-1].loss if c.steps else 0.0,
        tokens=sum(s.tokens for s in c.steps),
        elapsed_s=now - c.started_at if c.started_at else 0.0,
        agents=sum(a.alive for a in c.agents.values()),
        redos=c.redos,
        joining=sorted(c.joins.joins),
        work_stealing=c.job.work_stealing,
        steals=c.steals.steals,
        microbatches_stolen=c.steals.stolen,
    )
