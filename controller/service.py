"""gRPC face of the controller: one stream per agent, and the user's Control API."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

import grpc

from recover.controller.coordinator import Coordinator, RegistrationRefused
from recover.proto import pb, rpc

log = logging.getLogger("recover.controller")


class AgentSessions(rpc.AgentSessionServicer):
    """Owns the per-agent outgoing queues and feeds reports into the coordinator.

    Every coordinator call runs under one lock: the coordinator awaits store
    writes mid-transition and must not interleave two transitions.
    """

    def __init__(self, coordinator: Coordinator, lock: asyncio.Lock) -> None:
        self._coordinator = coordinator
        self._lock = lock
        self._queues: dict[str, asyncio.Queue[pb.ControllerMessage | None]] = {}

    def send(self, agent_id: str, message: pb.ControllerMessage) -> None:
        queue = self._queues.get(agent_id)
        if queue is not None:
            queue.put_nowait(message)

    async def Session(  # noqa: N802 (gRPC method name)
        self, request_iterator: AsyncIterator[pb.AgentMessage], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.ControllerMessage]:
        queue: asyncio.Queue[pb.ControllerMessage | None] = asyncio.Queue()
        agent_id: str | None = None
        refused: list[str] = []

        async def read() -> None:
            nonlocal agent_id
            try:
                async for message in request_iterator:
                    kind = message.WhichOneof("kind")
                    if kind == "register" and agent_id is None:
                        reg = message.register
                        self._queues[reg.agent_id] = queue
                        async with self._lock:
                            try:
                                await self._coordinator.register_agent(
                                    reg.agent_id, reg.host, reg.slots)
                            except RegistrationRefused as refusal:
                                del self._queues[reg.agent_id]
                                refused.append(str(refusal))
                                return
                        agent_id = reg.agent_id
                    elif agent_id is None:
                        refused.append("the first message of a session must be `register`")
                        return
                    else:
                        await self._dispatch(agent_id, kind, message)
            except (grpc.aio.AioRpcError, asyncio.CancelledError):
                pass
            finally:
                queue.put_nowait(None)

        reader = asyncio.create_task(read())
        try:
            while (out := await queue.get()) is not None:
                yield out
                if out.WhichOneof("kind") == "shutdown":
                    break
            if refused:
                await context.abort(grpc.StatusCode.FAILED_PRECONDITION, refused[0])
        finally:
            reader.cancel()
            if agent_id is not None:
                self._queues.pop(agent_id, None)
                async with self._lock:
                    await self._coordinator.agent_lost(agent_id, "session closed")

    async def _dispatch(self, agent_id: str, kind: str | None, message: pb.AgentMessage) -> None:
        coordinator = self._coordinator
        if kind == "heartbeat":
            coordinator.heartbeat(agent_id)
            return
        async with self._lock:
            coordinator.heartbeat(agent_id)  # any message proves the agent alive
            if kind == "worker_exited":
                await coordinator.worker_exited(message.worker_exited)
            elif kind == "report":
                report = message.report
                which = report.WhichOneof("kind")
                if which == "reduced":
                    await coordinator.reduced(report.replica, report.reduced)
                elif which == "applied":
                    await coordinator.applied(report.replica, report.applied)
                elif which == "resumed":
                    await coordinator.resumed(report.replica, report.resumed)
                elif which == "ready":
                    await coordinator.worker_ready(report.replica, report.ready)


class ControlService(rpc.ControlServicer):
    """Read-only user API: status, events, the run's report."""

    def __init__(self, coordinator: Coordinator) -> None:
        self._coordinator = coordinator

    async def Status(self, request: pb.StatusRequest, context: object) -> pb.JobStatus:  # noqa: N802
        return job_status(self._coordinator)

    async def Events(self, request: pb.EventsRequest, context: object) -> pb.EventList:  # noqa: N802
        return pb.EventList(events=self._coordinator.events.since(request.after_seq))

    async def Report(self, request: pb.ReportRequest, context: object) -> pb.RunReport:  # noqa: N802
        c = self._coordinator
        return pb.RunReport(
            job=c.job, status=job_status(c), steps=c.steps, failures=c.failures,
            started_at=c.started_at, finished_at=c.finished_at)


def job_status(c: Coordinator) -> pb.JobStatus:
    now = c.finished_at or c.now()
    return pb.JobStatus(
        job_id=c.job.job_id,
        state=str(c.state),
        reason=c.reason,
        generation=c.generation,
        steps_committed=len(c.steps),
        steps_total=c.job.steps,
        live_replicas=[r for r, info in sorted(c.replicas.items()) if info.alive],
        load=[pb.ReplicaLoad(replica=r, microbatches=len(ids)) for r, ids in sorted(c.plan.items())],
        recoveries=c.recoveries,
        last_loss=c.steps[-1].loss if c.steps else 0.0,
        tokens=sum(s.tokens for s in c.steps),
        elapsed_s=now - c.started_at if c.started_at else 0.0,
        agents=sum(a.alive for a in c.agents.values()),
        redos=c.redos,
    )
