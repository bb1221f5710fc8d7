"""Run the controller: gRPC server, rendezvous store, liveness loop."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import signal
import socket
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import grpc
from prometheus_client import CollectorRegistry, start_http_server

from recover.common import ckptfile
from recover.common.explain import exposure
from recover.common.netaddr import is_loopback, write_port_file
from recover.common.security import Authenticator, Security, server_credentials
from recover.controller.control import ControlService, run_report
from recover.controller.coordinator import Coordinator, JobState
from recover.controller.gate import Gate, add_service
from recover.controller.leader import ElectionConfig, LeaderElection, LeaderStore, LostLeadership
from recover.controller.metrics import ControllerCollector, RoleCollector
from recover.controller.records import Records
from recover.controller.relayed import RelayHub
from recover.controller.rendezvous import MAX_KEYS, MAX_MB, RendezvousHost
from recover.controller.service import KEEPALIVE_SERVER_OPTIONS, AgentSessions
from recover.controller.store import Store, StoreError
from recover.controller.store_url import open_store
from recover.controller.summary import build_summary, write_summary
from recover.proto import pb

log = logging.getLogger("recover.controller")

T = TypeVar("T")

FINISHED = "the job ended and the linger time is over"


@dataclass(frozen=True)
class ControllerConfig:
    host: str = "127.0.0.1"
    """Address the gRPC server and the rendezvous store listen on (and advertise)."""
    port: int = 0
    """gRPC port; 0 picks a free one (see `port_file`)."""
    port_file: str | None = None
    """Where to write the chosen gRPC port once listening, for launchers and scripts."""
    store_url: str = "memory://"
    """Where durable state lives: `memory://` (embedded, the default) or `etcd://HOST:PORT[,...]`
    (shared by every controller of the job: one leads, the others stand by)."""
    agent_timeout_s: float = 3.0
    """An agent silent for longer than this is declared lost with its replicas."""
    start_timeout_s: float = 120.0
    """Fail the job if not every replica is ready this long after the controller starts."""
    linger_s: float | None = None
    """Exit this long after the job ends (None: serve status until signalled)."""
    metrics_port: int | None = None
    """Serve Prometheus metrics on http://METRICS_HOST:PORT/metrics (0: any free port; None:
    off). Under TLS the endpoint is HTTPS, with client certificates when `security.ca` is set."""
    metrics_host: str | None = None
    """Address the metrics endpoint listens on (None: `host`)."""
    metrics_port_file: str | None = None
    """Write the metrics endpoint's port here once it listens (for a launcher or a scraper's
    file-based discovery)."""
    metrics_plain: bool = False
    """Serve metrics over plain HTTP even when the controller serves TLS (a scraper on a
    trusted network or loopback); by default they are as secured as the gRPC server."""
    advertise: str | None = None
    """host:port agents and users reach this controller at (default: host and the bound port)."""
    controller_id: str | None = None
    """This controller's name in the election (default: hostname-pid)."""
    lease_ttl_s: int = 2
    """Leader lease TTL in seconds: a crashed leader is replaced about this long after."""
    summary_dir: str | None = None
    """Write SUMMARY_DIR/summary.json when the job ends (None: don't)."""
    start_grace_s: float = 10.0
    """After a worker failed during startup: how long its replacement gets before the job
    starts with fewer replicas (admission.start_decision)."""
    rendezvous_max_mb: int = MAX_MB
    """Memory the rendezvous store may take in beyond its own (a stranger's flood is refused
    there); at half of it the store is reset (controller/rendezvous_store.py)."""
    rendezvous_max_keys: int = MAX_KEYS
    """Keys the rendezvous store may hold before it is reset."""
    security: Security = Security()
    """TLS / mutual TLS / bearer tokens for the gRPC server and the metrics endpoint
    (common/security.py); empty: plaintext, anyone who reaches the port is anonymous."""


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


def metrics_tls(security: Security, plain: bool) -> dict[str, Any]:
    """How the metrics endpoint is secured (prometheus-client's start_http_server options):
    as the gRPC server is (HTTPS; client certificates of the CA when it has one), unless
    the operator chose plain HTTP for it."""
    if not security.cert or plain:
        return {}
    return dict(certfile=security.cert, keyfile=security.key, client_cafile=security.ca or None,
                client_auth_required=bool(security.ca))


