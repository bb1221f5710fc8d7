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
from collections.abc import Iterable
from functools import partial
from pathlib import Path

import grpc

from recover.agent import fencing
from recover.agent.attached import AttachedProcess, write_attach_file
from recover.agent.beats import beat_when_silent
from recover.agent.config import AgentConfig, AgentError
from recover.agent.link import LinkError, Session, close_session, open_session
from recover.agent.local import WorkerChannelService
from recover.agent.metrics import serve_metrics
from recover.agent.replays import ReportReplays
from recover.agent.restarts import decide_restart, recent_restarts
from recover.agent.warmstart import WarmStarter, settle_warm
from recover.agent.watchdog import watch_for_hangs
from recover.agent.workers import (
    ReplicaPart,
    WorkerProcess,
    base_environment,
    every_process,
    listen_for_replica_store,
    lose_replica,
    resolve_command,
    spawn_replica,
    spawned,
    stop_replica,
    stop_workers,
    store_from_here,
    waiting_note,
)
from recover.common.netaddr import local_address_towards
from recover.proto import pb, rpc

log = logging.getLogger("recover.agent")
RETRY_REQUEST_S = 1.0
"""Pause before asking again for a replica the controller could not grant yet (a takeover)."""


class Agent:
    def __init__(self, config: AgentConfig) -> None:
        self.config = config
        self._upstream: asyncio.Queue[pb.AgentMessage | None] = asyncio.Queue()
        self._sent_up_at = 0.0
        """When we last sent the leader anything (monotonic): any message shows we live."""
        self.workers: dict[int, WorkerProcess] = {}
        self._members: set[int] = set()
        self.generation = 0
        self._shutdown: pb.Shutdown | None = None
        self.heartbeats_sent = 0
        self.reports_relayed = 0
        self.term = 0
        """Highest leadership term seen: commands from a lower one are refused."""
        self.fenced_commands = 0
        self.reconnects = 0
        self._replays = ReportReplays()
        self.metrics_port: int | None = None
        self.restarts: dict[int, list[float]] = {}
        """Per slot: when (monotonic) its workers were restarted, within the window."""
        self._job = pb.JobConfig()
        self._channel_address = ""
        self._run_dir = Path()
        self._transfer_host = "127.0.0.1"
        self._control_host = ""  # of the controller (or relay) this agent's session is with
        self._tasks: list[asyncio.Task[None]] = []
        self._warm: WarmStarter | None = None
        self._starting: set[int] = set()
        """Replicas whose worker is being started (the warm interpreter may still import)."""
        self._store_socket: socket.socket | None = None
        """Where rank 0 of a replica spanning agents serves its store, if it is here."""

    def relay(self, report: pb.WorkerReport) -> None:
        self._replays.note(report)
        self.reports_relayed += 1
        self._send_up(pb.AgentMessage(report=report))

    def _registration(self, resume: bool) -> pb.AgentMessage:
        """The first message of a session: register, or rejoin a new leader with live workers."""
        cfg = self.config
        # A replica still starting counts: it reports ready to whichever leader listens then.
        live = sorted({r for r, w in self.workers.items() if w.process.returncode is None}
                      | self._starting)
        return pb.AgentMessage(register=pb.RegisterAgent(
            agent_id=cfg.agent_id, host=socket.gethostname(), slots=cfg.slots, resume=resume,
            replica_ids=live if resume else [], term=self.term, generation=self.generation,
            replica_store_port=self._store_socket.getsockname()[1] if self._store_socket else 0))

    async def _connect(self, resume: bool, lost: str | None = None) -> Session:
        cfg = self.config
        timeout = cfg.reconnect_timeout_s if resume else cfg.connect_timeout_s
        try:
            session = await open_session(cfg.controllers, [self._registration(resume)], timeout,
                                         lost=lost, security=cfg.security)
        except LinkError as exc:
            raise AgentError(str(exc)) from None
        self.term = max(self.term, session.term)
        self._upstream = session.upstream
        host, _, port = session.address.rpartition(":")
        self._transfer_host = local_address_towards(host, int(port)) or "127.0.0.1"
        self._control_host = host
        if resume:  # what the leader may not have had (replays.py); no await since the swap
            for report in self._replays.for_new_leader(started=bool(self.generation)):
                self._send_up(pb.AgentMessage(report=report))
            for request in self._replays.requests():
                self._send_up(request)
        return session

    async def run(self) -> int:
        cfg = self.config
        if cfg.metrics_port is not None:
            self.metrics_port = serve_metrics(self, cfg.metrics_host, cfg.metrics_port,
                                              cfg.metrics_port_file)
        self._store_socket = listen_for_replica_store()
        await self._start_warm()  # its imports (seconds) run while we connect
        try:
            session = await self._connect(resume=False)
        except BaseException:
            await self._close_warm()
            raise
        server: grpc.aio.Server | None = None
        with tempfile.TemporaryDirectory(prefix="recover-agent-") as socket_dir:
            try:
                registered = session.registered
                self._job, self._run_dir = registered.job, Path(socket_dir)
                server, self._channel_address = await self._serve_workers(registered.job,
                                                                          self._run_dir)
                await self._decide_warm()
                # Heartbeats first: the first spawn may wait seconds for the warm
                # interpreter's imports on a busy host.
                beats = beat_when_silent(cfg.heartbeat_s, lambda: self._sent_up_at, self._beat)
                self._tasks += [asyncio.create_task(beats),
                                asyncio.create_task(watch_for_hangs(self.workers, registered.job))]
                ranks = max(registered.job.ranks_per_replica, 1)
                if ranks <= cfg.slots and self._store_socket is not None:
                    if self._warm is not None:  # no replica spans agents: no worker needs it
                        self._warm.forget(self._store_socket.fileno())
                    self._store_socket.close()
                    self._store_socket = None
                # Started in the background: the first start may wait seconds for the warm
                # interpreter, and meanwhile the session must be read (a leader lost during
                # the start is noticed, and the next one joined, at once).
                self._starting.update(registered.replica_ids)
                self._tasks.append(asyncio.create_task(self._spawn_all(
                    [(index * ranks, replica)
                     for index, replica in enumerate(registered.replica_ids)])))
                if (note := waiting_note(cfg.slots, ranks, len(registered.replica_ids))):
                    log.info("%s", note)
                while not await self._pump(session):
                    # The leader is gone (or stood down): the workers keep going
                    # while we find the new one and rejoin it.
                    await close_session(session)
                    log.warning("lost the session with the controller at %s; looking for the "
                                "leader", session.address)
                    self.reconnects += 1
                    session = await self._connect(resume=True, lost=session.address)
            finally:
                for task in self._tasks:
                    task.cancel()
                await stop_workers(every_process(self.workers), cfg.shutdown_grace_s
                                   if self._shutdown is not None else 0.0)
                await self._close_warm()
                self._upstream.put_nowait(None)
                if server is not None:
                    await server.stop(grace=0.2)
                await close_session(session)
                if self._store_socket is not None:
                    self._store_socket.close()
        assert self._shutdown is not None
        log.info("job ended: %s", self._shutdown.reason)
        return 0 if self._shutdown.success else 1

    async def _pump(self, session: Session) -> bool:
        """Forward the leader's commands until the job ends (True) or the session does (False)."""
        timeout = self.config.leader_timeout_s
        try:
            while (message := await asyncio.wait_for(session.call.read(), timeout)
                   ) is not grpc.aio.EOF:
                if self._handle(message):
                    return True
        except grpc.aio.AioRpcError as exc:
            log.warning("controller session failed: %s", exc.details() or exc.code().name)
        except TimeoutError:
            log.warning("the controller at %s was silent for %.1fs", session.address, timeout)
        return False

    async def _serve_workers(self, job: pb.JobConfig, socket_dir: Path) -> tuple[grpc.aio.Server, str]:
        server = grpc.aio.server()
        rpc.add_WorkerChannelServicer_to_server(
            WorkerChannelService(self.workers, job, self.relay), server)
        address = f"unix:{socket_dir / 'workers.sock'}"
        server.add_insecure_port(address)
        await server.start()
        return server, address

    def _worker_command(self) -> list[str]:
        command = self.config.command or list(self._job.workload.command)
        if not command:
            raise AgentError("the job names no worker command: give one after `--`")
        return command

    async def _start_warm(self) -> None:
        """Start the warm interpreter before the job is known: its imports are most of a
        worker's start. Whether the job's command can use it is decided once registered."""
        if self.config.attach_pid is not None or not self.config.warm_start:
            return
        self._warm = WarmStarter.for_agent(base_environment(), self.config.log_dir,
                                           self.config.agent_id)
        await self._warm.start(() if self._store_socket is None
                               else (self._store_socket.fileno(),))

    async def _decide_warm(self) -> None:
        """Fork the job's workers from the warm interpreter if its command allows (else end
        the interpreter: the workers start cold)."""
        if self.config.attach_pid is None:
            self._warm = await settle_warm(self._warm, resolve_command(self._worker_command()),
                                           self.config.warm_start)

    async def _close_warm(self) -> None:
        if self._warm is not None:
            await self._warm.close()
            self._warm = None

    async def _spawn_all(self, slots: list[tuple[int, int]]) -> None:
        """Start these (slot, replica) workers one after the other."""
        for slot, replica in slots:
            await self._spawn(slot, replica)

    async def _spawn(self, slot: int, replica: int,
                     assigned: pb.ReplicaAssigned | None = None) -> None:
        """Start the worker of `replica` on `slot` and watch it."""
        self._starting.add(replica)
        try:
            await self._start_replica(slot, replica, assigned or pb.ReplicaAssigned())
        finally:
            self._starting.discard(replica)

    async def _start_replica(self, slot: int, replica: int, assigned: pb.ReplicaAssigned
                             ) -> None:
        log_dir = Path(self.config.log_dir) if self.config.log_dir else None
        command = self._worker_command()
        if self.config.attach_pid is not None:
            self._adopt(slot, replica, self.config.attach_pid)
            return
        part = ReplicaPart(  # the part of a replica spanning agents that this agent holds
            ranks=max(self._job.ranks_per_replica, 1), first_rank=assigned.first_rank,
            here=self.config.slots if assigned.replica_store else 0,
            store=store_from_here(assigned.replica_store, self._control_host),
            store_fd=self._store_socket.fileno() if self._store_socket else None)
        try:
            worker = await spawn_replica(
                command, replica=replica, slot=slot, part=part, run_dir=self._run_dir,
                on_leader=partial(self.workers.__setitem__, replica),
                agent_id=self.config.agent_id, agent_address=self._channel_address,
                job_id=self._job.job_id, log_dir=log_dir, transfer_host=self._transfer_host,
                transfer_tls=self.config.security.tls,
                warm=self._warm)
        except OSError as exc:
            # As if it died at once, with the reason as its last words: the controller
            # then fails a job that cannot start (or recovers a running one).
            self.workers.pop(replica, None)
            log.error("cannot run the worker command %r: %s", command[0], exc.strerror,
                      extra={"replica": replica})
            self._send_up(pb.AgentMessage(worker_exited=pb.WorkerExited(
                replica=replica, exit_code=127, observed_at=time.time(),
                output_tail=f"cannot run the worker command {command[0]!r}: {exc.strerror}")))
            return
        for process in worker.ranks:
            self._tasks.append(asyncio.create_task(self._watch(process, worker)))
        log.info("%s", spawned(worker, part), extra={"replica": replica})

    def _adopt(self, slot: int, replica: int, pid: int) -> None:
        """The attached process becomes this slot's worker; it learns so from the attach file."""
        process = AttachedProcess(pid)
        worker = WorkerProcess(replica, slot, process)
        self.workers[replica] = worker
        self._tasks.append(asyncio.create_task(self._watch(worker, worker)))
        if process.watch() and self.config.attach_file:
            write_attach_file(Path(self.config.attach_file), replica=replica, slot=slot,
                              agent_address=self._channel_address,
                              transfer_host=self._transfer_host)
        log.info("attached process %d on slot %d", pid, slot, extra={"replica": replica})

    async def _watch(self, process: WorkerProcess, worker: WorkerProcess) -> None:
        """Wait for one process of `worker`'s replica (`worker` is its rank 0). The first
        of a replica's ranks to exit loses the whole replica: the others are killed at once
        (a survivor of a broken replica would otherwise wait in a collective for its
        timeout) and the replica's exit is reported once, with what the first one said."""
        returncode = await process.process.wait()
        process.kill_group()  # what the worker started (a data loader, a wrapper's child) goes too
        process.commands.put_nowait(None)
        if process.log_file is not None:  # one descriptor per restart would add up
            process.log_file.close()
            process.log_file = None
        if self._shutdown is not None or worker.lost:
            return
        report = lose_replica(worker, process, returncode)
        self._send_up(pb.AgentMessage(worker_exited=report))
        log.warning("worker exited (%s)", "status unknown: not this agent's child"
                    if report.status_unknown else f"code {report.exit_code}, signal {report.signal}",
                    extra={"replica": worker.replica})
        now, window = time.monotonic(), self.config.restart_window_s
        times = [t for t in self.restarts.get(worker.slot, []) if now - t < window]
        decision = decide_restart(worker.slot, recent_restarts(times, now, window),
                                  self.config.max_restarts, job_over=self._shutdown is not None,
                                  deterministic_error=process.error is not None
                                  and process.error.deterministic, window_s=window)
        log.info("%s", decision.reason, extra={"replica": worker.replica})
        if decision.restart:
            self.restarts[worker.slot] = [*times, now]
            await self._request_replica(worker.slot, f"replica {worker.replica} exited",
                                        decision.delay_s)

    def _send_up(self, message: pb.AgentMessage) -> None:
        self._upstream.put_nowait(message)
        self._sent_up_at = time.monotonic()

    def _beat(self) -> None:
        self._send_up(pb.AgentMessage(heartbeat=pb.Heartbeat(sent_at=time.time())))
        self.heartbeats_sent += 1

    def _handle(self, message: pb.ControllerMessage) -> bool:
        """Forward one controller message to the workers; True when the job is over."""
        kind = message.WhichOneof("kind") or ""
        generation = getattr(message, kind).generation if kind in fencing.GENERATIONAL else 0
        verdict = fencing.judge(kind, message.term, generation, self.term, self.generation)
        if not verdict.accept:
            self.fenced_commands += 1
            log.warning("refused a command: %s", verdict.reason, extra={"term": message.term})
            return False
        self.term = max(self.term, message.term)
        if kind == "generation":
            view = message.generation
            self.generation = view.generation
            self._members = set(view.members)
            self._forward(pb.WorkerCommand(generation=view))
        elif kind == "commit":
            commit = message.commit
            for replica in self._members:
                if fencing.wants_commit(commit.step,
                                        self._replays.applied_step.get(replica, -1)).accept:
                    self._forward(pb.WorkerCommand(commit=commit), [replica])
        elif kind == "shutdown":
            self._shutdown = message.shutdown
            for process in every_process(self.workers):
                process.commands.put_nowait(pb.WorkerCommand(shutdown=message.shutdown))
            return True
        elif kind in fencing.ADDRESSED:
            self._forward(pb.WorkerCommand(**{kind: getattr(message, kind)}),
                          [fencing.ADDRESSED[kind](message)])
        elif kind == "replica_assigned":
            assigned = message.replica_assigned
            self._replays.asked.pop(assigned.slot, None)
            if assigned.refused and assigned.retryable:
                log.info("slot %d: %s; asking again", assigned.slot, assigned.refused)
                self._tasks.append(asyncio.create_task(self._request_replica(
                    assigned.slot, "asking again", RETRY_REQUEST_S)))
            elif assigned.refused and assigned.waiting:
                # Not an error: the controller assigns the slot a replica when room opens.
                log.info("slot %d waits: %s", assigned.slot, assigned.refused)
            elif assigned.refused:
                log.warning("slot %d stays empty: %s", assigned.slot, assigned.refused)
            elif assigned.replica not in self.workers and assigned.replica not in self._starting:
                self._tasks.append(asyncio.create_task(self._spawn(  # (not told again)
                    assigned.slot, assigned.replica, assigned)))
        elif kind == "stop_replica":
            stop_replica(self.workers.get(message.stop_replica.replica),
                         f"stopped by the controller: {message.stop_replica.reason}")
        return False

    async def _request_replica(self, slot: int, reason: str, delay_s: float) -> None:
        await asyncio.sleep(delay_s)
        if self._shutdown is None:
            self._replays.asked[slot] = reason
            self._send_up(pb.AgentMessage(replica_request=pb.ReplicaRequest(
                slot=slot, reason=reason)))

    def _forward(self, command: pb.WorkerCommand, replicas: Iterable[int] | None = None) -> None:
        for replica in self._members if replicas is None else replicas:
            worker = self.workers.get(replica)
            for process in worker.ranks if worker is not None else []:
                if process.process.returncode is None:
                    process.commands.put_nowait(command)
