"""Spawning and watching the torch worker processes of one host."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from recover.agent.attached import AttachedProcess
from recover.agent.warmstart import ForkedProcess, WarmStarter
from recover.common import progress
from recover.common.netaddr import is_loopback
from recover.proto import pb
from recover.trainer.faults import HANG_PHASES

log = logging.getLogger("recover.agent")


@dataclass
class WorkerProcess:
    replica: int
    slot: int
    process: asyncio.subprocess.Process | ForkedProcess | AttachedProcess
    log_file: IO[bytes] | None = None
    fault: pb.FaultNote | None = None
    """What the worker said about the fault it injected into itself, if any."""
    progress_path: Path | None = None
    """The worker's progress file (see recover.common.progress)."""
    killed_by_agent: str = ""
    """Why the agent killed this worker (the watchdog's verdict), if it did."""
    attached: bool = False
    """It connected to the agent's channel (its script called recover.trainer.init())."""
    error: pb.WorkerError | None = None
    """What it reported about an error in the user's code before exiting, if anything."""
    log_path: Path | None = None
    commands: asyncio.Queue[pb.WorkerCommand | None] = field(default_factory=asyncio.Queue)
    rank: int = 0
    """Its rank within its replica (0 for single-process replicas; rank 0 speaks for it)."""
    siblings: list[WorkerProcess] = field(default_factory=list)
    """On rank 0 of a replica of several ranks: ranks 1.. (the replica is lost as a unit)."""
    lost: bool = False
    """On rank 0: one of the replica's ranks exited and the replica was reported lost."""

    @property
    def ranks(self) -> list[WorkerProcess]:
        """Every process of the replica this rank-0 worker stands for, in rank order."""
        return [self, *self.siblings]

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def warm(self) -> bool:
        """Forked from the agent's warm interpreter (not started as a fresh process)."""
        return isinstance(self.process, ForkedProcess)

    def kill_group(self) -> None:
        """SIGKILL what is left of the worker's process group once the worker is gone (not
        for an attached process: its group is its user's shell job)."""
        if isinstance(self.process, AttachedProcess):
            return
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass

    def kill(self) -> None:
        """SIGKILL the worker's whole process group: a wrapper between the agent and the
        training process (`-- ./train.sh`, `uv run ...`) must not leave it behind."""
        if isinstance(self.process, AttachedProcess):
            return  # the user's own process: never killed (AttachedProcess.kill says why)
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        except PermissionError:  # not a group leader after all (it called setsid itself)
            try:
                self.process.kill()
            except ProcessLookupError:
                pass


OUTPUT_TAIL_LINES = 5
OUTPUT_TAIL_BYTES = 2000


def resolve_command(command: list[str]) -> list[str]:
    """A leading `python`/`python3` runs under this agent's own interpreter (the one
    ReCoVer is installed in), as torchrun does; any other command runs as given."""
    if command and command[0] in ("python", "python3"):
        return [sys.executable, *command[1:]]
    return list(command)


def output_tail(path: Path | None) -> str:
    """The last lines a worker printed, for a failure that happened before it could report."""
    if path is None:
        return ""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - OUTPUT_TAIL_BYTES))
            lines = f.read().decode(errors="replace").strip().splitlines()
    except OSError:
        return ""
    return "\n".join(lines[-OUTPUT_TAIL_LINES:])


def every_process(workers: dict[int, WorkerProcess]) -> list[WorkerProcess]:
    """Every worker process of the agent, each replica's ranks in order."""
    return [process for worker in workers.values() for process in worker.ranks]