async def serve(config: ControllerConfig, job: pb.JobConfig) -> int:
    """Serve until signalled (or `linger_s` after the job ends); exit code 0 unless it failed.

    With a store shared by several controllers this one leads only while it
    holds the leader lease; otherwise it stands by (answers status, refuses
    agent sessions with the leader's address) and takes over when it can.
    """
    rendezvous = RendezvousHost(config.host, max_mb=config.rendezvous_max_mb,
                                max_keys=config.rendezvous_max_keys)
    store = open_store(config.store_url)
    await wait_for_store(store, config.store_url)
    security = config.security
    sessions = AgentSessions(Gate(Authenticator(security) if security.enabled else None))
    control = ControlService(sessions)
    server = grpc.aio.server(options=[("grpc.so_reuseport", 0), *KEEPALIVE_SERVER_OPTIONS])
    add_service(server, sessions, "AgentSession", {"Session": sessions.serializer})
    add_service(server, control, "Control")
    relays = RelayHub(sessions)
    add_service(server, relays, "RelayLink", {"Relay": relays.encoder})
    control.relay_counts = relays.counts
    listen = f"{config.host}:{config.port}"
    try:
        port = (server.add_secure_port(listen, server_credentials(security)) if security.tls
                else server.add_insecure_port(listen))
    except RuntimeError as exc:
        raise OSError(f"cannot listen on {listen}: {exc}") from None
    exposed = exposure(security, is_loopback(config.host))
    if exposed:
        log.warning("listening on %s %s", listen, exposed)
    await server.start()
    address = config.advertise or f"{config.host}:{port}"
    election = LeaderElection(store, job.job_id, address, config.controller_id or
                              f"{socket.gethostname()}-{os.getpid()}",
                              ElectionConfig(ttl_s=config.lease_ttl_s))
    sessions.election = control.election = election
    registry = CollectorRegistry()
    registry.register(RoleCollector(election, rendezvous))
    if config.metrics_port is not None:
        tls = metrics_tls(security, config.metrics_plain)
        metrics_host = config.metrics_host or config.host
        metrics_server, _ = start_http_server(config.metrics_port, metrics_host, registry=registry,
                                              **tls)
        log.info("metrics on %s://%s:%d/metrics", "https" if tls else "http", metrics_host,
                 metrics_server.server_port)
        if config.metrics_port_file:
            write_port_file(config.metrics_port_file, metrics_server.server_port)
    if config.port_file:
        write_port_file(config.port_file, port)
    log.info("controller %s listening on %s (rendezvous %s, store %s)", election.controller_id,
             address, rendezvous.address, config.store_url)

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    coordinator: Coordinator | None = None
    try:
        while not stop.is_set():
            if await _until(election.campaign(), stop) is None:
                break
            coordinator = await _lead(config, job, election, sessions, rendezvous, registry,
                                      relays.counts)
            ended = await _until(_serve_term(config, coordinator, election, sessions, relays),
                                 stop)
            if ended is None or ended == FINISHED:
                break
            # Deposed: this term's state is stale; drop it and stand by again.
            log.warning("standing down from term %d: %s", election.term, ended,
                        extra={"term": election.term})
            sessions.release()
            coordinator = None
            election.stand_by()
    finally:
        with contextlib.suppress(Exception):
            if coordinator is not None and election.holds():
                await coordinator.events.flush()
        # Bounded: with the store gone, shutting down must not hang on it.
        with contextlib.suppress(Exception):
            await asyncio.wait_for(election.resign(), 2.0)  # a standby takes over at once
        await election.close()
        sessions.release()
        await server.stop(grace=0.5)
        with contextlib.suppress(Exception):
            await asyncio.wait_for(store.close(), 2.0)
        rendezvous.close()
    return 1 if coordinator is not None and coordinator.state is JobState.FAILED else 0


async def _until(work: Coroutine[object, object, T], stop: asyncio.Event) -> T | None:
    """Run `work` until it returns (its result) or `stop` is set (None)."""
    task = asyncio.ensure_future(work)
    stopper = asyncio.ensure_future(stop.wait())
    await asyncio.wait({task, stopper}, return_when=asyncio.FIRST_COMPLETED)
    stopper.cancel()
    if not task.done():
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        return None
    return task.result()


