"""Run a real `recover run` job and, optionally, kill its workers from outside on a schedule.

The kills are plain `kill -9` of worker PIDs (learnt from the controller's
replica-ready events) at the schedule's times after the first committed step;
nothing inside the job knows they are coming. A slot's return (its host
repaired or replaced) is a replacement agent with one slot started by hand
against the running job at the schedule's time, as an operator would: its
replica joins with live state transfer. (The job should run with
`--max-restarts 0`, so that nothing comes back before the schedule says so.)
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc

from recover.bench.schedules import Schedule
from recover.client.connect import ControllerUnreachable, connect
from recover.proto import pb

PID = re.compile(r"pid (\d+)")
REGISTERED = re.compile(r"agent (\S+) on .*replicas \[(\d+)\]")


class JobFailed(Exception):
    """The job did not finish; the message says why in one line."""


def run_recover(out: Path, job_args: list[str], schedule: Schedule | None = None,
                progress: Callable[[str], None] | None = None, label: str = "recover",
                timeout_s: float = 600.0, poll_s: float = 0.02) -> dict[str, Any]:
    """Run the job to its end; return its summary.json plus launch-relative times.

    Adds: launched_at, kills ([{slot, killed_at_s, pid}]), commit_timeline
    ([[seconds since launch, step]]), end_s (last commit, seconds since launch),
    poll_s: how often the controller is asked for status and events (each poll costs it
    CPU on the job's cores: benchmarks that need no timely kills poll rarely),
    events ([{at, kind, step, generation, replica}], Unix times: every event of the job,
    from the launcher's OUT/events.jsonl; the polls here only learn PIDs for the kills).
    """
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").unlink(missing_ok=True)
    (out / "events.jsonl").unlink(missing_ok=True)
    port_file = out / "controller.port"
    port_file.unlink(missing_ok=True)
    launched = time.time()
    log = open(out / "launcher.log", "wb")  # noqa: SIM115 (closed below)
    # job_args (flags, or client.launch.hand_over's) may end with `-- COMMAND`: every
    # other flag goes before them.
    proc = subprocess.Popen([sys.executable, "-m", "recover.cli.main", "run", "--quiet", "--no-plot",
                             "--out", str(out), *job_args], stdout=log, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, start_new_session=True)
    pending = list(schedule.events) if schedule else []
    returns = sorted((e.returns_at_s, e.slot) for e in pending if e.returns_at_s is not None)
    replica_of_slot = {slot: slot for slot in range(schedule.replicas if schedule else 0)}
    replacements: dict[str, tuple[int, subprocess.Popen[bytes]]] = {}  # agent id -> slot, process
    pids: dict[int, int] = {}
    kills: list[dict[str, Any]] = []
    returned: list[dict[str, Any]] = []
    first_commit: float | None = None
    channel = stub = None
    after, last_shown = 0, 0.0
    try:
        while proc.poll() is None:
            if time.time() - launched > timeout_s:
                raise JobFailed(f"{label}: no result within {timeout_s:.0f}s")
            time.sleep(poll_s)
            if stub is None:
                if not port_file.exists():
                    continue
                try:
                    channel, stub = connect(f"127.0.0.1:{port_file.read_text()}", 10)
                except (ControllerUnreachable, ValueError):
                    continue
            try:
                for event in stub.Events(pb.EventsRequest(after_seq=after), timeout=2).events:
                    after = event.seq
                    if event.kind == "replica-ready" and (m := PID.search(event.message)):
                        pids[event.replica] = int(m.group(1))
                    if event.kind == "agent-registered" and (
                            m := REGISTERED.search(event.message)) and m.group(1) in replacements:
                        replica_of_slot[replacements[m.group(1)][0]] = int(m.group(2))
                status = stub.Status(pb.StatusRequest(), timeout=2)
            except grpc.RpcError:
                continue  # the job is ending (or busy): try again, the process poll decides
            now = time.time()
            if first_commit is None and status.steps_committed >= 1:
                first_commit = now
            while first_commit is not None and pending and pending[0].at_s <= now - first_commit:
                event = pending.pop(0)
                pid = pids.get(replica_of_slot.get(event.slot, event.slot))
                if pid is not None:
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pid = None  # already gone: a second failure of a dead slot counts nothing
                kills.append({"slot": event.slot, "killed_at_s": round(now - launched, 4),
                              "pid": pid})
            while first_commit is not None and returns and returns[0][0] <= now - first_commit:
                _, slot = returns.pop(0)
                agent_id = f"replacement-{len(replacements)}"
                replacements[agent_id] = (slot, _start_agent(out, port_file.read_text(), agent_id))
                returned.append({"slot": slot, "agent": agent_id,
                                 "started_at_s": round(now - launched, 4)})
            if progress is not None and now - last_shown > 2.0:
                last_shown = now
                progress(f"{label}: step {status.steps_committed}/{status.steps_total}  "
                         f"live {len(status.live_replicas)}  recoveries {status.recoveries}  "
                         f"{now - launched:.0f}s")
    finally:
        if channel is not None:
            channel.close()
        for _, agent in replacements.values():  # they end with the job; make sure of it
            if agent.poll() is None:
                agent.terminate()
            try:
                agent.wait(timeout=20)
            except subprocess.TimeoutExpired:
                agent.kill()
                agent.wait()
        if proc.poll() is None:
            # SIGINT: the launcher then stops its controller and agents, which run in
            # sessions of their own and would outlive a SIGTERMed launcher.
            os.killpg(proc.pid, signal.SIGINT)
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        log.close()
    try:
        summary: dict[str, Any] = json.loads((out / "summary.json").read_text())
    except (OSError, json.JSONDecodeError):
        tail = (out / "launcher.log").read_text(errors="replace").strip().splitlines()[-1:]
        raise JobFailed(f"{label}: exit code {proc.returncode}, no summary: {' '.join(tail)}") from None
    if summary["state"] != "succeeded":
        raise JobFailed(f"{label}: training failed: {summary['reason']}")
    offset = summary["started_at"] - launched
    times = [offset + t for t in summary["committed_at_s_per_step"]]
    summary.update(mode="recover", launched_at=launched, kills=kills, returns=returned,
                   events=_job_events(out),
                   commit_timeline=[[round(t, 4), step] for step, t in enumerate(times)],
                   end_s=round(times[-1], 4) if times else None)
    return summary


def _job_events(out: Path) -> list[dict[str, Any]]:
    """The job's events as the launcher wrote them, each {at, kind, step, generation, replica}."""
    keys = ("at", "kind", "step", "generation", "replica")
    with open(out / "events.jsonl") as lines:
        return [{key: event[key] for key in keys} for event in map(json.loads, lines)]


def _start_agent(out: Path, port: str, agent_id: str) -> subprocess.Popen[bytes]:
    """A replacement host: an agent with one slot for the running job (its logs in OUT/logs)."""
    with open(out / "logs" / f"{agent_id}.log", "wb") as log:
        return subprocess.Popen(
            [sys.executable, "-m", "recover.cli.main", "agent", "--controller",
             f"127.0.0.1:{port}", "--slots", "1", "--agent-id", agent_id,
             "--log-dir", str(out / "logs"), "--connect-timeout", "30"],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True)
