"""A host cut off from the network (not killed, not stopped) is declared lost, and
training goes on without it; when the link comes back, that host stands down.

Two network namespaces created here and joined by a veth pair, so nothing outside
this test is touched: the controller and agent `a` (2 workers) in one, agent `b`
(2 workers) in the other. Cutting the link is `ip link set ... down`: every process
keeps running, and their TCP connections just stop carrying packets.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from tests.integration.conftest import recover_cmd, wait_for
from tests.integration.test_hosts import OUTLASTS_THE_TEST, recover_json, steps_committed

pytestmark = pytest.mark.slow

SUBNET = "10.213.47"
"""Addresses exist only on this test's veth pair, inside its own namespaces."""


def ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=10)


class Namespaces:
    """ns-ctl (controller, agent a) <-veth-> ns-far (agent b)."""

    def __init__(self) -> None:
        tag = uuid.uuid4().hex[:6]
        self.ctl, self.far = f"rc-ctl-{tag}", f"rc-far-{tag}"
        self.ctl_if, self.far_if = f"vc{tag}", f"vf{tag}"
        ip("netns", "add", self.ctl)
        ip("netns", "add", self.far)
        ip("link", "add", self.ctl_if, "netns", self.ctl, "type", "veth", "peer", "name",
           self.far_if, "netns", self.far)
        for ns, ifname, host in ((self.ctl, self.ctl_if, 1), (self.far, self.far_if, 2)):
            ip("-n", ns, "addr", "add", f"{SUBNET}.{host}/24", "dev", ifname)
            ip("-n", ns, "link", "set", ifname, "up")
            ip("-n", ns, "link", "set", "lo", "up")

    def cut(self, down: bool) -> None:
        ip("-n", self.far, "link", "set", self.far_if, "down" if down else "up")

    def run(self, ns: str, argv: list[str], log: Path) -> subprocess.Popen[bytes]:
        # No GLOO_SOCKET_IFNAME: the workers must find the address that reaches the
        # rendezvous store themselves (the hostname resolves to none of this test's).
        env = {k: v for k, v in os.environ.items() if k != "GLOO_SOCKET_IFNAME"}
        env["PYTHONUNBUFFERED"] = "1"
        with open(log, "wb") as out:
            return subprocess.Popen(["ip", "netns", "exec", ns, *argv], stdout=out,
                                    stderr=subprocess.STDOUT, env=env, start_new_session=True)

    def remove(self) -> None:
        for ns in (self.ctl, self.far):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=10)


def status(ns: str, address: str, what: str = "status") -> Any:
    return recover_json(what, "--controller", address, netns=ns)


@pytest.fixture()
def namespaces():  # type: ignore[no-untyped-def]
    try:
        spaces = Namespaces()
    except (OSError, subprocess.CalledProcessError) as exc:
        pytest.skip(f"cannot create network namespaces here (needs root and iproute2): {exc}")
    yield spaces
    spaces.remove()


@pytest.mark.timeout(180)
def test_a_host_cut_off_from_the_network_is_lost_and_stands_down(namespaces, tmp_path: Path
                                                                  ) -> None:
    ns = namespaces
    address = f"{SUBNET}.1:50061"
    logs = tmp_path / "logs"
    logs.mkdir()
    processes: list[subprocess.Popen[bytes]] = []
    try:
        processes.append(ns.run(ns.ctl, recover_cmd(
            "controller", "--host", f"{SUBNET}.1", "--port", "50061", "--replicas", "4",
            "--steps", OUTLASTS_THE_TEST, "-M", "8", "-B", "4", "--job-id", "partition"),
            logs / "controller.log"))
        time.sleep(0.5)
        processes.append(ns.run(ns.ctl, recover_cmd(
            "agent", "--controller", address, "--slots", "2", "--agent-id", "a",
            "--log-dir", str(logs)), logs / "agent-a.log"))
        far = ns.run(ns.far, recover_cmd(
            "agent", "--controller", address, "--slots", "2", "--agent-id", "b",
            "--log-dir", str(logs)), logs / "agent-b.log")
        processes.append(far)
        wait_for(lambda: steps_committed(address, ns.ctl) >= 3, 90,
                 "training to start across both namespaces")
        cut_at = time.time()
        ns.cut(down=True)
        lost = wait_for(lambda: [e for e in status(ns.ctl, address, "events")
                                 if e["kind"] == "agent-lost"], 15, "the cut-off host declared lost")
        assert lost[0]["at"] - cut_at < 3.0 + 1.0, lost  # agent timeout 3 s, plus slack
        assert "agent b" in lost[0]["message"] or "'b'" in lost[0]["message"], lost
        now = status(ns.ctl, address)[0]
        assert now["agents"] == 1 and len(now["live_replicas"]) == 2
        assert far.poll() is None  # the cut-off host still runs: only the network is gone
        progressed = now["steps_committed"]
        wait_for(lambda: status(ns.ctl, address)[0]["steps_committed"] > progressed + 5, 60,
                 "training to go on with the rest")
        lost_replicas = {0, 1, 2, 3} - set(now["live_replicas"])
        far_workers = [int(e["message"].split()[1].rstrip(","))
                       for e in status(ns.ctl, address, "events")
                       if e["kind"] == "replica-ready" and e.get("replica") in lost_replicas]
        assert len(far_workers) == 2
        ns.cut(down=False)  # the link comes back: the lost host must not rejoin as if alive
        assert far.wait(timeout=30) == 1
        # ... and its workers, which trained on alone until now, go with it.
        wait_for(lambda: not any(Path(f"/proc/{pid}").exists() for pid in far_workers), 10,
                 "the cut-off host's workers to stop")
        final = status(ns.ctl, address)[0]
        assert final["agents"] == 1 and len(final["live_replicas"]) == 2
    finally:
        for process in processes:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