def _resume_point(job: pb.JobConfig) -> pb.CheckpointMeta | None:
    """The checkpoint a resumed job starts from (its header authenticated again: the file may
    have changed since the launcher chose it); OSError, one line, when it cannot be."""
    if not job.resume.path:
        return None
    try:
        meta = ckptfile.read_meta(Path(job.resume.path), verify=False)[0]
    except ckptfile.CheckpointError as exc:
        raise OSError(f"cannot resume from {job.resume.path}: {exc}") from None
    if meta.step != job.resume.step:
        raise OSError(f"cannot resume from {job.resume.path}: it holds step {meta.step}, "
                      f"the job resumes at step {job.resume.step}")
    return meta


async def _lead(config: ControllerConfig, job: pb.JobConfig, election: LeaderElection,
                sessions: AgentSessions, rendezvous: RendezvousHost,
                registry: CollectorRegistry,
                relay_counts: Callable[[], tuple[int, int]]) -> Coordinator:
    """Start a term: a coordinator on fenced writes, rebuilt from the store if a job is there."""
    store = LeaderStore(election)
    coordinator = Coordinator(job, store, sessions.send, rendezvous.address,
                              agent_timeout_s=config.agent_timeout_s, send_all=sessions.send_all)
    coordinator.start_timeout_s = config.start_timeout_s
    coordinator.start_grace_s = config.start_grace_s
    persisted = await Records(store, job.job_id).load()
    resumed_from = _resume_point(job)
    if not persisted.empty:
        coordinator.restore(persisted, resumed_from)
    elif resumed_from is not None:
        coordinator.resume_from(resumed_from)
    sessions.lead(coordinator)
    with contextlib.suppress(KeyError):
        registry.unregister(sessions.collector)  # type: ignore[arg-type]
    sessions.collector = ControllerCollector(coordinator, election.term, relay_counts)
    registry.register(sessions.collector)
    return coordinator


async def _serve_term(config: ControllerConfig, coordinator: Coordinator,
                      election: LeaderElection, sessions: AgentSessions,
                      relays: RelayHub) -> str:
    """Lead until leadership is lost (returns why) or the job is over and lingered (FINISHED)."""

    frozen = False

    async def watch_liveness() -> str:
        nonlocal frozen
        while True:
            await asyncio.sleep(0.25)
            if not frozen and coordinator.state is JobState.RUNNING:
                # The job's state as it starts (a view of every agent and replica, their
                # sessions) lives as long as the term: left to the collector, a full
                # collection walked all of it (~50 ms at 12,500 agents, in the middle of a
                # loss's reaction) to free nothing (BENCHMARKS.md 5). Frozen, collections
                # walk only what came later. What it costs: cyclic garbage among these
                # objects (a start-time agent's session once it ends) waits for the term's
                # end (unfrozen then), at most once per agent of the start. Collected first,
                # so that no garbage of the start-up is frozen with them.
                gc.collect()
                gc.freeze()
                frozen = True
                log.info("job running: %d objects of its start frozen for the garbage "
                         "collector", gc.get_freeze_count())
            sessions.beat()
            if election.holds():
                relays.beat(election.term)
            async with sessions.lock:
                try:
                    await coordinator.check_liveness()
                    await coordinator.events.flush()
                except LostLeadership as exc:
                    return str(exc)

    async def linger_after_done() -> str:
        await coordinator.done.wait()
        if config.summary_dir is not None:
            report = run_report(coordinator)
            try:
                path = write_summary(build_summary(report, coordinator.now() - coordinator.created_at),
                                     config.summary_dir)
                log.info("wrote %s", path)
            except OSError as exc:
                log.error("cannot write the summary to %s: %s", config.summary_dir, exc)
        await asyncio.sleep(config.linger_s if config.linger_s is not None else 1e9)
        return FINISHED

    async def deposed() -> str:
        await sessions.deposed.wait()
        return "a fenced write or send was refused"

    tasks = [asyncio.create_task(t) for t in (election.keep_leading(), watch_liveness(),
                                              deposed(), linger_after_done())]
    try:
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        return next(iter(done)).result()
    finally:
        for task in tasks:
            task.cancel()
        if frozen:  # this term's coordinator (a cycle) must be collectable once it is gone
            gc.unfreeze()