def base_environment() -> dict[str, str]:
    """What every worker of this agent has in its environment (the warm interpreter too)."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    # Several workers share a host's cores, and bitwise-identical results need the
    # same thread count on every replica: one intra-op thread unless the user says
    # otherwise (torchrun does the same).
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


async def spawn_worker(
    command: list[str],
    *,
    replica: int,
    slot: int,
    agent_id: str,
    agent_address: str,
    job_id: str,
    log_dir: Path | None,
    progress_path: Path | None = None,
    transfer_host: str = "127.0.0.1",
    transfer_tls: bool = False,
    warm: WarmStarter | None = None,
    rank: int = 0,
    ranks: int = 1,
    replica_store: str = "",
    store_fd: int | None = None,
) -> WorkerProcess:
    """Start one worker with its identity in RECOVER_* variables (like torchrun's RANK):
    forked from the warm interpreter when there is one, else as a fresh process. A rank of a
    replica of several also gets its rank and where its replica's group meets; the one that
    serves a spanning replica's store gets the agent's listening socket (`store_fd`)."""
    env = base_environment()
    env.update({
        "RECOVER_REPLICA_ID": str(replica),
        "RECOVER_SLOT": str(slot),
        "RECOVER_AGENT_ID": agent_id,
        "RECOVER_AGENT_ADDR": agent_address,
        "RECOVER_JOB_ID": job_id,
        # The worker arms a parent-death signal and checks that this pid lives (no
        # preexec_fn: forking a process that runs gRPC threads must exec straight away).
        "RECOVER_AGENT_PID": str(os.getpid()),
        # Where the worker accepts a donor's state when it joins a running job.
        "RECOVER_TRANSFER_HOST": transfer_host,
        # A control plane with TLS: the state a donor streams to it is encrypted too.
        "RECOVER_TRANSFER_TLS": "1" if transfer_tls else "0",
        "RECOVER_RANK_IN_REPLICA": str(rank),
        "RECOVER_RANKS_PER_REPLICA": str(ranks),
    })
    if replica_store:
        # A file (FileStore) when the replica's ranks share this host: it needs no port; else
        # tcp://HOST:PORT, served by rank 0 on the listening socket its agent holds.
        env["RECOVER_REPLICA_STORE"] = replica_store
    if store_fd is not None:
        env["RECOVER_REPLICA_STORE_FD"] = str(store_fd)
    if progress_path is not None:
        progress.create(progress_path)
        env["RECOVER_PROGRESS_FILE"] = str(progress_path)
    log_path = None
    if log_dir is not None:
        log_dir.mkdir(parents=True, exist_ok=True)
        log_path = log_dir / (f"replica-{replica}.log" if rank == 0
                              else f"replica-{replica}-rank{rank}.log")
    forked = await warm.spawn(env, os.getcwd(), log_path) if warm is not None else None
    if forked is not None:
        return WorkerProcess(replica, slot, forked, None, progress_path=progress_path,
                             log_path=log_path, rank=rank)
    log_file = open(log_path, "ab") if log_path is not None else None  # noqa: SIM115 (owned by WorkerProcess)
    # A process group of its own (start_new_session), so that kill() reaches everything
    # the worker command started.
    process = await asyncio.create_subprocess_exec(
        *resolve_command(command), env=env, stdin=asyncio.subprocess.DEVNULL,
        stdout=log_file, stderr=log_file, start_new_session=True,
        pass_fds=() if store_fd is None else (store_fd,))
    return WorkerProcess(replica, slot, process, log_file, progress_path=progress_path,
                         log_path=log_path, rank=rank)


def exit_report(worker: WorkerProcess, returncode: int) -> pb.WorkerExited:
    killed_at = 0.0
    if worker.fault is not None and worker.progress_path is not None:
        snapshot = progress.read(worker.progress_path)
        killed_at = snapshot.killed_at if snapshot is not None else 0.0
    unknown = isinstance(worker.process, AttachedProcess)
    if unknown and worker.fault is not None and worker.fault.phase not in HANG_PHASES:
        # Not our child, so its status cannot be read; but it said it injects a crash into
        # itself, and that is always a SIGKILL (trainer/faults.py). (Its agent never kills
        # it, so a hang fault ends some other way.)
        returncode, unknown = -signal.SIGKILL, False
    report = pb.WorkerExited(
        replica=worker.replica,
        exit_code=returncode if returncode >= 0 else 0,
        signal=-returncode if returncode < 0 else 0,
        observed_at=time.time(),
        status_unknown=unknown,
    )
    if worker.fault is not None:
        report.fault.CopyFrom(worker.fault)
        if killed_at > 0:
            report.fault.killed_at = killed_at  # stamped right before the kill
    report.killed_by_agent = worker.killed_by_agent
    report.attached = worker.attached
    if worker.error is not None:
        report.error.CopyFrom(worker.error)
    elif returncode > 0:
        report.output_tail = output_tail(worker.log_path)
    return report


async def stop_workers(workers: list[WorkerProcess], grace_s: float) -> None:
    """Wait up to `grace_s` for workers (every process: see every_process) to leave on
    their own, then kill the rest."""
    alive = [w for w in workers if w.process.returncode is None]
    if not alive:
        return
    waits = [asyncio.create_task(w.process.wait()) for w in alive]
    _, pending = await asyncio.wait(waits, timeout=grace_s)
    for worker in alive:
        if worker.process.returncode is None:
            worker.kill()
    if pending:
        await asyncio.wait(pending, timeout=5)
    for worker in workers:
        if worker.log_file is not None:
            worker.log_file.close()


def listen_for_replica_store() -> socket.socket | None:
    """The socket a spanning replica's rank 0 serves the replica's store on, if this agent
    holds it: bound before any worker starts (they inherit it, the warm interpreter too),
    so its port is known when the agent registers and the other agents' ranks can connect
    before rank 0 runs (their connections wait in its backlog, not on a timer). On every
    interface: the other agents reach it at this host's address as the controller saw it,
    which need not be the one this host reaches the controller from (a relay, an agent
    beside the controller)."""
    try:
        listener = socket.create_server(("0.0.0.0", 0), backlog=128)
    except OSError as exc:
        log.warning("no socket for a spanning replica's store: %s", exc.strerror)
        return None
    return listener


def store_from_here(store: str, control_host: str) -> str:
    """A spanning replica's store address as this agent reaches it. A loopback host means the
    agent serving it reached the controller (or relay) over loopback: it is on that host,
    which this agent reaches at the address its own session uses."""
    host, _, port = store.rpartition(":")
    if not store or not is_loopback(host.strip("[]")) or not control_host \
            or is_loopback(control_host.strip("[]")):
        return store
    return f"{control_host}:{port}"


@dataclass(frozen=True)
class ReplicaPart:
    """Which of a replica's ranks this agent runs: all of them, or its part of a replica
    spanning agents."""

    ranks: int
    """The replica's ranks, on every agent together."""
    first_rank: int = 0
    here: int = 0
    """How many of them this agent runs, from `first_rank` (0: all)."""
    store: str = ""
    """HOST:PORT of the spanning replica's store (empty: a file here)."""
    store_fd: int | None = None
    """This agent's listening socket, for the rank 0 that serves that store."""


def spawned(worker: WorkerProcess, part: ReplicaPart) -> str:
    """What the agent logs once it started a replica's processes here."""
    ranks = worker.ranks
    many = "s" if len(ranks) > 1 else ""
    slots = f"{worker.slot}..{worker.slot + len(ranks) - 1}" if many else str(worker.slot)
    spanning = (f" (ranks {part.first_rank}..{part.first_rank + len(ranks) - 1} of "
                f"{part.ranks}, meeting at {part.store})" if part.store else "")
    return (f"spawned worker pid{many} {', '.join(str(p.pid) for p in ranks)} on slot{many} "
            f"{slots}{spanning}{' (forked warm)' if worker.warm else ''}")


def waiting_note(slots: int, ranks: int, replicas: int) -> str | None:
    """Why some of a newly registered agent's slots have no replica yet, if they have none."""
    if ranks > slots:
        return (f"the {slots} slots hold part of a replica of {ranks} ranks spanning agents; "
                "the controller forms it when its other agents are here")
    if replicas * ranks < slots:
        return (f"slots {replicas * ranks}-{slots - 1} wait for room in the job (it has its "
                "replicas); the controller assigns them replicas when it has room")
    return None


async def spawn_replica(command: list[str], *, replica: int, slot: int, part: ReplicaPart,
                        run_dir: Path, on_leader: Callable[[WorkerProcess], None],
                        **common: object) -> WorkerProcess:
    """Start this agent's processes of one replica on slots slot, slot+1, ...; returns the
    first with the others as its siblings. `on_leader` gets the first as soon as it runs,
    and each later rank joins its siblings as soon as it runs: a rank may attach to the
    agent's channel while the next one is still being started. If one cannot start, those
    started are killed and the OSError raised: a replica runs whole or not at all."""
    ranks, here = part.ranks, part.here or part.ranks
    store = f"tcp://{part.store}" if part.store else \
        str(run_dir / f"replica-{replica}.store") if ranks > 1 else ""
    leader: WorkerProcess | None = None
    try:
        for index in range(here):
            rank = part.first_rank + index
            suffix = "" if rank == 0 else f"-{rank}"
            worker = await spawn_worker(
                command, replica=replica, slot=slot + index, rank=rank, ranks=ranks,
                replica_store=store, progress_path=run_dir / f"progress-{replica}{suffix}.bin",
                store_fd=part.store_fd if rank == 0 and part.store else None,
                **common)  # type: ignore[arg-type]
            if leader is None:
                leader = worker
                on_leader(worker)
            else:
                leader.siblings.append(worker)
    except OSError:
        for worker in leader.ranks if leader is not None else []:
            worker.kill()
        raise
    assert leader is not None
    return leader


def stop_replica(worker: WorkerProcess | None, why: str) -> None:
    """Kill this agent's processes of a replica (all of its ranks here), saying why."""
    for process in worker.ranks if worker is not None else []:
        if process.process.returncode is None:
            process.killed_by_agent = why
            log.warning("rank %d %s", process.rank, why, extra={"replica": worker.replica})
            process.kill()


def lose_replica(worker: WorkerProcess, exited: WorkerProcess, returncode: int
                 ) -> pb.WorkerExited:
    """`exited`, one process of `worker`'s replica, ended: the replica is lost. Its other
    ranks are killed at once (a survivor of a broken replica would otherwise wait in a
    collective for its timeout); the report is the replica's, naming as its cause the rank
    that noted an injected fault or a user error, even if a sibling blocked on it went first
    (the watchdog may judge either of them)."""
    worker.lost = True
    siblings = [p for p in worker.ranks if p is not exited and p.process.returncode is None]
    for sibling in siblings:
        sibling.killed_by_agent = f"rank {exited.rank} of its replica exited"
        sibling.kill()
    if siblings:
        log.warning("rank %d exited: killed the replica's other ranks (pids %s)",
                    exited.rank, ", ".join(str(p.pid) for p in siblings),
                    extra={"replica": worker.replica})
    report = exit_report(exited, returncode)
    cause = next((p for p in worker.ranks if p.fault is not None or p.error is not None), None)
    if cause is not None and cause is not exited:
        if cause.fault is not None:
            report.fault.CopyFrom(cause.fault)
        if cause.error is not None:
            report.error.CopyFrom(cause.error)
    return report
