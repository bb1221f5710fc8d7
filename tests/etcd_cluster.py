"""Real etcd processes on free loopback ports, for tests (Debian package etcd-server)."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

ETCD = shutil.which("etcd")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def require_etcd() -> str:
    if ETCD is None:
        pytest.skip("etcd is not installed (apt-get install -y etcd-server; .ci/run does it)")
    return ETCD


class EtcdCluster:
    """n members, each with its own data directory; started, stopped and restarted for real."""

    def __init__(self, root: Path, members: int = 1) -> None:
        self.binary = require_etcd()
        self.root = root
        self.names = [f"m{i}" for i in range(members)]
        self.client_ports = [free_port() for _ in self.names]
        self.peer_ports = [free_port() for _ in self.names]
        self.processes: list[subprocess.Popen[bytes] | None] = [None] * members
        self._logs: list[object] = []

    @property
    def url(self) -> str:
        return "etcd://" + ",".join(f"127.0.0.1:{p}" for p in self.client_ports)

    def endpoints(self) -> list[tuple[str, int]]:
        return [("127.0.0.1", p) for p in self.client_ports]

    def _argv(self, i: int) -> list[str]:
        cluster = ",".join(f"{n}=http://127.0.0.1:{p}" for n, p in zip(self.names, self.peer_ports,
                                                                        strict=True))
        return [
            self.binary, "--name", self.names[i], "--data-dir", str(self.root / self.names[i]),
            "--listen-client-urls", f"http://127.0.0.1:{self.client_ports[i]}",
            "--advertise-client-urls", f"http://127.0.0.1:{self.client_ports[i]}",
            "--listen-peer-urls", f"http://127.0.0.1:{self.peer_ports[i]}",
            "--initial-advertise-peer-urls", f"http://127.0.0.1:{self.peer_ports[i]}",
            "--initial-cluster", cluster, "--initial-cluster-state", "new",
            "--initial-cluster-token", f"recover-test-{os.getpid()}",
            # Short elections keep failover tests quick.
            "--heartbeat-interval", "100", "--election-timeout", "1000",
        ]

    def start_member(self, i: int) -> None:
        log = open(self.root / f"{self.names[i]}.log", "ab")  # noqa: SIM115 (closed in stop())
        self._logs.append(log)
        self.processes[i] = subprocess.Popen(self._argv(i), stdout=log, stderr=subprocess.STDOUT,
                                             env={**os.environ, "ETCD_UNSUPPORTED_ARCH": "arm64"})

    def start(self, timeout_s: float = 30.0) -> EtcdCluster:
        self.root.mkdir(parents=True, exist_ok=True)
        for i in range(len(self.names)):
            self.start_member(i)
        self.wait_healthy(timeout_s)
        return self

    def wait_healthy(self, timeout_s: float = 30.0, members: list[int] | None = None) -> None:
        deadline = time.monotonic() + timeout_s
        for i in members if members is not None else range(len(self.names)):
            url = f"http://127.0.0.1:{self.client_ports[i]}/health"
            while True:
                try:
                    out = subprocess.run(["python3", "-c", f"import urllib.request;print("
                                          f"urllib.request.urlopen('{url}',timeout=1).read())"],
                                         capture_output=True, text=True, timeout=5)
                    if '"health":"true"' in out.stdout:
                        break
                except subprocess.TimeoutExpired:
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError(f"etcd member {i} not healthy after {timeout_s}s")
                time.sleep(0.2)

    def kill_member(self, i: int, sig: int = signal.SIGKILL) -> None:
        process = self.processes[i]
        if process is not None and process.poll() is None:
            process.send_signal(sig)
            process.wait(timeout=10)
        self.processes[i] = None

    def stop(self) -> None:
        for i in range(len(self.names)):
            self.kill_member(i, signal.SIGTERM)
        for log in self._logs:
            log.close()  # type: ignore[attr-defined]
        self._logs.clear()

    def restart(self, timeout_s: float = 30.0, down_s: float = 0.0) -> None:
        """Stop every member, stay down `down_s`, and start them again on the same data."""
        self.stop()
        time.sleep(down_s)
        for i in range(len(self.names)):
            self.start_member(i)
        self.wait_healthy(timeout_s)
