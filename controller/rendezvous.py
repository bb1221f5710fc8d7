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

import socket
from datetime import timedelta


class RendezvousHost:
    """A c10d TCPStore server on `host:port` (port 0 picks a free one)."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0) -> None:
        # Imported here so the controller's CLI answers --help without loading torch.
        from torch.distributed import TCPStore

        self.host = host
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._listener = socket.socket(family, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind((host, port))
        self._listener.listen(1024)
        self.port: int = self._listener.getsockname()[1]
        self._store = TCPStore(
            host, self.port, is_master=True, wait_for_workers=False,
            timeout=timedelta(seconds=30), use_libuv=True,
            master_listen_fd=self._listener.fileno())
        # The store owns the descriptor from here on and closes it itself; a second close
        # from Python would fail, or close whatever reused the number meanwhile.
        self._listener.detach()

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def close(self) -> None:
        del self._store
