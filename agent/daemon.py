"""The per-host agent: registers its slots, runs the workers, relays both ways.

One bidirectional stream to the controller carries registration, heartbeats,
worker exits and reports up, and generations, commits and shutdown down. A
worker's exit is reported the moment the child is reaped (no polling), which
is what makes a crash visible to the controller within milliseconds.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import tempfile
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from prometheus_client import CollectorRegistry, start_http_server

from recover.agent.local import WorkerChannelService
from recover.agent.metrics import AgentCollector
from recover.agent.workers import WorkerProcess, exit_report, spawn_worker, stop_workers
from recover.common import progress
from recover.proto import pb, rpc

log = logging.getLogger("recover.agent")


class AgentError(Exception):
    """The agent cannot go on; the message says why, for a one-line error."""


@dataclass(frozen=True)
class AgentConfig:
    controller: str
    """host:port of the controller."""
    slots: int
    """Worker slots on this host (one worker, one replica each)."""
    command: list[str]
    """The worker command, e.g. ['python', '-m', 'recover.trainer.worker']."""
    agent_id: str = field(default_factory=lambda: f"{socket.gethostname()}-{uuid.uuid4().hex[:6]}")
    """Unique name of this agent in the job."""
    heartbeat_s: float = 0.5
    """Heartbeat period; the controller declares an agent lost after a few missed ones."""
    connect_timeout_s: float = 10.0
    """How long to wait for the controller to answer at start."""
    log_dir: str | None = None
    """Write each worker's output to LOG_DIR/replica-N.log instead of inheriting stdout."""
    shutdown_grace_s: float = 5.0
    """How long workers get to exit on their own when the job ends."""
    metrics_port: int | None = None
    """Serve Prometheus metrics on 127.0.0.1:PORT/metrics (0: any free port; None: off)."""
    metrics_host: str = "127.0.0.1"
    """Address the metrics endpoint listens on."""


