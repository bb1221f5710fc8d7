"""controller/rendezvous.py: the c10d store the workers' groups meet on, in a process of its
own that the controller supervises, bounded in memory and keys (issue 22 point 5)."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable
from datetime import timedelta

import pytest
from prometheus_client import CollectorRegistry
from torch.distributed import TCPStore

from recover.controller.metrics import RoleCollector
from recover.controller.rendezvous import RendezvousHost
from recover.controller.rendezvous_store import over_bound


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



def test_a_flood_is_refused_within_the_bound_and_the_store_is_reset_not_the_controller() -> None:
    # Real processes (the store's own, under RLIMIT_DATA): the bound is the kernel's and the
    # libuv store's behaviour at it, which no fake can stand for.
    host = RendezvousHost(max_mb=16, max_keys=2000)
    try:
        client = TCPStore("127.0.0.1", host.port, is_master=False, timeout=timedelta(seconds=30))
        client.set("gen/1/members-key", "kept until a reset")
        before = rss_bytes()
        written = 0
        with pytest.raises(RuntimeError):  # the writer's connection is dropped
            for _ in range(200):
                client.set(f"flood/{written}", b"x" * (1 << 20))
                written += 1
        # A set returns once its bytes are in the socket's buffers (several MB on loopback):
        # what was sent may pass the budget by those, never by much more.
        assert written <= 16 + 16, written
        # The controller's side (this process, which hosts the RendezvousHost) took in none
        # of it: the store lived in this process before, and grew by every byte written.
        assert rss_bytes() - before < 8 << 20, (rss_bytes() - before) >> 20
        assert wait_for(lambda: host.resets >= 1, 60), "the store was not reset"
        fresh = TCPStore("127.0.0.1", host.port, is_master=False, timeout=timedelta(seconds=30))
        assert not fresh.check(["gen/1/members-key"])  # a new, empty store...
        fresh.set("gen/2/key", "value")  # ...that serves the next generation
        assert fresh.get("gen/2/key") == b"value" and host.error == ""
        # Many small keys: the key bound resets it too.
        for i in range(2100):
            fresh.set(f"k/{i}", "v")
        assert wait_for(lambda: host.resets >= 2, 60), "the key bound did not reset the store"
        # Operators see the resets (an attack, or a very long job's keys) in the metrics.
        registry = CollectorRegistry()
        registry.register(RoleCollector(FakeElection(), host))  # type: ignore[arg-type]
        assert registry.get_sample_value("recover_rendezvous_resets_total") == host.resets
    finally:
        host.close()


class FakeElection:
    """What RoleCollector reads of an election (the rendezvous part is what is tested)."""

    refused_writes = 0

    def holds(self) -> bool:
        return True


def rss_bytes() -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmRSS:"))


def wait_for(condition: Callable[[], bool], timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return condition()


@pytest.mark.parametrize(("keys", "grown", "reason"), [
    (10, 0, None),
    (2001, 0, "2001 keys, more than 2000"),
    (10, 8 << 20, None),  # half the budget: still fine
    (10, (8 << 20) + 1, "8 MiB written, more than half of its 16 MiB"),
])
def test_the_store_is_reset_past_its_key_bound_or_half_its_memory(
        keys: int, grown: int, reason: str | None) -> None:
    assert over_bound(keys, grown, max_keys=2000, max_bytes=16 << 20) == reason
