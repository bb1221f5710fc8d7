"""The etcd Store against real etcd processes: contract, member loss, restarts."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from recover.controller.etcd_store import EtcdStore, parse_etcd_url
from recover.controller.store import StoreError, open_store
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
