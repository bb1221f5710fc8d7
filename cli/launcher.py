"""`recover run`: the whole job on this machine, with live progress.

It starts the controller and the agents as separate processes, exactly as
they run across hosts (the agents emulate hosts), watches the controller's
status, and writes OUT/summary.json when the job ends.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO

import grpc

from recover.cli.inspect import EventCursor, to_json
from recover.cli.jobargs import UsageError, job_from_args
from recover.cli.localtls import LocalTLS, local_tls
from recover.cli.preflight import check_checkpoint_folder, check_command, check_out, check_store
from recover.cli.scrape import TARGETS_FILE, MetricsPorts, endpoint, write_targets
from recover.cli.statusline import TERMINAL, Progress
from recover.client.connect import ControllerUnreachable, connect_leader
from recover.client.launch import hand_over
from recover.common.netaddr import is_loopback
from recover.common.security import Security
from recover.controller.store_url import store_exposure
from recover.controller.summary import build_summary, format_summary, write_summary
from recover.proto import pb

EXIT_STOPPED = 3
"""`recover run`'s exit code when an operator stopped the job (`recover stop`)."""


def plural(count: int, noun: str) -> str:
    return f"{count} {noun}{'' if count == 1 else 's'}"


class Terminated(KeyboardInterrupt):
    """SIGTERM: stop the job as Ctrl-C does."""


def _terminate(signum: int, frame: object) -> None:
    raise Terminated


class LaunchError(Exception):
    """A part of the local job could not start; the message says which and why."""


def split_slots(replicas: int, agents: int) -> list[int]:
    base, extra = divmod(replicas, agents)
    return [base + (1 if i < extra else 0) for i in range(agents)]


def slots_per_agent(agents: int, replicas: int, ranks: int) -> list[int]:
    """Each local agent's slots: whole replicas spread over the agents, or, with more agents
    than replicas, each replica spanning the same number of agents (an equal part of its
    ranks on each). UsageError for a layout that is neither."""
    if 1 <= agents <= replicas:
        return [count * ranks for count in split_slots(replicas, agents)]
    span = agents // replicas if agents > replicas else 0
    if span < 2 or agents % replicas or ranks % span:
        raise UsageError(f"--agents {agents}: give 1 to {replicas} (whole replicas on each), or "
                         f"a multiple of the replicas and spares ({replicas}) whose share of "
                         f"each replica divides its {ranks} ranks (a replica spanning agents)")
    return [ranks // span] * agents


class LocalJob:
    def __init__(self, out: Path) -> None:
        self.out = out
        self.logs = out / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.processes: dict[str, subprocess.Popen[bytes]] = {}
        self._files: list[IO[bytes]] = []

    def start(self, name: str, argv: list[str]) -> subprocess.Popen[bytes]:
        log = open(self.logs / f"{name}.log", "wb")  # noqa: SIM115 (closed in stop())
        self._files.append(log)
        # A session of its own: Ctrl-C reaches only the launcher, which then
        # stops the parts in order instead of every process dying at once. Should the
        # launcher itself be SIGKILLed, each part ends on its own (RECOVER_PARENT_PID:
        # cli/lifetime.py), so no job outlives its launcher.
        env = dict(os.environ, RECOVER_PARENT_PID=str(os.getpid()))
        process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env,
                                   stdin=subprocess.DEVNULL, start_new_session=True)
        self.processes[name] = process
        return process

    def log_tail(self, name: str, lines: int = 5) -> str:
        text = (self.logs / f"{name}.log").read_text(errors="replace").strip().splitlines()
        return " | ".join(text[-lines:])

    def stop(self, grace_s: float = 5.0) -> None:
        """End the controllers (standbys first, so none takes over) and relays; agents then
        leave.
        Signals are ignored meanwhile: a second Ctrl-C must not cut the cleanup short."""
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_IGN)
        deadline = time.monotonic() + grace_s
        # Standbys, the leader, then the relays (the agents' sessions end with the job).
        for name in sorted(self.processes, key=lambda n: (n.startswith("rack"),
                                                          n == "controller")):
            process = self.processes[name]
            if name.startswith(("controller", "rack")) and process.poll() is None:
                process.send_signal(signal.SIGTERM)
        for process in self.processes.values():
            try:
                process.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        for f in self._files:
            f.close()


