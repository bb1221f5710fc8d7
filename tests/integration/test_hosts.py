"""The parts started by hand (the deploy recipe): host loss, status, events, metrics."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from recover.cli.inspect import to_json
from tests.etcd_cluster import free_port
from tests.integration.conftest import control_events, control_status, recover_cmd, wait_for

pytestmark = pytest.mark.slow

OUTLASTS_THE_TEST = "100000"
"""Steps of a job these tests stop themselves: it must still be running when they check its
agents and plan, however fast the survivors train (400 steps once ended before a busy
machine's `recover status` polls were done, and a finished job has no agents to count)."""


def status_or_none(address: str, netns: str | None = None) -> dict[str, Any] | None:
    """The job's status as `recover status --json` prints it, or None while the controller is
    not answering yet (it imports torch first: seconds on a busy machine). Asked in this
    process, not by a `recover status` per poll: a poll loop of Python processes takes the
    CPU the job under test needs (the command itself is tested where its output is read).
    Inside network namespace `netns` only a process can ask: `recover status` then."""
    if netns is None:
        status = control_status(address)
        return None if status is None else json.loads(to_json(status))
    prefix = ["ip", "netns", "exec", netns]
    out = subprocess.run([*prefix, *recover_cmd("status", "--controller", address, "--json")],
                         capture_output=True, text=True, timeout=30)
    return json.loads(out.stdout.splitlines()[0]) if out.returncode == 0 else None


def job_state(address: str) -> str | None:
    status = status_or_none(address)
    return None if status is None else status["state"]


def steps_committed(address: str, netns: str | None = None) -> int:
    status = status_or_none(address, netns)
    return -1 if status is None else status["steps_committed"]


def recover_json(*args: str, netns: str | None = None) -> Any:
    """`recover ARGS --json`, parsed; inside network namespace `netns` if given."""
    prefix = ["ip", "netns", "exec", netns] if netns else []
    out = subprocess.run([*prefix, *recover_cmd(*args, "--json")], capture_output=True, text=True,
                         timeout=20)
    assert out.returncode == 0, out.stderr
    return [json.loads(line) for line in out.stdout.splitlines()]


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        return response.read().decode()


def metric(text: str, name: str, labels: str = "") -> float:
    match = re.search(rf"^{re.escape(name)}{re.escape(labels)} (\S+)$", text, re.MULTILINE)
    assert match, f"{name}{labels} not in metrics"
    return float(match.group(1))


def test_host_loss_kill_and_stop(tmp_path: Path) -> None:
    port, metrics_port, agent_metrics = free_port(), free_port(), free_port()
    address = f"127.0.0.1:{port}"
    logs = tmp_path / "logs"
    processes: list[subprocess.Popen[bytes]] = []
    logs.mkdir()

    def start(name: str, *args: str) -> subprocess.Popen[bytes]:
        with open(logs / f"{name}.log", "wb") as log:  # the child keeps its own descriptor
            process = subprocess.Popen(recover_cmd(*args), stdout=log, stderr=subprocess.STDOUT,
                                       start_new_session=True)
        processes.append(process)
        return process

    try:
        controller = start("controller", "controller", "--port", str(port), "--replicas", "4",
                           "--steps", OUTLASTS_THE_TEST, "-M", "8", "-B", "4", "--metrics-port",
                           str(metrics_port), "--job-id", "hosts")
        time.sleep(0.5)
        start("agent-a", "agent", "--controller", address, "--slots", "2", "--agent-id", "a",
              "--log-dir", str(logs), "--metrics-port", str(agent_metrics))
        killed = start("agent-b", "agent", "--controller", address, "--slots", "1",
                       "--agent-id", "b", "--log-dir", str(logs))
        stopped = start("agent-c", "agent", "--controller", address, "--slots", "1",
                        "--agent-id", "c", "--log-dir", str(logs))
        wait_for(lambda: steps_committed(address) >= 3, 90, "training to start")
        lost_at = time.time()
        os.kill(killed.pid, signal.SIGKILL)
        os.kill(stopped.pid, signal.SIGSTOP)

        def lost_events() -> list[dict[str, Any]]:
            lost = [json.loads(to_json(e)) for e in control_events(address)
                    if e.kind == "agent-lost"]
            return lost if len(lost) == 2 else []

        # Judged on the controller's own event times (same machine, same clock),
        # so a slow `recover events` poll cannot make the bound look missed.
        for event in wait_for(lost_events, 15, "both hosts declared lost"):
            assert event["at"] - lost_at < 3.0 + 1.0, event  # agent timeout 3 s, plus slack
        status = recover_json("status", "--controller", address)[0]
        # Replica ids follow registration order, which the agents race for.
        registered = next(e["message"] for e in recover_json("events", "--controller", address)
                          if e["kind"] == "agent-registered" and e["message"].startswith("agent a "))
        assert status["live_replicas"] == json.loads(registered.rsplit("replicas ", 1)[1])
        assert status["agents"] == 1
        progressed = status["steps_committed"]
        wait_for(lambda: steps_committed(address) > progressed + 5, 60,
                 "training to go on with the rest")
        text = scrape(metrics_port)
        assert metric(text, "recover_failures_total", '{cause="agent-lost"}') == 2
        assert metric(text, "recover_live_replicas") == 2
        assert metric(text, "recover_recovery_seconds_count", '{phase="rebuild"}') >= 1
        assert metric(scrape(agent_metrics), "recover_agent_workers", '{state="running"}') == 2
        status = recover_json("status", "--controller", address)[0]
        # The two survivors hold all 8 microbatches (how they split them follows their
        # measured speeds: the default policy).
        loads = [entry["microbatches"] for entry in status["load"]]
        assert len(loads) == 2 and sum(loads) == 8, loads
        os.kill(stopped.pid, signal.SIGCONT)  # the zombie host wakes up: it must stand down
        assert stopped.wait(timeout=15) == 1
        controller.send_signal(signal.SIGTERM)
        controller.wait(timeout=15)
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait()
