"""The etcd Store against real etcd processes: contract, member loss, restarts."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from recover.controller.etcd_store import EtcdStore, parse_etcd_url
from recover.controller.store import KeyChange, StoreError
from recover.controller.store_url import open_store
from tests.etcd_cluster import EtcdCluster, free_port


@pytest.fixture()
def single(tmp_path: Path) -> Iterator[EtcdCluster]:
    cluster = EtcdCluster(tmp_path / "etcd", 1).start()
    yield cluster
    cluster.stop()


@pytest.fixture()
def trio(tmp_path: Path) -> Iterator[EtcdCluster]:
    cluster = EtcdCluster(tmp_path / "etcd", 3).start()
    yield cluster
    cluster.stop()


def run(coro):  # type: ignore[no-untyped-def]
    return asyncio.run(coro)


def test_store_contract_on_real_etcd(single: EtcdCluster) -> None:
    async def scenario() -> None:
        store = open_store(single.url)
        assert isinstance(store, EtcdStore)
        assert await store.get("/t/a") is None
        await store.put("/t/b", b"2")
        await store.put("/t/a", b"1")
        await store.put_many([("/t/c", b"3"), ("/u/x", b"9")])
        assert await store.get("/t/a") == b"1"
        assert await store.get_prefix("/t/") == [("/t/a", b"1"), ("/t/b", b"2"), ("/t/c", b"3")]
        await store.delete("/t/b")
        assert [k for k, _ in await store.get_prefix("/t/")] == ["/t/a", "/t/c"]
        assert await store.compare_and_put("/lock", None, b"me")
        assert not await store.compare_and_put("/lock", None, b"you")
        assert not await store.compare_and_put("/lock", b"you", b"x")
        assert await store.compare_and_put("/lock", b"me", b"me2")
        assert await store.get("/lock") == b"me2"
        await store.close()

    run(scenario())


def test_survives_losing_one_member_of_three(trio: EtcdCluster) -> None:
    async def scenario() -> None:
        store = EtcdStore(trio.endpoints(), retry_s=15)
        await store.put("/k", b"before")
        for victim in range(3):  # whichever member the channel uses, one of these hits it
            trio.kill_member(victim)
            started = time.monotonic()
            await store.put(f"/k{victim}", b"after")
            assert await store.get(f"/k{victim}") == b"after"
            assert time.monotonic() - started < 15
            trio.start_member(victim)
            trio.wait_healthy(members=[victim])
        assert await store.get("/k") == b"before"
        await store.close()

    run(scenario())


class Watching:
    """Collects a key's watch in a background task, for tests that break etcd under it."""

    def __init__(self, store: EtcdStore, key: str) -> None:
        self.seen: list[KeyChange] = []
        self._task = asyncio.create_task(self._collect(store, key))

    async def _collect(self, store: EtcdStore, key: str) -> None:
        async for change in store.watch(key):
            self.seen.append(change)

    async def until(self, count: int, timeout_s: float = 20.0) -> list[KeyChange]:
        deadline = time.monotonic() + timeout_s
        while len(self.seen) < count:
            assert time.monotonic() < deadline, f"watch saw only {self.seen} of {count} changes"
            await asyncio.sleep(0.02)
        return self.seen

    async def stop(self) -> None:
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)


def test_a_watch_outlives_member_loss_and_skips_nothing(trio: EtcdCluster) -> None:
    async def scenario() -> None:
        watched = EtcdStore(trio.endpoints(), retry_s=15)
        writer = EtcdStore(trio.endpoints(), retry_s=15)
        await writer.put("/w", b"start")
        watching = Watching(watched, "/w")
        assert [c.value for c in await watching.until(1)] == [b"start"]
        for victim in range(3):  # one of these is the member the watch streams from
            trio.kill_member(victim)
            # Written while the watch may be broken: it must come back from the
            # revision after the last one it saw, not from "now".
            for i in range(3):
                await writer.put("/w", f"{victim}.{i}".encode())
            await writer.delete("/w")
            await watching.until(1 + 4 * (victim + 1))
            trio.start_member(victim)
            trio.wait_healthy(members=[victim])
        seen = watching.seen
        expected = [b"start"] + [v for victim in range(3)
                                 for v in (*(f"{victim}.{i}".encode() for i in range(3)), None)]
        assert [c.value for c in seen] == expected  # every change once, in order
        assert [c.revision for c in seen] == sorted({c.revision for c in seen})
        await watching.stop()
        await watched.close()
        await writer.close()

    run(scenario())