class Agent:
    def __init__(self, config: AgentConfig) -> None:
        self.config = config
        self._upstream: asyncio.Queue[pb.AgentMessage | None] = asyncio.Queue()
        self.workers: dict[int, WorkerProcess] = {}
        self._members: set[int] = set()
        self.generation = 0
        self._shutdown: pb.Shutdown | None = None
        self.heartbeats_sent = 0
        self.reports_relayed = 0
        self.metrics_port: int | None = None

    def relay(self, report: pb.WorkerReport) -> None:
        self.reports_relayed += 1
        self._upstream.put_nowait(pb.AgentMessage(report=report))

    def _serve_metrics(self) -> None:
        registry = CollectorRegistry()
        registry.register(AgentCollector(self))
        server, _ = start_http_server(self.config.metrics_port or 0, self.config.metrics_host,
                                      registry=registry)
        self.metrics_port = server.server_port
        log.info("metrics on http://%s:%d/metrics", self.config.metrics_host, self.metrics_port)

    async def _requests(self) -> AsyncIterator[pb.AgentMessage]:
        while (message := await self._upstream.get()) is not None:
            yield message

    async def run(self) -> int:
        cfg = self.config
        if cfg.metrics_port is not None:
            self._serve_metrics()
        channel = grpc.aio.insecure_channel(cfg.controller)
        try:
            await asyncio.wait_for(channel.channel_ready(), cfg.connect_timeout_s)
        except TimeoutError:
            await channel.close()
            raise AgentError(f"cannot reach the controller at {cfg.controller} "
                             f"(nothing answered within {cfg.connect_timeout_s:.0f}s)") from None
        self._upstream.put_nowait(pb.AgentMessage(register=pb.RegisterAgent(
            agent_id=cfg.agent_id, host=socket.gethostname(), slots=cfg.slots)))
        call = rpc.AgentSessionStub(channel).Session(self._requests())
        tasks: list[asyncio.Task[None]] = []
        server: grpc.aio.Server | None = None
        with tempfile.TemporaryDirectory(prefix="recover-agent-") as socket_dir:
            try:
                first = await call.read()
                if first is grpc.aio.EOF or first.WhichOneof("kind") != "registered":
                    raise AgentError("the controller closed the session before registering us")
                registered = first.registered
                server, address = await self._serve_workers(registered.job, Path(socket_dir))
                await self._spawn(list(registered.replica_ids), registered.job, address,
                                  Path(socket_dir))
                tasks = [asyncio.create_task(self._heartbeat()),
                         asyncio.create_task(self._watchdog(registered.job))]
                tasks += [asyncio.create_task(self._watch(w)) for w in self.workers.values()]
                while (message := await call.read()) is not grpc.aio.EOF:
                    if self._handle(message):
                        break
            except grpc.aio.AioRpcError as exc:
                if self._shutdown is None:
                    raise AgentError(f"controller session ended: {exc.details() or exc.code().name}"
                                     ) from None
            finally:
                for task in tasks:
                    task.cancel()
                await stop_workers(list(self.workers.values()), cfg.shutdown_grace_s
                                   if self._shutdown is not None else 0.0)
                self._upstream.put_nowait(None)
                if server is not None:
                    await server.stop(grace=0.2)
                await channel.close()
        if self._shutdown is None:
            raise AgentError("the controller closed the session without a shutdown")
        log.info("job ended: %s", self._shutdown.reason)
        return 0 if self._shutdown.success else 1

    async def _serve_workers(self, job: pb.JobConfig, socket_dir: Path) -> tuple[grpc.aio.Server, str]:
        server = grpc.aio.server()
        rpc.add_WorkerChannelServicer_to_server(
            WorkerChannelService(self.workers, job, self.relay), server)
        address = f"unix:{socket_dir / 'workers.sock'}"
        server.add_insecure_port(address)
        await server.start()
        return server, address

    async def _spawn(self, replicas: list[int], job: pb.JobConfig, address: str,
                     run_dir: Path) -> None:
        log_dir = Path(self.config.log_dir) if self.config.log_dir else None
        for slot, replica in enumerate(replicas):
            self.workers[replica] = await spawn_worker(
                self.config.command, replica=replica, slot=slot, agent_id=self.config.agent_id,
                agent_address=address, job_id=job.job_id, log_dir=log_dir,
                progress_path=run_dir / f"progress-{replica}.bin")
            log.info("spawned worker pid %d", self.workers[replica].pid, extra={"replica": replica})

    async def _watch(self, worker: WorkerProcess) -> None:
        returncode = await worker.process.wait()
        worker.commands.put_nowait(None)
        if self._shutdown is not None:
            return
        report = exit_report(worker, returncode)
        self._upstream.put_nowait(pb.AgentMessage(worker_exited=report))
        log.warning("worker exited (code %d, signal %d)", report.exit_code, report.signal,
                    extra={"replica": worker.replica})

    async def _watchdog(self, job: pb.JobConfig) -> None:
        """Kill workers that stopped making progress; their exit is then a plain crash."""
        timeout_s = job.hang_timeout_s or 2.0
        factor = job.hang_factor or 10.0
        while True:
            await asyncio.sleep(progress.BEAT_PERIOD_S)
            now = time.monotonic()
            for worker in self.workers.values():
                if worker.process.returncode is not None or worker.killed_by_agent:
                    continue
                snapshot = progress.read(worker.progress_path) if worker.progress_path else None
                if snapshot is None:
                    continue
                verdict = progress.judge(snapshot, now, timeout_s, factor)
                if verdict.hung:
                    worker.killed_by_agent = f"watchdog: {verdict.reason}"
                    log.warning("killing hung worker: %s", verdict.reason,
                                extra={"replica": worker.replica})
                    try:
                        worker.process.kill()
                    except ProcessLookupError:
                        pass

    async def _heartbeat(self) -> None:
        while True:
            self._upstream.put_nowait(pb.AgentMessage(heartbeat=pb.Heartbeat(sent_at=time.time())))
            self.heartbeats_sent += 1
            await asyncio.sleep(self.config.heartbeat_s)

    def _handle(self, message: pb.ControllerMessage) -> bool:
        """Forward one controller message to the workers; True when the job is over."""
        kind = message.WhichOneof("kind")
        if kind == "generation":
            view = message.generation
            if view.generation <= self.generation:
                return False  # fenced: never go back to an older view
            self.generation = view.generation
            self._members = set(view.members)
            self._forward(pb.WorkerCommand(generation=view))
        elif kind == "commit":
            if message.commit.generation == self.generation:
                self._forward(pb.WorkerCommand(commit=message.commit))
        elif kind == "shutdown":
            self._shutdown = message.shutdown
            for worker in self.workers.values():
                worker.commands.put_nowait(pb.WorkerCommand(shutdown=message.shutdown))
            return True
        return False

    def _forward(self, command: pb.WorkerCommand) -> None:
        for replica in self._members:
            worker = self.workers.get(replica)
            if worker is not None and worker.process.returncode is None:
                worker.commands.put_nowait(command)
