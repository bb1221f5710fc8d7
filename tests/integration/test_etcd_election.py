"""Leases, fenced transactions and the election on a real etcd."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from recover.controller.etcd_store import EtcdStore
from recover.controller.leader import ElectionConfig, LeaderElection, LeaderStore, LostLeadership
from recover.controller.store import Write
from tests.etcd_cluster import EtcdCluster
from tests.unit.test_leader import a_planted_leader_key_is_ignored

pytestmark = pytest.mark.timeout(60)


def test_etcd_election_expiry_revoke_and_fencing(tmp_path: Path) -> None:
    cluster = EtcdCluster(tmp_path / "etcd", 1).start()

    async def scenario() -> None:
        store = EtcdStore(cluster.endpoints())
        config = ElectionConfig(ttl_s=2, recheck_s=30.0)  # only the watch wakes a standby in time
        a = LeaderElection(store, "e", "a:1", "a", config)
        b = LeaderElection(store, "e", "b:1", "b", config)
        assert await a.campaign() == 1
        await LeaderStore(a).put("/recover/e/x", b"1")
        assert not await store.transaction([("/recover/e/x", None)], [Write("/recover/e/x", b"2")])
        # a "crashes" (stops refreshing): b takes over within TTL + etcd's expiry tick.
        started = time.monotonic()
        assert await asyncio.wait_for(b.campaign(), 5) == 2
        assert time.monotonic() - started < 3.5
        a._valid_until = time.monotonic() + 10  # a's clock lies: the txn compare still refuses
        with pytest.raises(LostLeadership):
            await LeaderStore(a).put("/recover/e/x", b"a")
        assert await store.get("/recover/e/x") == b"1"
        keeper = asyncio.create_task(b.keep_leading())
        await asyncio.sleep(3)  # past the TTL: the keep-alive holds the lease
        assert b.holds() and (await b.leader()).controller_id == "b"  # type: ignore[union-attr]
        keeper.cancel()
        started = time.monotonic()
        await b.resign()
        c = LeaderElection(store, "e", "c:1", "c", config)
        assert await asyncio.wait_for(c.campaign(), 5) == 3
        assert time.monotonic() - started < 0.5  # revoked: no TTL to wait for
        for election in (a, b, c):
            await election.close()
        await a_planted_leader_key_is_ignored(store)  # the lease is etcd's, read back
        await store.close()

    try:
        asyncio.run(scenario())
    finally:
        cluster.stop()
