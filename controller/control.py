"""The user's Control API (status, events, the run's report; stop, drain, spares) and the
run's report and status as messages, built from the leader's coordinator."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import grpc

from recover.controller.coordinator import Coordinator
from recover.controller.leader import LeaderElection, LostLeadership
from recover.controller.operations import Decision
from recover.controller.service import AgentSessions
from recover.controller.store import StoreError
from recover.proto import pb, rpc


class ControlService(rpc.ControlServicer):
    """Read-only user API: status, events, the run's report. A standby answers
    status with its role and the leader's address, and refuses the rest."""

    def __init__(self, sessions: AgentSessions) -> None:
        self._sessions = sessions
        self._gate = sessions.gate
        self.election: LeaderElection | None = None
        self.relay_counts: Callable[[], tuple[int, int]] = lambda: (0, 0)
        """(relays connected, agents through them): the leader's relay hub says."""

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
        status.relays, status.agents_via_relays = self.relay_counts()
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
    leads = dict(speeds.leads)
    return pb.JobStatus(
        job_id=c.job.job_id,
        state=str(c.state),
        reason=c.reason,
        generation=c.generation,
        steps_committed=len(c.steps),
        steps_total=c.job.steps,
        live_replicas=[r for r, info in sorted(c.replicas.items())
                       if info.alive and r not in c.joins.joins],
        load=[pb.ReplicaLoad(replica=r, microbatches=len(ids), microbatch_s=speeds.get(r, 0.0),
                             lead_s=leads.get(r, 0.0))
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