def controller_name(index: int) -> str:
    """Process (and log) name of the index-th controller: controller, controller-1, ..."""
    return "controller" if index == 0 else f"controller-{index}"


def _wait_for_port(job: LocalJob, name: str, port_file: Path, timeout_s: float = 60.0) -> int:
    deadline = time.monotonic() + timeout_s
    controller = job.processes[name]
    while time.monotonic() < deadline:
        if port_file.exists():
            return int(port_file.read_text())
        if controller.poll() is not None:
            raise LaunchError(f"{name} exited with code {controller.returncode}: "
                              f"{job.log_tail(name)}")
        time.sleep(0.05)
    raise LaunchError(f"{name} did not start listening within {timeout_s:.0f}s")


def run_local(args: argparse.Namespace) -> int:
    job_config = job_from_args(args)
    if args.resume is not None:
        from recover.cli.resume import resumed_job

        job_config, notes = resumed_job(args.resume, job_config,
                                         job_id_given=args.job_id is not None,
                                         checkpoint_dir_given=args.checkpoint_dir is not None)
        for note in notes:
            print(f"recover run: {note}", file=sys.stderr)
    check_command(list(job_config.workload.command))
    check_checkpoint_folder(job_config.checkpoint.dir, resumed=bool(job_config.resume.path))
    check_out(args.out)
    if not store_exposure(args.store, insecure_store=False, is_loopback=is_loopback).allowed:
        raise UsageError(f"recover run: --store {args.store}: plaintext etcd on another machine "
                         "would let anyone who reaches it lead the job; use etcds:// (TLS)")
    check_store(args.store, "recover run", args.store_timeout)
    if args.controllers < 1:
        raise UsageError(f"recover run: --controllers must be at least 1, got {args.controllers}")
    if args.controllers > 1 and not args.store.startswith(("etcd://", "etcds://")):
        raise UsageError(f"recover run: --controllers {args.controllers} needs a shared store "
                         "(--store etcd://HOST:PORT or etcds://...); "
                         "the memory store lives in one controller")
    agents = args.agents if args.agents is not None else min(2, job_config.replicas)
    if args.attach is not None:
        if job_config.replicas != 1 or job_config.spares or (args.agents or 1) != 1 \
                or job_config.ranks_per_replica > 1:
            raise UsageError("recover run: a script run by hand trains one replica of one "
                             "process (RECOVER_ARGS cannot ask for more replicas, ranks, spares "
                             "or agents)")
        agents = 1
    agent_slots = slots_per_agent(agents, job_config.replicas + job_config.spares,
                                  max(job_config.ranks_per_replica, 1))
    if not 0 <= args.relays <= agents:
        raise UsageError(f"recover run: --relays must be between 0 and the agents ({agents}), "
                         f"got {args.relays}")
    processes = args.controllers + agents
    if args.metrics_port is not None and not 0 <= args.metrics_port <= 65536 - processes:
        raise UsageError(f"recover run: --metrics-port {args.metrics_port}: give 0 (free ports) "
                         f"or a port with {processes} consecutive ports free "
                         "from it (one per controller and agent)")
    out = Path(args.out)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UsageError(f"--out {str(out)!r}: {exc.strerror}") from None
    port_files = [out / f"{controller_name(i)}.port" for i in range(args.controllers)]
    for port_file in port_files:
        port_file.unlink(missing_ok=True)
    job_file = out / "job.binpb"  # the job for the controllers, removed with the port files
    tls = local_tls(out / "tls", agents, args.relays) if args.tls else None
    job = LocalJob(out)
    metrics = (MetricsPorts(out, args.metrics_port, args.controllers)
               if args.metrics_port is not None else None)
    signal.signal(signal.SIGTERM, _terminate)
    progress = Progress(enabled=not args.quiet)
    python = sys.executable
    started = time.monotonic()
    try:
        handed_over = hand_over(job_config, job_file)
        for index, port_file in enumerate(port_files):
            job.start(controller_name(index), [
                python, "-m", "recover.cli.main", "controller",
                "--port", "0", "--port-file", str(port_file), "--store", args.store,
                "--controller-id", controller_name(index), "--start-timeout",
                repr(args.start_timeout), "--start-grace", repr(args.start_grace),
                *(tls.flags("controller") if tls else []),
                *(metrics.flags(controller_name(index), index) if metrics else []),
                *handed_over])
        addresses = [f"127.0.0.1:{_wait_for_port(job, controller_name(i), f)}"
                     for i, f in enumerate(port_files)]
        address = ",".join(addresses)
        relays = _start_relays(job, args.relays, address, tls)
        for index, slots in enumerate(agent_slots):
            job.start(f"agent-{index}", [
                python, "-m", "recover.cli.main", "agent",
                # Every relay, its own first: should it die, the agent comes back through
                # another without losing its workers (README "Relays for large jobs").
                "--controller", ",".join(relays[index % len(relays):]
                                         + relays[:index % len(relays)]) if relays else address,
                "--slots", str(slots), "--agent-id", f"host{index}", "--log-dir", str(job.logs),
                "--max-restarts", str(args.max_restarts),
                "--restart-window", str(args.restart_window),
                *(["--cold-start"] if args.cold_start else []),
                *(["--attach", str(args.attach), "--attach-file", str(out / "attach.json"),
                   "--max-restarts", "0"] if args.attach is not None else []),
                *(tls.flags(f"host{index}") if tls else []),
                *(metrics.flags(f"host{index}", metrics.agent_index(index)) if metrics else [])])
        endpoints = (_metrics_endpoints(job, metrics, agents, bool(tls), job_config.job_id)
                     if metrics else {})
        print(f"recover run: job {job_config.job_id}, {plural(job_config.replicas, 'replica')} on "
              f"{plural(agents, 'agent')}, controller{'s' if len(addresses) > 1 else ''} {address}, logs in "
              f"{job.logs}", file=sys.stderr)
        with open(out / "events.jsonl", "w") as events:
            report = _watch(job, addresses, progress, tls.security("launcher") if tls else None,
                            lambda event: print(to_json(event), file=events, flush=True))
        summary = build_summary(report, time.monotonic() - started)
        if endpoints:
            summary["metrics"] = endpoints
        write_summary(summary, out)
        progress.done()
        print(format_summary(summary))
        print(f"summary: {out / 'summary.json'}")
        if not args.no_plot and summary["steps_committed"]:
            _draw_plot(out)
        if summary["state"] == "stopped":
            print(f"recover run: {summary['reason']}", file=sys.stderr)
            return EXIT_STOPPED
        if summary["state"] != "succeeded":
            _print_user_traceback(summary)
            print(f"recover run: training failed: {summary['reason']}", file=sys.stderr)
            return 1
        return 0
    except LaunchError as exc:
        progress.done()
        print(f"recover run: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt as interrupt:
        progress.done()
        print("recover run: interrupted; stopping the job", file=sys.stderr)
        return 143 if isinstance(interrupt, Terminated) else 130
    finally:
        job.stop()
        for path in [*port_files, *out.glob("rack*.port"), job_file]:
            path.unlink(missing_ok=True)
        if metrics:  # the job is over: nothing left to scrape
            for path in [*out.glob("*.metrics-port"), out / TARGETS_FILE]:
                path.unlink(missing_ok=True)


def _start_relays(job: LocalJob, count: int, controllers: str, tls: LocalTLS | None
                  ) -> list[str]:
    """`count` relays in front of the controllers (rack0, rack1, ...): their addresses."""
    port_files = [job.out / f"rack{i}.port" for i in range(count)]
    for index, port_file in enumerate(port_files):
        port_file.unlink(missing_ok=True)
        job.start(f"rack{index}", [
            sys.executable, "-m", "recover.cli.main", "relay", "--controller", controllers,
            "--listen", "127.0.0.1:0", "--port-file", str(port_file),
            "--relay-id", f"rack{index}", *(tls.flags(f"rack{index}") if tls else [])])
    return [f"127.0.0.1:{_wait_for_port(job, f'rack{i}', f)}" for i, f in enumerate(port_files)]


def _metrics_endpoints(job: LocalJob, metrics: MetricsPorts, agents: int, tls: bool,
                       job_id: str) -> dict[str, str]:
    """Each process's metrics URL once it listens, printed and written for Prometheus."""
    names = [n for n in job.processes if n.startswith("controller")]
    endpoints = {name: endpoint(_wait_for_port(job, name, metrics.port_file(name)), tls)
                 for name in names}
    for index in range(agents):  # an agent's metrics are plain HTTP on loopback
        endpoints[f"host{index}"] = endpoint(
            _wait_for_port(job, f"agent-{index}", metrics.port_file(f"host{index}")), False)
    targets = write_targets(job.out, job_id, endpoints)
    print(f"recover run: metrics {', '.join(f'{n} {u}' for n, u in endpoints.items())} "
          f"(Prometheus targets: {targets})", file=sys.stderr)
    return endpoints


def _draw_plot(out: Path) -> None:
    """OUT/plot.png: the run against wall time. A missing plotting library or an unwritable
    folder costs the picture, never the run's result."""
    from recover.cli.plot import plot

    try:
        print(f"plot: {plot([str(out)], str(out / 'plot.png'), x='time')}")
    except Exception as exc:  # noqa: BLE001 - the picture is optional, the result is not
        print(f"recover run: no plot.png: {exc}", file=sys.stderr)


def _print_user_traceback(summary: dict[str, object]) -> None:
    """When the user's code raised, show its own traceback once (ReCoVer's frames left out)."""
    failures = summary.get("failures") or []
    assert isinstance(failures, list)
    for failure in reversed(failures):
        if failure.get("traceback"):
            print(failure["traceback"].rstrip(), file=sys.stderr)
            return


def _watch(job: LocalJob, addresses: list[str], progress: Progress,
           security: Security | None, record: Callable[[pb.Event], None]) -> pb.RunReport:
    """Follow the job through the leading controller, to the new one after a failover.

    Every event goes to `record` once, in order, all of them by the time this returns: the
    end's own event included, read after the terminal state is.
    """
    controllers = [n for n in job.processes if n.startswith("controller")]
    cursor = EventCursor()
    channel = None
    ended_event = False  # the end's own event (succeeded, failed, stopped) recorded
    terminal_since: float | None = None
    try:
        while True:
            alive = [n for n in controllers if job.processes[n].poll() is None]
            if not alive:
                name = controllers[0]
                raise LaunchError(f"the controller died (exit code {job.processes[name].returncode})"
                                  f": {job.log_tail(name)}")
            if channel is None:
                try:
                    channel, stub = connect_leader(",".join(addresses), timeout_s=30,
                                                   security=security)
                except ControllerUnreachable as exc:
                    raise LaunchError(str(exc)) from None
            try:
                status = stub.Status(pb.StatusRequest(), timeout=5)
                if status.role == "standby":
                    raise _NotLeader
                for event in cursor.fresh(stub.Events(cursor.request(), timeout=5).events):
                    progress.event(event)
                    record(event)
                    ended_event = ended_event or event.kind in TERMINAL
            except (grpc.RpcError, _NotLeader):
                channel.close()
                channel = None
                cursor.reread = True  # perhaps another leader next: see EventCursor
                time.sleep(0.1)
                continue
            if terminal_since is None:  # the end's line once
                progress.status(status)
            if status.state in TERMINAL:
                # Its event may trail the state by a store write (a leader that took over a
                # job already ended has none): waited for briefly, so the record is whole.
                terminal_since = terminal_since or time.monotonic()
                if ended_event or time.monotonic() - terminal_since > 3.0:
                    return stub.Report(pb.ReportRequest(), timeout=10)
                time.sleep(0.05)
                continue
            if status.state == "waiting":
                # A controller or some agents lost during startup are faults the job rides
                # out (a standby leads; the job starts without them, or they are replaced);
                # every agent gone is not.
                agents = [n for n in job.processes if n.startswith("agent")]
                if agents and all(job.processes[n].poll() is not None for n in agents):
                    raise LaunchError(f"every agent exited before training started: "
                                      f"{job.log_tail(agents[0])}")
            time.sleep(0.1)
    finally:
        if channel is not None:
            channel.close()


class _NotLeader(Exception):
    """The controller answering is a standby (the leader changed)."""
