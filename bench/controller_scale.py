"""`recover bench controller`: one real controller process under N simulated agents.

For each N: a real `recover controller` (in-memory store) for a job of
replicas = M = N, and N one-slot simulated agents (`recover.bench.sim_agents`,
up to AGENTS_PER_PROCESS per client process) on loopback, or (`sim_racks`) simulated
racks speaking the relay protocol for them (`recover.bench.sim_racks`). Phases:
1. ramp-up: every agent registers and reports ready; the controller plans
   generation 1 and broadcasts it (time to all-up, register round trips);
2. steady state for `duration_s`: heartbeats at 1 Hz. Measured: controller CPU
   (utime + stime from /proc/PID/stat over the window) and the round trip of a
   probe every 0.2 s: a unary `Events` RPC asking for nothing new. Heartbeats are not
   acknowledged by the protocol, so their own latency cannot be seen from
   outside; the probe goes through the same event loop that handles them and is the
   honest proxy (queueing behind heartbeat work). (It was `Status` until 2026-11-28,
   whose answer lists every replica: at 12,500 agents the probe itself took a fifth of
   the leader's core.);
3. `kills` agents' deaths one after another (their streams closed): for each, the time
   to the first and to the last survivor receiving the new generation (the new plan).
Agents the controller declared lost on its own (heartbeats handled too late)
are counted from `Status.agents`.
"""

from __future__ import annotations

import json
import os
import select
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from recover.bench.env import environment, percentile
from recover.bench.scale_results import agents_per_core, cpu_fit, reactions
from recover.client.connect import connect
from recover.proto import pb

AGENTS_PER_PROCESS = 250
"""Simulated agents per client process: one asyncio loop keeps up with this many at 1 Hz."""
RACK_PROCESSES = 4
"""Processes the simulated racks are spread over (a rack's stream is cheap after the start)."""
CLK_TCK = os.sysconf("SC_CLK_TCK")


@dataclass
class ScaleConfig:
    """One `bench controller` invocation."""

    agents: list[int]
    """Agent counts to try, one controller each."""
    duration_s: float
    """Seconds of steady-state heartbeats measured per count."""
    out: Path
    """results.json and the controllers' logs."""
    heartbeat_s: float = 1.0
    """Seconds between a simulated agent's heartbeats."""
    ramp_timeout_s: float = 120.0
    """Give up on a count when its agents are not all up within this."""
    relays: int = 0
    """Agents reach the controller through this many relays (`recover relay`), each client
    process through one (round robin); 0: directly."""
    sim_racks: int = 0
    """Instead of agents' processes, this many simulated racks: streams speaking the relay's
    protocol to the leader for their agents (`recover.bench.sim_racks`), so the leader can be
    measured at sizes whose agents and relays this machine cannot host; 0: not simulated.
    With `relays` too, each real relay carries AGENTS_PER_PROCESS real agents' sessions of
    the N, and the simulated racks the rest."""
    kills: int = 1
    """Agents killed one after another after the steady window, each reaction timed."""
    kill_every_s: float = 2.0
    """Seconds between two kills (each kill's new generation is read from the events after it)."""


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process, seconds (fields 14 and 15 of /proc/PID/stat)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def process_split(total: int, per_process: int = AGENTS_PER_PROCESS) -> list[tuple[int, int]]:
    """(first, count) of each client process (pure)."""
    return [(first, min(per_process, total - first)) for first in range(0, total, per_process)]


