"""`recover run --tls`: a throwaway CA and certificates for one local job, so that a
local run exercises mutual TLS end to end (the controller serves it, every agent and
the launcher present a certificate with its role)."""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

from recover.cli.certs import CA_KEY, init_ca, issue
from recover.common.security import Role, Security


@dataclass(frozen=True)
class LocalTLS:
    folder: Path

    def security(self, name: str) -> Security:
        return Security(cert=str(self.folder / f"{name}.pem"),
                        key=str(self.folder / f"{name}-key.pem"), ca=str(self.folder / "ca.pem"))

    def flags(self, name: str) -> list[str]:
        s = self.security(name)
        return ["--tls-cert", s.cert, "--tls-key", s.key, "--tls-ca", s.ca]


def local_tls(folder: Path, agents: int, relays: int = 0) -> LocalTLS:
    """A fresh CA in `folder`; certificates for the controllers, the relays rack0..R-1, agents
    host0..N-1 and the launcher (an operator); the CA's key is deleted once they are signed."""
    shutil.rmtree(folder, ignore_errors=True)
    init_ca(folder, "recover run (local)", 2)
    issue(folder, "controller", [Role.CONTROLLER], ["127.0.0.1", "localhost"], 2)
    for index in range(relays):
        issue(folder, f"rack{index}", [Role.RELAY], ["127.0.0.1", "localhost"], 2)
    for index in range(agents):
        issue(folder, f"host{index}", [Role.AGENT], [], 2)
    issue(folder, "launcher", [Role.READER, Role.OPERATOR], [], 2)  # it runs the job
    (folder / CA_KEY).unlink()  # one certificate serves every controller (the same address)
    return LocalTLS(folder)
