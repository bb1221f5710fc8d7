"""The rendezvous store the workers build each generation's process group on.

It lives outside every worker, so losing any worker never loses the store; generations keep
their keys apart by prefix. It runs in a process of its own that the controller supervises
(controller/rendezvous_store.py), bounded in memory and keys: a stranger's flood costs that
process a reset, never the controller its memory.

Closed to strangers as far as c10d allows (it has no authentication): the
store listens only on the controller's own address (c10d's TCPStore would bind
every interface; it is handed a socket bound here instead), and each
generation's keys live under a random prefix that only the members learn,
through their authenticated agents (`GenerationView.rendezvous_prefix`): a
client that reaches the port can neither read nor write a group's keys
without guessing 128 random bits.
"""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import threading
import time

log = logging.getLogger("recover.controller")

MAX_MB = 128
"""Memory the store may hold beyond what it holds empty (a generation's keys are a few
hundred bytes a member)."""
MAX_KEYS = 100_000
"""Keys the store may hold before it is reset (every generation adds a few per member and
nothing deletes them: a reset also clears a long job's old generations)."""
RESTART_BACKOFF_S = (0.0, 1.0, 5.0)
"""Waits before restarting a store that ended, by how many ended within a minute: a store
that cannot start (torch missing) is not restarted in a tight loop."""


class RendezvousHost:
    """The rendezvous store on `host:port` (port 0 picks a free one), in a supervised process.

    The port is bound and listening at once, in this process, and handed to each store
    process in turn: a client that connects while a store starts (its `import torch` takes
    about 3 s of CPU here) or restarts waits in the listen backlog. The controller itself
    never imports torch for it.
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 0, *, max_mb: int = MAX_MB,
                 max_keys: int = MAX_KEYS) -> None:
        self.host = host
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._listener = socket.socket(family, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind((host, port))
        self._listener.listen(1024)
        self.port: int = self._listener.getsockname()[1]
        self._command = [sys.executable, "-m", "recover.controller.rendezvous_store",
                         "--fd", str(self._listener.fileno()), "--max-mb", str(max_mb),
                         "--max-keys", str(max_keys)]
        self.error = ""
        """Why the store could not start (logged too); empty while it starts or once it has."""
        self.resets = 0
        """Stores replaced after reaching a bound (each logged with its reason)."""
        self._started = threading.Event()
        self._closing = threading.Event()
        self._lock = threading.Lock()
        self._process: subprocess.Popen[str] | None = None
        # One thread for the host's life: a store process is killed when the thread that
        # started it ends (the parent-death signal is per thread), so it starts them all.
        self._supervisor = threading.Thread(target=self._supervise, name="rendezvous-store",
                                            daemon=True)
        self._supervisor.start()

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def wait_started(self, timeout_s: float | None = None) -> bool:
        """True once a store serves (False: still starting, or `error` says why not)."""
        return self._started.wait(timeout_s) and not self.error

    def _supervise(self) -> None:
        ended: list[float] = []
        while not self._closing.is_set():
            reason = self._serve_once()
            if self._closing.is_set():
                return
            now = time.monotonic()
            ended = [t for t in ended if now - t < 60.0] + [now]
            if reason.startswith("reset: "):
                self.resets += 1
                log.warning("rendezvous store on %s reset (%s): a group being built now is "
                            "built again by the next generation", self.address,
                            reason.removeprefix("reset: "))
            else:
                self.error = reason
                self._started.set()  # whoever waits for it learns why not
                log.error("the rendezvous store on %s ended: %s", self.address, reason)
            self._closing.wait(RESTART_BACKOFF_S[min(len(ended), len(RESTART_BACKOFF_S)) - 1])

    def _serve_once(self) -> str:
        """Run one store process until it ends; why it ended."""
        try:
            process = subprocess.Popen(self._command, pass_fds=(self._listener.fileno(),),
                                       stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                       text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
        except OSError as exc:
            return f"could not start: {exc}"
        with self._lock:
            self._process = process
        if self._closing.is_set():  # close() ran between the check and the start
            process.kill()
        last = ""
        assert process.stdout is not None
        for line in process.stdout:
            last = line.strip()
            if last == "ready":
                self.error = ""
                self._started.set()
        code = process.wait()
        return last if last.startswith("reset: ") else f"exit code {code}"

    def close(self) -> None:
        self._closing.set()
        with self._lock:
            process = self._process
        if process is not None and process.poll() is None:
            process.kill()
        self._supervisor.join(10.0)
        self._listener.close()
