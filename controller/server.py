"""Run the controller: gRPC server, rendezvous store, liveness loop."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
from dataclasses import dataclass
from pathlib import Path

import grpc
from prometheus_client import CollectorRegistry, start_http_server

from recover.controller.coordinator import Coordinator, JobState
from recover.controller.metrics import ControllerCollector
from recover.controller.rendezvous import RendezvousHost
from recover.controller.service import AgentSessions, ControlService
from recover.controller.store import Store, StoreError, open_store
from recover.proto import pb, rpc

log = logging.getLogger("recover.controller")


@dataclass(frozen=True)
class ControllerConfig:
    host: str = "127.0.0.1"
    """Address the gRPC server and the rendezvous store listen on (and advertise)."""
    port: int = 0
    """gRPC port; 0 picks a free one (see `port_file`)."""
    port_file: str | None = None
    """Where to write the chosen gRPC port once listening, for launchers and scripts."""
    store_url: str = "memory://"
    """Where durable state lives: `memory://` (embedded, the default)."""
    agent_timeout_s: float = 3.0
    """An agent silent for longer than this is declared lost with its replicas."""
    start_timeout_s: float = 120.0
    """Fail the job if not every replica is ready this long after the controller starts."""
    linger_s: float | None = None
    """Exit this long after the job ends (None: serve status until signalled)."""
    metrics_port: int | None = None
    """Serve Prometheus metrics on http://host:PORT/metrics (0: any free port; None: off)."""


async def wait_for_store(store: Store, url: str, retry_s: float = 2.0) -> None:
    """Block until the store answers, saying clearly what is wrong meanwhile."""
    ping = getattr(store, "ping", None)
    if ping is None:
        return
    while True:
        try:
            await ping()
            return
        except StoreError as exc:
            log.error("store not reachable (%s); retrying in %.0fs", exc, retry_s)
            await asyncio.sleep(retry_s)


async def serve(config: ControllerConfig, job: pb.JobConfig) -> int:
    """Serve until signalled (or `linger_s` after the job ends); exit code 0 unless it failed."""
    rendezvous = RendezvousHost(config.host)
    store = open_store(config.store_url)
    await wait_for_store(store, config.store_url)
    lock = asyncio.Lock()
    sessions: AgentSessions | None = None

    def send(agent_id: str, message: pb.ControllerMessage) -> None:
        assert sessions is not None
        sessions.send(agent_id, message)

    coordinator = Coordinator(job, store, send, rendezvous.address,
                              agent_timeout_s=config.agent_timeout_s)
    coordinator.start_timeout_s = config.start_timeout_s
    sessions = AgentSessions(coordinator, lock)
    server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
    rpc.add_AgentSessionServicer_to_server(sessions, server)
    rpc.add_ControlServicer_to_server(ControlService(coordinator), server)
    try:
        port = server.add_insecure_port(f"{config.host}:{config.port}")
    except RuntimeError as exc:
        raise OSError(f"cannot listen on {config.host}:{config.port}: {exc}") from None
    await server.start()
    metrics_port = None
    if config.metrics_port is not None:
        registry = CollectorRegistry()
        registry.register(ControllerCollector(coordinator))
        metrics_server, _ = start_http_server(config.metrics_port, config.host, registry=registry)
        metrics_port = metrics_server.server_port
        log.info("metrics on http://%s:%d/metrics", config.host, metrics_port)
    if config.port_file:
        tmp = Path(f"{config.port_file}.tmp")
        tmp.write_text(str(port))
        os.replace(tmp, config.port_file)
    log.info("controller listening on %s:%d (rendezvous %s, store %s)",
             config.host, port, rendezvous.address, config.store_url)

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)

    async def watch_liveness() -> None:
        while True:
            await asyncio.sleep(0.25)
            async with lock:
                await coordinator.check_liveness()
                await coordinator.events.flush()

    async def linger_after_done() -> None:
        await coordinator.done.wait()
        if config.linger_s is not None:
            await asyncio.sleep(config.linger_s)
            stop.set()

    tasks = [asyncio.create_task(watch_liveness()), asyncio.create_task(linger_after_done())]
    try:
        await stop.wait()
    finally:
        for task in tasks:
            task.cancel()
        await server.stop(grace=0.5)
        await store.close()
        rendezvous.close()
    with contextlib.suppress(Exception):
        await coordinator.events.flush()
    return 1 if coordinator.state is JobState.FAILED else 0
