"""MemoryStore's watch: the value now, then every change (writes, deletes, leases ending)."""

from __future__ import annotations

import asyncio
import time

from recover.controller.store import KeyChange, MemoryStore, Write


async def _next(changes, timeout_s: float = 2.0) -> KeyChange:  # type: ignore[no-untyped-def]
    return await asyncio.wait_for(anext(changes), timeout_s)


def test_watch_reports_the_current_value_then_every_change_in_order() -> None:
    async def scenario() -> None:
        store = MemoryStore()
        await store.put("k", b"0")
        changes = store.watch("k")
        first = await _next(changes)
        assert first.value == b"0"
        await store.put("other", b"x")  # another key: not reported
        await store.put("k", b"1")
        await store.put_many([("k", b"2"), ("j", b"y")])
        assert await store.compare_and_put("k", b"2", b"3")
        assert not await store.compare_and_put("k", b"2", b"4")  # refused: no change
        assert await store.transaction([("k", b"3")], [Write("k", b"5")])
        await store.delete("k")
        await store.delete("k")  # already absent: no change
        seen = [await _next(changes) for _ in range(5)]
        assert [c.value for c in seen] == [b"1", b"2", b"3", b"5", None]
        revisions = [first.revision, *(c.revision for c in seen)]
        assert revisions == sorted(set(revisions))  # strictly increasing
        await changes.aclose()
        assert store._watchers["k"] == []  # a closed watch leaves nothing behind

    asyncio.run(scenario())


def test_watch_sees_a_leased_key_vanish_when_its_lease_ends() -> None:
    async def scenario() -> None:
        store = MemoryStore()
        revoked, expiring = await store.grant_lease(60), await store.grant_lease(1)
        await store.transaction([], [Write("a", b"1", revoked), Write("b", b"1", expiring)])
        watch_a, watch_b = store.watch("a"), store.watch("b")
        assert (await _next(watch_a)).value == b"1"
        assert (await _next(watch_b)).value == b"1"
        await store.revoke_lease(revoked)
        assert (await _next(watch_a)).value is None
        # Nobody reads the store: the watch itself must notice the expiry.
        started = time.monotonic()
        assert (await _next(watch_b, 3.0)).value is None
        assert 0.5 < time.monotonic() - started < 2.0
        await watch_a.aclose()
        await watch_b.aclose()

    asyncio.run(scenario())
