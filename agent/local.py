"""The agent's local channel to its workers (gRPC over a unix socket).

A worker attaches with its replica id in the call metadata; the agent answers
with `welcome` (the job) and then forwards the controller's commands. Reports
go the other way and are relayed upstream unchanged.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable

import grpc

from recover.agent.workers import WorkerProcess
from recover.proto import pb, rpc

log = logging.getLogger("recover.agent")

REPLICA_METADATA_KEY = "recover-replica"
RANK_METADATA_KEY = "recover-rank"

ATTACH_WAIT_S = 10.0
"""How long an attaching worker the agent does not know yet is waited for before it is
refused: one forked from the warm interpreter runs, and may attach, before the agent has
read its pid back (the spawn has not returned, the worker is not registered yet)."""
ATTACH_POLL_S = 0.01


class WorkerChannelService(rpc.WorkerChannelServicer):
    def __init__(
        self,
        workers: dict[int, WorkerProcess],
        job: pb.JobConfig,
        relay: Callable[[pb.WorkerReport], None],
    ) -> None:
        self._workers = workers
        self._job = job
        self._relay = relay

    def _worker_of(self, context: grpc.aio.ServicerContext) -> WorkerProcess | None:
        metadata = dict(context.invocation_metadata() or ())
        try:
            replica = int(metadata.get(REPLICA_METADATA_KEY, ""))
            rank = int(metadata.get(RANK_METADATA_KEY, "0"))
        except ValueError:
            return None
        worker = self._workers.get(replica)
        # By rank, not position: an agent holding part of a replica spanning agents runs
        # its ranks from that part's first.
        return next((p for p in worker.ranks if p.rank == rank), None) if worker else None

    async def _registered(self, context: grpc.aio.ServicerContext) -> WorkerProcess | None:
        """The attaching worker, once the agent has registered it (ATTACH_WAIT_S at most)."""
        deadline = asyncio.get_running_loop().time() + ATTACH_WAIT_S
        while (worker := self._worker_of(context)) is None \
                and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(ATTACH_POLL_S)
        return worker

    async def Attach(  # noqa: N802 (gRPC method name)
        self, request_iterator: AsyncIterator[pb.WorkerReport], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.WorkerCommand]:
        worker = await self._registered(context)
        if worker is None:
            await context.abort(grpc.StatusCode.PERMISSION_DENIED,
                                f"no worker of this agent has {REPLICA_METADATA_KEY} metadata matching")
            return

        async def read() -> None:
            try:
                async for report in request_iterator:
                    if worker.rank != 0:
                        continue  # rank 0 speaks for its replica, once all ranks agreed
                    report.replica = worker.replica  # a worker speaks only for itself
                    self._relay(report)
            except (grpc.aio.AioRpcError, asyncio.CancelledError):
                pass

        worker.attached = True
        reader = asyncio.create_task(read())
        try:
            yield pb.WorkerCommand(welcome=pb.Welcome(replica=worker.replica, job=self._job))
            while (command := await worker.commands.get()) is not None:
                yield command
        finally:
            reader.cancel()

    async def NoteFault(self, request: pb.FaultNote, context: grpc.aio.ServicerContext) -> pb.Ack:  # noqa: N802
        worker = self._worker_of(context)
        if worker is not None:
            worker.fault = pb.FaultNote()
            worker.fault.CopyFrom(request)
        return pb.Ack()

    async def ReportError(self, request: pb.WorkerError,  # noqa: N802
                          context: grpc.aio.ServicerContext) -> pb.Ack:
        worker = self._worker_of(context)
        if worker is not None:
            worker.error = pb.WorkerError()
            worker.error.CopyFrom(request)
        return pb.Ack()
