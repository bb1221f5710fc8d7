"""Leases, transactions and the election on MemoryStore; the pure fencing/lease/plan policies."""

from __future__ import annotations

import asyncio
import time

import pytest

from recover.agent.fencing import judge, leader_hint, wants_commit
from recover.controller.leader import (
    ElectionConfig,
    LeaderElection,
    LeaderStore,
    LostLeadership,
    lease_verdict,
)
from recover.controller.policy import RecoverPolicy
from recover.controller.records import PersistedJob
from recover.controller.store import MemoryStore, Store, Write
from recover.controller.takeover import resume_plan
from recover.proto import pb


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_memory_lease_expires_and_takes_its_keys() -> None:
    clock = Clock()
    store = MemoryStore(clock)

    async def scenario() -> None:
        lease = await store.grant_lease(2)
        assert await store.transaction([("k", None)], [Write("k", b"v", lease)])
        assert not await store.transaction([("k", None)], [Write("k", b"w")])  # present now
        clock.now += 1.5
        assert await store.refresh_lease(lease)
        clock.now += 1.5
        assert await store.get("k") == b"v"  # refreshed: still alive
        clock.now += 0.6
        assert await store.get("k") is None
        assert not await store.refresh_lease(lease)
        assert not await store.transaction([], [Write("x", b"1", lease)])  # unknown lease
        other = await store.grant_lease(2)
        await store.transaction([], [Write("y", b"1", other)])
        await store.revoke_lease(other)
        assert await store.get("y") is None

    asyncio.run(scenario())


def test_election_terms_increase_and_a_deposed_leader_cannot_write() -> None:
    clock = Clock()
    store = MemoryStore(clock)
    config = ElectionConfig(ttl_s=2, margin_s=0.3)

    async def scenario() -> None:
        a = LeaderElection(store, "j", "a:1", "a", config, clock)
        b = LeaderElection(store, "j", "b:1", "b", config, clock)
        assert await a.campaign() == 1
        fenced_a = LeaderStore(a)
        await fenced_a.put("/recover/j/x", b"1")
        assert (await b.leader()).controller_id == "a"  # type: ignore[union-attr]
        clock.now += 2.5  # a is stopped through its TTL
        assert not a.holds()
        assert await b.campaign() == 2
        with pytest.raises(LostLeadership):
            await fenced_a.put("/recover/j/x", b"2")  # local lease clock ran out
        a._valid_until = clock.now + 10  # even if its clock lied, the store compare refuses
        with pytest.raises(LostLeadership):
            await fenced_a.put("/recover/j/x", b"2")
        assert await store.get("/recover/j/x") == b"1"
        await LeaderStore(b).put("/recover/j/x", b"3")
        await b.resign()
        c = LeaderElection(store, "j", "c:1", "c", config, clock)
        assert await c.campaign() == 3  # revoked: no TTL to wait for
        for election in (a, b, c):
            await election.close()

    asyncio.run(scenario())


async def a_planted_leader_key_is_ignored(store: Store, job: str = "p") -> None:
    """A leader key written without a lease (planted by whoever can write the store) is no
    leader: not reported, not handed to agents, and overwritten by the next campaign. Also
    run on a real etcd (tests/integration/test_etcd_election.py)."""
    key = f"/recover/{job}/leader"
    planted = pb.LeaderRecord(term=99, address="203.0.113.9:1", controller_id="mallory")
    await store.put(key, planted.SerializeToString())
    assert await store.get_leased(key) == (planted.SerializeToString(), 0)
    a = LeaderElection(store, job, "a:1", "a", ElectionConfig(ttl_s=5))
    assert await a.leader() is None
    assert await asyncio.wait_for(a.campaign(), 5) == 1
    leader = await a.leader()
    assert leader is not None and leader.controller_id == "a"
    found = await store.get_leased(key)
    assert found is not None and found[1] == a.lease != 0
    # Written over again without a lease (even a copy of the real record): ignored again.
    await store.put(key, found[0])
    assert await a.leader() is None
    await a.close()


def test_a_planted_leader_key_without_a_lease_is_ignored() -> None:
    asyncio.run(a_planted_leader_key_is_ignored(MemoryStore()))


def test_a_standby_is_woken_by_its_watch_not_by_its_recheck_timer() -> None:
    store = MemoryStore()
    config = ElectionConfig(ttl_s=2, recheck_s=60.0)  # only the watch can wake it in time

    async def scenario() -> None:
        a = LeaderElection(store, "j", "a:1", "a", config)
        b = LeaderElection(store, "j", "b:1", "b", config)
        assert await a.campaign() == 1
        standby = asyncio.create_task(b.campaign())
        await asyncio.sleep(0.2)  # b has read the key, found a, and waits
        assert not standby.done()
        started = time.monotonic()
        await a.resign()
        assert await asyncio.wait_for(standby, 1.0) == 2
        assert time.monotonic() - started < 0.5
        # An expired lease (a leader that crashed) wakes a standby as well.
        c = LeaderElection(store, "j", "c:1", "c", config)
        standby = asyncio.create_task(c.campaign())
        await asyncio.sleep(0.2)
        assert not standby.done()
        assert await asyncio.wait_for(standby, 4.0) == 3  # b never refreshes: TTL 2 s
        for election in (a, b, c):
            await election.close()
        assert store._watchers["/recover/j/leader"] == []  # closed: no watch left behind

    asyncio.run(scenario())


