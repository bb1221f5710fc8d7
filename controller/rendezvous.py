"""The rendezvous store the workers build each generation's process group on.

It lives in the controller process, outside every worker, so losing any
worker never loses the store; generations keep their keys apart by prefix.

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
import socket
import threading
from datetime import timedelta
from typing import Any

log = logging.getLogger("recover.controller")


class RendezvousHost:
    """A c10d TCPStore server on `host:port` (port 0 picks a free one).

    The port is bound and listening at once; the store itself starts on a thread, because
    it needs torch, whose import (about 3 s of CPU here) would otherwise delay the
    controller's gRPC service and every job's start. Workers reach the store only when the
    first generation forms: a connection made earlier waits in the listen backlog.
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 0) -> None:
        self.host = host
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._listener = socket.socket(family, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind((host, port))
        self._listener.listen(1024)
        self.port: int = self._listener.getsockname()[1]
        self._store: Any = None
        self.error = ""
        """Why the store could not start (logged too); empty while it starts or once it has."""
        self._starting = threading.Thread(target=self._start, name="rendezvous-start",
                                          daemon=True)
        self._starting.start()

    def _start(self) -> None:
        try:
            from torch.distributed import TCPStore

            self._store = TCPStore(
                self.host, self.port, is_master=True, wait_for_workers=False,
                timeout=timedelta(seconds=30), use_libuv=True,
                master_listen_fd=self._listener.fileno())
        except Exception as exc:  # noqa: BLE001 (whatever it is, workers cannot form groups)
            self.error = f"{type(exc).__name__}: {exc}"
            log.error("the rendezvous store on %s could not start: %s", self.address, self.error)
            self._listener.close()
            return
        # The store owns the descriptor from here on and closes it itself; a second close
        # from Python would fail, or close whatever reused the number meanwhile.
        self._listener.detach()

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def wait_started(self, timeout_s: float | None = None) -> bool:
        """True once the store serves (False: still starting, or `error` says why not)."""
        self._starting.join(timeout_s)
        return self._store is not None

    def close(self) -> None:
        self._starting.join()
        self._store = None
