"""The agent's local channel (agent/local.py): a worker forked from the warm interpreter can
attach before the agent has registered it (its spawn has not returned yet); it is waited
for, not refused. Seen in a clean-clone suite run: a sharded replica's rank 0 refused with
PERMISSION_DENIED, and the resumed job failed at its start. In-process: the real service on
a real gRPC server over a unix socket; the registration is delayed on purpose."""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace

import grpc
import pytest

from recover.agent import local
from recover.agent.local import REPLICA_METADATA_KEY, WorkerChannelService
from recover.agent.workers import WorkerProcess
from recover.proto import pb, rpc


async def attach(tmp_path: Path, register_after_s: float | None) -> pb.WorkerCommand:
    """A worker of replica 7 attaches; the agent registers it `register_after_s` later
    (None: never). Returns the first command the worker gets."""
    workers: dict[int, WorkerProcess] = {}
    server = grpc.aio.server()
    rpc.add_WorkerChannelServicer_to_server(
        WorkerChannelService(workers, pb.JobConfig(job_id="j"), lambda report: None), server)
    socket_path = tmp_path / "workers.sock"
    server.add_insecure_port(f"unix:{socket_path}")
    await server.start()

    async def register() -> None:
        if register_after_s is not None:
            await asyncio.sleep(register_after_s)
            workers[7] = WorkerProcess(7, 0, SimpleNamespace(pid=1))  # type: ignore[arg-type]

    registering = asyncio.create_task(register())
    try:
        async with grpc.aio.insecure_channel(f"unix:{socket_path}") as channel:
            call = rpc.WorkerChannelStub(channel).Attach(
                iter(()), metadata=((REPLICA_METADATA_KEY, "7"),))
            return await call.read()
    finally:
        registering.cancel()
        await server.stop(None)


def test_a_worker_attaching_before_it_is_registered_is_welcomed(tmp_path: Path) -> None:
    first = asyncio.run(attach(tmp_path, register_after_s=0.3))
    assert first.WhichOneof("kind") == "welcome" and first.welcome.replica == 7


def test_a_worker_the_agent_never_registers_is_refused(tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(local, "ATTACH_WAIT_S", 0.3)
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        asyncio.run(attach(tmp_path, register_after_s=None))
    assert refused.value.code() is grpc.StatusCode.PERMISSION_DENIED
