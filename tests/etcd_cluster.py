"""Real etcd processes on free loopback ports, for tests (Debian package etcd-server)."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass
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


@dataclass(frozen=True)
class TLSFiles:
    """A CA, the members' server certificate (for 127.0.0.1) and a client certificate."""

    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path


def make_tls(folder: Path) -> TLSFiles:
    from recover.cli.certs import init_ca, issue
    from recover.common.security import Role

    init_ca(folder, "etcd test CA", 2)
    server, server_key = issue(folder, "etcd", [Role.CONTROLLER], ["127.0.0.1", "localhost"], 2)
    client, client_key = issue(folder, "recover", [Role.CONTROLLER], [], 2)
    return TLSFiles(folder / "ca.pem", server, server_key, client, client_key)


class EtcdCluster:
    """n members, each with its own data directory; started, stopped and restarted for real."""

    def __init__(self, root: Path, members: int = 1, tls: TLSFiles | None = None) -> None:
        self.binary = require_etcd()
        self.root = root
        self.tls = tls
        self.names = [f"m{i}" for i in range(members)]
        self.client_ports = [free_port() for _ in self.names]
        self.peer_ports = [free_port() for _ in self.names]
        self.processes: list[subprocess.Popen[bytes] | None] = [None] * members
        self._logs: list[object] = []

    @property
    def url(self) -> str:
        members = ",".join(f"127.0.0.1:{p}" for p in self.client_ports)
        if self.tls is None:
            return "etcd://" + members
        return (f"etcds://{members}?ca={self.tls.ca}&cert={self.tls.client_cert}"
                f"&key={self.tls.client_key}&server_name=localhost")

    def endpoints(self) -> list[tuple[str, int]]:
        return [("127.0.0.1", p) for p in self.client_ports]

    def _argv(self, i: int) -> list[str]:
        cluster = ",".join(f"{n}=http://127.0.0.1:{p}" for n, p in zip(self.names, self.peer_ports,
                                                                        strict=True))
        scheme = "http" if self.tls is None else "https"
        tls = [] if self.tls is None else [
            "--cert-file", str(self.tls.server_cert), "--key-file", str(self.tls.server_key),
            "--trusted-ca-file", str(self.tls.ca), "--client-cert-auth"]
        return [
            self.binary, "--name", self.names[i], "--data-dir", str(self.root / self.names[i]),
            "--listen-client-urls", f"{scheme}://127.0.0.1:{self.client_ports[i]}",
            "--advertise-client-urls", f"{scheme}://127.0.0.1:{self.client_ports[i]}", *tls,
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
            probe = "import ssl,urllib.request;c=None;"
            if self.tls is not None:
                url = url.replace("http:", "https:")
                probe += (f"c=ssl.create_default_context(cafile='{self.tls.ca}');"
                          f"c.load_cert_chain('{self.tls.client_cert}','{self.tls.client_key}');")
            probe += f"print(urllib.request.urlopen('{url}',timeout=1,context=c).read())"
            while True:
                try:
                    out = subprocess.run(["python3", "-c", probe],
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
