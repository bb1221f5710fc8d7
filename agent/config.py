"""An agent's settings, and the one error that ends it."""

from __future__ import annotations

import socket
import uuid
from dataclasses import dataclass, field

from recover.agent.restarts import RESTART_WINDOW_S
from recover.common.security import Security


class AgentError(Exception):
    """The agent cannot go on; the message says why, for a one-line error."""


@dataclass(frozen=True)
class AgentConfig:
    controller: str
    """host:port of the controller, or a comma-separated list of every controller of the job
    (the agent finds the leader among them, and the new one after a failover)."""
    slots: int
    """Worker slots on this host (one worker, one replica each)."""
    command: list[str] | None = None
    """The worker command, e.g. ['python', 'train.py', '--lr', '1e-3']; None: the job's own
    (its workload command, set on the controller)."""
    agent_id: str = field(default_factory=lambda: f"{socket.gethostname()}-{uuid.uuid4().hex[:6]}")
    """Unique name of this agent in the job."""
    heartbeat_s: float = 0.5
    """Longest the leader goes without a message from this agent (a heartbeat when nothing
    else was sent); the controller declares an agent lost after a few periods of silence."""
    connect_timeout_s: float = 10.0
    """How long to wait for the controller to answer at start."""
    leader_timeout_s: float = 2.0
    """A leader silent this long (it heartbeats every ~0.5 s) is presumed stopped or cut off."""
    reconnect_timeout_s: float = 20.0
    """After losing the leader, how long to look for a new one before stopping the workers."""
    log_dir: str | None = None
    """Write each worker's output to LOG_DIR/replica-N.log instead of inheriting stdout."""
    shutdown_grace_s: float = 5.0
    """How long workers get to exit on their own when the job ends."""
    metrics_port: int | None = None
    """Serve Prometheus metrics on 127.0.0.1:PORT/metrics (0: any free port; None: off)."""
    metrics_host: str = "127.0.0.1"
    """Address the metrics endpoint listens on."""
    metrics_port_file: str | None = None
    """Write the metrics endpoint's port here once it listens."""
    max_restarts: int = 3
    """Times a slot's worker is replaced after it dies (with backoff) within
    `restart_window_s`; 0: never."""
    restart_window_s: float = RESTART_WINDOW_S
    """Restarts older than this no longer count against a slot."""
    security: Security = Security()
    """Credentials towards the controller (TLS, a client certificate, a token)."""
    attach_pid: int | None = None
    """Instead of spawning a worker, adopt this process (the single-process mode: the user's
    `python train.py` runs the job's one replica itself; trainer/standalone.py)."""
    attach_file: str | None = None
    """With `attach_pid`: where the attached process reads its identity (agent/attached.py)."""
    warm_start: bool = True
    """Fork workers from a warm interpreter that has imported torch once (see
    recover.agent.zygote) when the command is `python SCRIPT` or `python -m MODULE`;
    False: every worker is a fresh process (`--cold-start`)."""


    @property
    def controllers(self) -> list[str]:
        return [a.strip() for a in self.controller.split(",") if a.strip()]