@pytest.mark.parametrize(("now", "valid_until", "refreshed", "leading", "why"), [
    (1.0, 2.0, True, True, "refreshed"),
    (1.0, 2.0, None, True, "still valid"),
    (2.5, 2.0, None, False, "ran out"),
    (1.0, 2.0, False, False, "gone"),
    (2.5, 2.0, True, False, "ran out"),
])
def test_lease_verdict(now: float, valid_until: float, refreshed: bool | None, leading: bool,
                       why: str) -> None:
    verdict = lease_verdict(now, valid_until, refreshed)
    assert verdict.leading is leading
    assert why in verdict.reason


@pytest.mark.parametrize(("kind", "term", "gen", "highest", "agent_gen", "accept", "why"), [
    ("generation", 2, 5, 2, 4, True, "generation of term 2"),
    ("generation", 1, 9, 2, 4, False, "deposed leader"),
    ("generation", 2, 4, 2, 4, False, "not newer"),
    ("commit", 2, 4, 2, 4, True, "commit of term 2"),
    ("commit", 2, 3, 2, 4, False, "this agent is in generation 4"),
    ("commit", 1, 4, 2, 4, False, "older than term 2"),
    ("shutdown", 1, 0, 2, 4, False, "deposed leader"),
    ("shutdown", 3, 0, 2, 4, True, "shutdown of term 3"),
    ("heartbeat", 2, 0, 2, 4, True, "heartbeat"),
])
def test_agent_fencing(kind: str, term: int, gen: int, highest: int, agent_gen: int,
                       accept: bool, why: str) -> None:
    verdict = judge(kind, term, gen, highest, agent_gen)
    assert verdict.accept is accept
    assert why in verdict.reason


@pytest.mark.parametrize(("step", "applied", "accept"), [(5, 4, True), (5, 5, False), (5, -1, True)])
def test_resent_commit_goes_only_to_workers_that_need_it(step: int, applied: int,
                                                         accept: bool) -> None:
    assert wants_commit(step, applied).accept is accept


@pytest.mark.parametrize(("details", "hint"), [
    ("not the leader; leader: 10.0.0.2:50051 (term 3)", "10.0.0.2:50051"),
    ("no leader right now (an election is under way); try again", None),
])
def test_leader_hint(details: str, hint: str | None) -> None:
    assert leader_hint(details) == hint


def view(step: int, assignment: dict[int, list[int]], generation: int = 3) -> pb.GenerationView:
    return pb.GenerationView(generation=generation, members=sorted(assignment), plan=pb.Plan(
        step=step, generation=generation,
        assignments=[pb.Assignment(replica=r, microbatch_ids=ids) for r, ids in assignment.items()]))


def stored(step: int, assignment: dict[int, list[int]], generation: int = 3) -> pb.Plan:
    return view(step, assignment, generation).plan


@pytest.mark.parametrize(("v", "plan", "committed", "survivors", "expected", "why"), [
    pytest.param(view(7, {0: [0, 1, 5], 1: [2, 3, 4]}), None, 7, [0, 1],
                 {0: (0, 1, 5), 1: (2, 3, 4)}, "keep generation 3's plan", id="in-flight-plan-kept"),
    pytest.param(view(4, {0: [0, 1, 5], 1: [2, 3, 4]}), stored(7, {0: [0, 1, 2, 3], 1: [4, 5]}),
                 7, [0, 1], {0: (0, 1, 2, 3), 1: (4, 5)}, "stored with the last commit",
                 id="steps-since-stored-plan-kept"),
    pytest.param(view(4, {0: [0, 1, 5], 1: [2, 3, 4]}), stored(7, {0: [0, 1, 2, 3], 1: [4, 5]}),
                 7, [1], {1: (4, 5, 0, 1, 2, 3)}, "reassigned", id="stored-plan-lost-member"),
    pytest.param(view(4, {0: [0, 1, 5], 1: [2, 3, 4]}), stored(5, {0: [0], 1: [1, 2, 3, 4, 5]}),
                 7, [0, 1], {0: (0, 1, 2), 1: (3, 4, 5)}, "no plan of step 7 was handed out",
                 id="none-handed-out-planned-afresh"),
    pytest.param(view(7, {0: [0, 1], 1: [2, 3], 2: [4, 5]}), None, 7, [0, 2],
                 {0: (0, 1, 2), 2: (4, 5, 3)}, "reassigned", id="lost-member-reassigned"),
])
def test_resume_plan(v: pb.GenerationView, plan: pb.Plan | None, committed: int,
                     survivors: list[int], expected: dict[int, tuple[int, ...]], why: str) -> None:
    persisted = PersistedJob(view=v, plan=plan)
    decision = resume_plan(persisted, committed, survivors, 6, RecoverPolicy())
    assert decision.assignment == expected
    assert why in decision.reason
