"""The rendezvous store the workers build each generation's process group on.

It lives in the controller process, outside every worker, so losing any
worker never loses the store; generations keep their keys apart by prefix.
"""

from __future__ import annotations

from datetime import timedelta


class RendezvousHost:
    """A c10d TCPStore server on `host:port` (port 0 picks a free one)."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0) -> None:
        # Imported here so the controller's CLI answers --help without loading torch.
        from torch.distributed import TCPStore

        self.host = host
        self._store = TCPStore(
            host, port, is_master=True, wait_for_workers=False,
            timeout=timedelta(seconds=30), use_libuv=True)
        self.port: int = self._store.port

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def close(self) -> None:
        del self._store