def _start(name: str, args: list[str], folder: Path) -> tuple[subprocess.Popen[bytes], str]:
    """A `recover` process listening on a port of its choice: it and its address."""
    folder.mkdir(parents=True, exist_ok=True)
    port_file = folder / f"{name}.port"
    port_file.unlink(missing_ok=True)
    log = open(folder / f"{name}.log", "wb")  # noqa: SIM115 (the child keeps it)
    proc = subprocess.Popen([sys.executable, "-m", "recover.cli.main", *args, "--port-file",
                             str(port_file)],
                            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    log.close()
    deadline = time.time() + 60
    while not (port_file.exists() and port_file.read_text().strip()):
        if proc.poll() is not None or time.time() > deadline:
            proc.kill()
            raise RuntimeError(f"{name} did not start (see {folder})")
        time.sleep(0.05)
    return proc, f"127.0.0.1:{port_file.read_text().strip()}"


def _start_controller(n: int, folder: Path) -> tuple[subprocess.Popen[bytes], str]:
    return _start("controller", ["controller", "--port", "0", "--replicas", str(n), "-M", str(n),
                                 "--steps", "1000", "--start-timeout", "600",
                                 "--job-id", f"scale-{n}"], folder)


def _start_relays(count: int, controller: str, folder: Path
                  ) -> list[tuple[subprocess.Popen[bytes], str]]:
    return [_start(f"relay-{i}", ["relay", "--controller", controller, "--relay-id", f"rack-{i}",
                                  "--listen", "127.0.0.1:0"], folder) for i in range(count)]


def client_commands(n: int, config: ScaleConfig, leader: str, relays: list[str]
                    ) -> list[list[str]]:
    """The simulated agents' processes (pure): agents' own sessions, to the leader or to
    `relays` (round robin); with `sim_racks`, the racks' streams to the leader, and then each
    real relay carries one process of agents (AGENTS_PER_PROCESS) among the N."""
    def agents(first: int, count: int, target: str) -> list[str]:
        return [sys.executable, "-m", "recover.bench.sim_agents", target, str(first),
                str(count), "--heartbeat", str(config.heartbeat_s)]

    if not config.sim_racks:
        return [agents(first, count, relays[index % len(relays)] if relays else leader)
                for index, (first, count) in enumerate(process_split(n))]
    behind_relays = len(relays) * AGENTS_PER_PROCESS
    racked = n - behind_relays
    processes = min(config.sim_racks, RACK_PROCESSES, racked)
    commands, first = [], 0
    for index in range(processes):
        count = len(range(index, racked, processes))
        racks = len(range(index, config.sim_racks, processes))
        commands.append([sys.executable, "-m", "recover.bench.sim_racks", leader, str(first),
                         str(count), "--racks", str(min(racks, count))])
        first += count
    return commands + [agents(racked + i * AGENTS_PER_PROCESS, AGENTS_PER_PROCESS, relay)
                       for i, relay in enumerate(relays)]


def _generations(stub: Any, seen: int, newest: int = 0) -> tuple[int, int]:
    """The newest generation the leader has made (from its events after `seen`, else
    `newest`) and the events now seen. Not `Status`: its answer lists every replica, and
    at 12,500 agents making it left enough garbage for a full collection of the leader's
    heap, in the middle of the next kill's reaction."""
    events = stub.Events(pb.EventsRequest(after_seq=seen), timeout=30).events
    made = [e.generation for e in events if e.kind == "generation"]
    return max([newest, *made]), events[-1].seq if events else seen


ANSWER_BOUND_S = 10.0
"""A kill the leader has not answered with a new generation within this is counted unanswered."""
NOTHING_NEW = 2**62
"""An event sequence number past any log: the probe's `Events` call returns nothing."""


def _probe(stub: Any, seconds: float) -> tuple[list[float], int]:
    """Probe round trips every 0.2 s for `seconds`; returns them and then the agent count."""
    rtts: list[float] = []
    end = time.time() + seconds
    while time.time() < end:
        sent = time.perf_counter()
        try:
            stub.Events(pb.EventsRequest(after_seq=NOTHING_NEW), timeout=10)
            rtts.append(time.perf_counter() - sent)
        except grpc.RpcError:
            pass
        time.sleep(0.2)
    try:
        agents = stub.Status(pb.StatusRequest(), timeout=10).agents
    except grpc.RpcError:
        agents = -1
    return rtts, agents


def measure(n: int, config: ScaleConfig, progress: Callable[[str], None]) -> dict[str, Any]:
    folder = config.out / f"n{n}"
    controller, address = _start_controller(n, folder)
    clients: list[subprocess.Popen[str]] = []
    relays: list[tuple[subprocess.Popen[bytes], str]] = []
    channel = None
    try:
        relays = _start_relays(config.relays, address, folder)
        began = time.time()
        for command in client_commands(n, config, address, [a for _, a in relays]):
            clients.append(subprocess.Popen(command, stdin=subprocess.PIPE,
                                            stdout=subprocess.PIPE, text=True))
        for client in clients:
            assert client.stdout is not None
            # A client says "up", or why not; one whose agents never connect says nothing.
            waited = began + config.ramp_timeout_s - time.time()
            if not select.select([client.stdout], [], [], max(waited, 0.0))[0]:
                raise RuntimeError(f"N={n}: simulated agents not all up after "
                                   f"{config.ramp_timeout_s:.0f}s (see {folder}/controller.log)")
            line = client.stdout.readline().strip()
            if line != "up":
                raise RuntimeError(f"N={n}: simulated agents did not all come up: {line}")
        all_up_s = time.time() - began
        if all_up_s > config.ramp_timeout_s:
            raise RuntimeError(f"N={n}: ramp-up took {all_up_s:.0f}s")
        channel, stub = connect(address, 10)
        generation, seen = _generations(stub, 0)  # the start-up's events, read once
        time.sleep(min(2.0, config.duration_s / 4))  # let the start-up burst settle
        cpu0, t0 = cpu_seconds(controller.pid), time.time()
        relay_cpu0 = sum(cpu_seconds(proc.pid) for proc, _ in relays)
        rtts, agents_seen = _probe(stub, config.duration_s)
        cpu1, t1 = cpu_seconds(controller.pid), time.time()
        relay_cpu1 = sum(cpu_seconds(proc.pid) for proc, _ in relays)
        generation, seen = _generations(stub, seen, generation)
        answered: list[int | None] = []  # each kill's generation (None: none within the bound)
        for i in range(config.kills):
            victim = clients[i % len(clients)]
            assert victim.stdin is not None
            previous, sent = generation, time.time()
            victim.stdin.write("kill\n")
            victim.stdin.flush()
            time.sleep(config.kill_every_s / 2)  # answered well within this, as a rule
            while True:  # else waited for (never taken for the next kill's answer)
                generation, seen = _generations(stub, seen, generation)
                if generation != previous or time.time() - sent > ANSWER_BOUND_S:
                    break
                time.sleep(0.05)
            answered.append(generation if generation != previous else None)
            time.sleep(max(0.0, sent + config.kill_every_s - time.time()))  # late receipts land
        time.sleep(1.0)
        status = stub.Status(pb.StatusRequest(), timeout=10)
        outputs = []
        for client in clients:
            assert client.stdin is not None and client.stdout is not None
            client.stdin.write("stop\n")
            client.stdin.flush()
            outputs.append(json.loads(client.stdout.readline()))
    finally:
        if channel is not None:
            channel.close()
        for client in clients:
            if client.poll() is None:
                try:
                    client.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    client.kill()
        for proc in [controller, *(relay for relay, _ in relays)]:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
    reacted = reactions(outputs, answered)
    firsts = [r["first_s"] for r in reacted if r["first_s"] is not None]
    lasts = [r["last_s"] for r in reacted if r["last_s"] is not None]
    registers = [r for out in outputs for r in out["register_rtt_s"] if r is not None]
    errors = [e for out in outputs for e in out["errors"]]
    cpu_frac = (cpu1 - cpu0) / (t1 - t0)
    result = {
        "agents": n, "client_processes": len(clients), "all_up_s": round(all_up_s, 3),
        "register_rtt_p50_s": round(percentile(registers, 50), 5),
        "register_rtt_p99_s": round(percentile(registers, 99), 5),
        "controller_cpu_fraction": round(cpu_frac, 4),
        "controller_cpu_ms_per_agent_s": round(1000 * cpu_frac / n, 4),
        "relays": len(relays),
        "relays_cpu_fraction": round((relay_cpu1 - relay_cpu0) / (t1 - t0), 4),
        "probe_rtt_p50_s": round(percentile(rtts, 50), 5) if rtts else None,
        "probe_rtt_p99_s": round(percentile(rtts, 99), 5) if rtts else None,
        "probes": len(rtts),
        "agents_alive_in_window": agents_seen,
        "unanswered_kills": sum(1 for r in reacted if r.get("unanswered")),
        "death_to_first_plan_s": reacted[0]["first_s"] if reacted else None,
        "death_to_last_plan_s": reacted[0]["last_s"] if reacted else None,
        "survivors_with_new_plan": reacted[0]["survivors"] if reacted else 0,
        "kills": reacted, "killed": sum(t is not None for o in outputs for t in o["kills_at"]),
        "sim_racks": config.sim_racks,
        "death_to_first_plan_p50_s": round(percentile(firsts, 50), 5) if firsts else None,
        "death_to_last_plan_p50_s": round(percentile(lasts, 50), 5) if lasts else None,
        "death_to_last_plan_p99_s": round(percentile(lasts, 99), 5) if lasts else None,
        "death_to_last_plan_by_kind": {kind: {
            "p50_s": round(percentile(times, 50), 5), "p99_s": round(percentile(times, 99), 5)}
            for kind in ("racks", "agents") if (times := [
                r["last_by_kind_s"][kind] for r in reacted if kind in r["last_by_kind_s"]])},
        "generation_after_death": status.generation,
        "agents_alive_after_death": status.agents, "heartbeats": sum(o["heartbeats"]
                                                                      for o in outputs),
        "session_errors": len(errors), "first_errors": errors[:3],
        # Sessions that failed before registering and were retried (as agents do).
        "sessions_retried": sum(len(o.get("retries", [])) for o in outputs),
        "retry_reasons": sorted({r for o in outputs for r in o.get("retries", [])}),
    }
    progress(f"N={n}: up in {all_up_s:.1f}s, controller CPU {cpu_frac * 100:.1f}% of a core, "
             f"probe p99 {result['probe_rtt_p99_s']}s, death -> last plan "
             f"{result['death_to_last_plan_s']}s (p99 of {len(lasts)} kills: "
             f"{result['death_to_last_plan_p99_s']}s), load {environment()['loadavg_1m']}")
    return result


def run(config: ScaleConfig, progress: Callable[[str], None]) -> dict[str, Any]:
    env = environment()
    rows = []
    for n in config.agents:
        try:
            rows.append(measure(n, config, progress))
        except RuntimeError as exc:
            progress(f"N={n}: {exc}")
            rows.append({"agents": n, "error": str(exc)})
            break  # a larger N will not do better
    ok = [r for r in rows if "error" not in r]
    fit = cpu_fit([(r["agents"], r["controller_cpu_fraction"]) for r in ok])
    return {"benchmark": "controller", "environment": env,
            "loadavg_1m_end": environment()["loadavg_1m"],
            "config": {"agents": config.agents, "duration_s": config.duration_s,
                       "relays": config.relays, "sim_racks": config.sim_racks,
                       "kills": config.kills,
                       "heartbeat_s": config.heartbeat_s, "slots_per_agent": 1},
            "rows": rows, "cpu_fixed_fraction": fit[0] if fit else None,
            "cpu_fraction_per_agent": fit[1] if fit else None,
            "agents_per_core_extrapolated": agents_per_core(fit) if fit else None,
            "median_cpu_ms_per_agent_s": round(statistics.median(
                r["controller_cpu_ms_per_agent_s"] for r in ok), 4) if ok else None}