def test_closing_the_store_ends_its_watches_without_reconnecting(single: EtcdCluster) -> None:
    async def scenario() -> None:
        store = EtcdStore(single.endpoints())
        watching = Watching(store, "/z")
        await watching.until(1)
        await store.close()
        await asyncio.wait_for(asyncio.shield(watching._task), 5)  # ended on its own
        writer = EtcdStore(single.endpoints())
        await writer.put("/z", b"after close")
        await asyncio.sleep(0.3)
        assert [c.value for c in watching.seen] == [None]
        assert not store._client.channel  # no channel re-opened behind the closed store
        await writer.close()

    run(scenario())


def test_a_watch_behind_a_compaction_reports_the_current_value(single: EtcdCluster) -> None:
    async def scenario() -> None:
        store = EtcdStore(single.endpoints())
        await store.put("/c", b"1")
        start = (await store._read("/c")).revision
        for value in (b"2", b"3"):
            await store.put("/c", value)
        latest = (await store._read("/c")).revision
        await store._client.compact(latest)
        # As if a watch broke at `start` and came back after the compaction: the
        # revisions in between are gone, so the current value is what it reports.
        changes = store._changes_after("/c", start)
        assert await asyncio.wait_for(anext(changes), 5) == KeyChange(latest, b"3")
        await store.put("/c", b"4")
        assert (await asyncio.wait_for(anext(changes), 5)).value == b"4"
        await changes.aclose()
        await store.close()

    run(scenario())


def test_data_survives_a_whole_cluster_restart(trio: EtcdCluster) -> None:
    async def write() -> None:
        store = EtcdStore(trio.endpoints())
        await store.put_many([(f"/ledger/{i:04d}", str(i).encode()) for i in range(50)])
        await store.close()

    async def read() -> list[tuple[str, bytes]]:
        store = EtcdStore(trio.endpoints(), retry_s=20)
        items = await store.get_prefix("/ledger/")
        await store.close()
        return items

    run(write())
    trio.restart()
    items = run(read())
    assert [v for _, v in items] == [str(i).encode() for i in range(50)]


def test_a_watch_outlives_a_whole_cluster_restart(single: EtcdCluster) -> None:
    async def scenario() -> None:
        store = EtcdStore(single.endpoints(), retry_s=20)
        watching = Watching(store, "/r")
        await watching.until(1)
        await store.put("/r", b"before")
        await watching.until(2)
        await asyncio.to_thread(single.restart)
        await store.put("/r", b"after")
        assert [c.value for c in await watching.until(3)] == [None, b"before", b"after"]
        await watching.stop()
        await store.close()

    run(scenario())


def test_unreachable_etcd_is_a_clear_error() -> None:
    async def scenario() -> None:
        store = EtcdStore([("127.0.0.1", free_port())], retry_s=1.0, op_timeout_s=0.5)
        with pytest.raises(StoreError, match="etcd at etcd://127.0.0.1:.* failed to write"):
            await store.put("/k", b"v")
        await store.close()

    run(scenario())


@pytest.mark.parametrize("url", ["etcd://", "etcd://host", "etcd://h:0", "etcd://a:1,b", "etcd://h:x"])
def test_malformed_urls(url: str) -> None:
    with pytest.raises(ValueError, match="is not HOST:PORT|must start"):
        parse_etcd_url(url)
    with pytest.raises(StoreError):
        open_store(url)


def test_multi_member_url() -> None:
    assert parse_etcd_url("etcd://127.0.0.1:2379,10.0.0.2:2380/") == [("127.0.0.1", 2379),
                                                                       ("10.0.0.2", 2380)]
