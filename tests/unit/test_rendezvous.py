"""controller/rendezvous.py: the c10d store the workers' groups meet on, started on a thread
so that the controller answers before torch is imported."""

from __future__ import annotations

import socket
from datetime import timedelta

from torch.distributed import TCPStore

from recover.controller.rendezvous import RendezvousHost


def test_the_port_listens_at_once_and_the_store_serves_once_started() -> None:
    host = RendezvousHost()
    try:
        # Listening before the store runs: an early client waits in the backlog.
        with socket.create_connection(("127.0.0.1", host.port), timeout=5):
            pass
        client = TCPStore("127.0.0.1", host.port, is_master=False,
                          timeout=timedelta(seconds=30))
        client.set("gen-1/key", "value")
        assert client.get("gen-1/key") == b"value"
        assert host.wait_started(30) and host.error == ""
    finally:
        host.close()

