"""The coordinator driven directly (tests/unit/coordinator_harness.py): registration,
start, plans and the commit protocol."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import pytest

from recover.controller.jobstate import (
    JobState,
    RegistrationRefused,
    RejoinUnexpected,
    sample_digest,
)
from recover.controller.leader import LostLeadership
from recover.controller.policy import PlanDecision, RecoverPolicy
from recover.proto import pb
from tests.unit.coordinator_harness import (
    JOB_ID,
    RENDEZVOUS,
    STEPS_PREFIX,
    Harness,
    make_job,
    plan_dict,
    run_now,
    scenario,
)

# ---------------------------------------------------------------- registration

@scenario
async def test_registration_assigns_replica_ids_in_order():
    h = Harness(make_job(replicas=4))
    assert await h.coord.register_agent("a", "host-a", 2) == [0, 1]
    assert await h.coord.register_agent("b", "host-b", 1) == [2]
    assert await h.coord.register_agent("c", "host-c", 1) == [3]
    registered = h.messages("registered")
    assert [(a, list(r.replica_ids)) for a, r in registered] == [("a", [0, 1]), ("b", [2]),
                                                                  ("c", [3])]
    assert all(r.job == h.job for _, r in registered)
    assert {r: h.coord.replicas[r].agent_id for r in range(4)} == {0: "a", 1: "a", 2: "b", 3: "c"}
    stored = await h.store.get(f"/recover/{JOB_ID}/job")
    assert stored is not None and pb.JobConfig.FromString(stored) == h.job
    assert h.coord.state is JobState.WAITING


@pytest.mark.parametrize(("first", "attempt", "message"), [
    pytest.param([("a", 1)], ("a", 1), "agent id 'a' is already registered",
                 id="duplicate-agent-id"),
    pytest.param([], ("a", 0), "an agent needs at least one slot, got 0", id="zero-slots"),
])
def test_registration_refused(first, attempt, message):
    async def body():
        h = Harness(make_job(replicas=3))
        for agent_id, slots in first:
            await h.coord.register_agent(agent_id, "h", slots)
        before = dict(h.coord.replicas)
        with pytest.raises(RegistrationRefused) as info:
            await h.coord.register_agent(attempt[0], "h", attempt[1])
        assert message in str(info.value)
        assert h.coord.replicas == before, "a refused registration must not take replica ids"
        assert len(h.messages("registered")) == len(first)
    asyncio.run(body())


@pytest.mark.parametrize("still_leads", [True, False])
def test_a_rejoin_this_leader_did_not_expect_is_refused_only_while_it_leads(monkeypatch,
                                                                          still_leads):
    # The leader that started the job lost agent a (no takeover waits for it): asked to take
    # it back, it refuses, which stops the agent's workers for good; but only once a fenced
    # transaction confirms it still leads. A leader that cannot (its store down, its lease
    # gone) says nothing: the agent looks for the next leader, whose takeover expects it.
    async def body():
        h = Harness(make_job(replicas=2))
        assert await h.coord.register_agent("a", "h", 2) == [0, 1]
        await h.coord.agent_lost("a", "no heartbeat for 3.1s")  # (alive: it would be taken back)

        async def fenced(compares, writes):
            assert (list(compares), list(writes)) == ([], [])
            return still_leads

        monkeypatch.setattr(h.store, "transaction", fenced)
        with pytest.raises(RejoinUnexpected if still_leads else LostLeadership):
            await h.coord.register_agent("a", "h", 2, [0, 1])
    asyncio.run(body())


@scenario
async def test_slots_beyond_the_job_wait_and_are_filled_when_room_opens():
    # A host with more slots than the job still needs, and a replacement staged ahead:
    # registered, not refused; their slots get replicas, in order, as room opens.
    h = Harness(make_job(replicas=3))
    assert await h.coord.register_agent("a", "h", 2) == [0, 1]
    assert await h.coord.register_agent("b", "h", 2) == [2]  # its slot 1 waits
    await h.start([])
    assert await h.coord.register_agent("staged", "h", 1) == []  # the job has its 3
    assert h.coord.agents["b"].waiting == (1,) and h.coord.agents["staged"].waiting == (0,)
    registered = dict(h.messages("registered"))
    assert list(registered["staged"].replica_ids) == []

    await h.coord.worker_exited(pb.WorkerExited(replica=0, exit_code=1))
    # The first waiting slot (b's, the earlier agent) gets the room at once, with a fresh id.
    assert [(a, m.slot, m.replica) for a, m in h.messages("replica_assigned")] == [("b", 1, 3)]
    assert h.coord.replicas[3].agent_id == "b" and h.coord.agents["b"].waiting == ()
    filled = h.events("slot-filled")
    assert filled[-1].message.startswith("agent b slot 1: new replica 3 (replica 0 lost")
    # a's own restart of the dead worker finds the job full: its slot waits in turn.
    await h.coord.replica_request("a", pb.ReplicaRequest(slot=0, reason="restart"))
    answer = h.messages("replica_assigned")[-1][1]
    assert answer.refused and answer.waiting and not answer.retryable
    assert h.coord.agents["a"].waiting == (0,)
    # A new leader would know the waiting slots: they are in the agents' records.
    stored = pb.AgentRecord.FromString(await h.store.get(f"/recover/{JOB_ID}/agents/a"))
    assert list(stored.waiting_slots) == [0]

    await h.coord.worker_exited(pb.WorkerExited(replica=2, exit_code=1))
    # Agents in the order they registered: a's slot before the staged host's.
    assert [(a, m.slot, m.replica) for a, m in h.messages("replica_assigned")][-1] == \
        ("a", 0, 4)
    assert h.coord.agents["staged"].waiting == (0,)  # still waiting: no more room


@scenario
async def test_more_spares_fill_waiting_slots():
    h = Harness(make_job(replicas=2))
    await h.coord.register_agent("a", "h", 3)
    await h.start([])
    assert h.coord.agents["a"].waiting == (2,)
    decision = await h.coord.set_spares(1, "alice")
    assert decision.accepted
    assert [(a, m.slot, m.replica) for a, m in h.messages("replica_assigned")] == [("a", 2, 2)]


# ---------------------------------------------------------------- start

@scenario
async def test_start_waits_for_every_replica_then_broadcasts_generation_1():
    h = Harness(make_job(replicas=3, m=8))
    await h.coord.register_agent("a", "h", 2)
    for replica in (0, 1):
        await h.coord.worker_ready(replica, pb.Ready(pid=1))
    # Two of three replicas exist and are ready: registration is incomplete.
    assert h.coord.state is JobState.WAITING and not h.messages("generation")
    await h.coord.register_agent("b", "h", 1)
    assert h.coord.state is JobState.WAITING and not h.messages("generation")
    await h.coord.worker_ready(2, pb.Ready(pid=3))
    assert h.coord.state is JobState.RUNNING
    # Each replica's process, as a field of its event (`recover events --json`).
    assert [(e.replica, e.pid) for e in h.events("replica-ready")] == [(0, 1), (1, 1), (2, 3)]
    views = h.messages("generation")
    assert [a for a, _ in views] == ["a", "b"], "one view per agent hosting members"
    for _, view in views:
        assert view.generation == 1
        assert list(view.members) == [0, 1, 2]
        assert view.rendezvous == RENDEZVOUS
        assert view.plan.step == 0 and view.plan.generation == 1
        assert plan_dict(view.plan) == {0: (0, 1, 2), 1: (3, 4, 5), 2: (6, 7)}
        assert "uniform: 8 microbatches over 3 replicas" in view.plan.reason
    stored = await h.store.get(f"/recover/{JOB_ID}/generation")
    assert stored is not None and pb.GenerationView.FromString(stored) == views[0][1]
    assert h.coord.started_at == h.clock.now


@scenario
async def test_ready_from_unknown_replica_is_stale_and_does_not_start():
    h = Harness(make_job(replicas=1))
    await h.coord.register_agent("a", "h", 1)
    await h.coord.worker_ready(5, pb.Ready(pid=1))
    assert h.coord.stale_reports == 1
    assert h.coord.state is JobState.WAITING


# ---------------------------------------------------------------- commit

@scenario
async def test_commit_needs_every_member():
    h = Harness(make_job(replicas=3, m=6))
    await h.start()
    await h.reduce([0, 1])
    await h.coord.reduced(0, h.reduced_msg(0))  # a repeated report still is one member
    assert not h.messages("commit"), "replica 2 has not reported; nothing may commit"
    assert await h.stored_steps() == [] and h.coord.step == 0
    await h.reduce([2])
    commits = h.messages("commit")
    assert [a for a, _ in commits] == ["a0", "a1", "a2"]
    commit = commits[0][1]
    assert (commit.step, commit.generation, commit.final) == (0, 1, False)
    assert commit.next_plan.step == 1 and commit.next_plan.generation == 1
    assert plan_dict(commit.next_plan) == {0: (0, 1), 1: (2, 3), 2: (4, 5)}
    assert h.coord.step == 1


@scenario
async def test_step_record_is_durable_before_commit_is_sent():
    h = Harness(make_job(replicas=2, m=4))
    await h.start()
    seen: list[list[tuple[str, bytes]]] = []

    def check_store(agent_id: str, message: pb.ControllerMessage) -> None:
        if message.WhichOneof("kind") == "commit":
            seen.append(run_now(h.store.get_prefix(STEPS_PREFIX)))

    h.on_send.append(check_store)
    h.clock.now = 1234.5
    await h.reduce()
    assert len(seen) == 2, "both agents got the commit"
    for snapshot in seen:
        assert [k for k, _ in snapshot] == [f"{STEPS_PREFIX}0000000000"]
        record = pb.StepRecord.FromString(snapshot[0][1])
        assert (record.step, record.generation, record.microbatches) == (0, 1, 4)
    record = pb.StepRecord.FromString(seen[0][0][1])
    samples = [1000 * mb + k for mb in range(4) for k in range(2)]
    assert record.sample_digest == sample_digest(reversed(samples))
    assert record.tokens == 4 * 16  # the sum of what the members' workloads reported
    assert record.loss == 2.5 and record.committed_at == 1234.5
    assert record.compute_s == pytest.approx(1.1)  # the slowest member
    assert h.coord.steps == [record]


def test_sample_digest_is_order_free_and_content_sensitive():
    assert sample_digest([3, 1, 2]) == sample_digest([1, 2, 3])
    assert sample_digest([1, 2, 3]) != sample_digest([1, 2, 4])
    assert sample_digest([1, 2]) != sample_digest([1, 2, 2])
    assert len(sample_digest([])) == 64


STALE_CASES = [
    pytest.param("older-generation", id="older-generation"),
    pytest.param("future-generation", id="future-generation"),
    pytest.param("wrong-step", id="wrong-step"),
    pytest.param("non-member", id="non-member"),
]


@pytest.mark.parametrize("case", STALE_CASES)
def test_stale_reduced_reports_are_counted_and_never_commit(case):
    async def body():
        h = Harness(make_job(replicas=3, m=6))
        await h.start()
        old_plan = dict(h.coord.plan)
        # Replica 2 dies: generation 2 with members [0, 1].
        await h.coord.worker_exited(pb.WorkerExited(replica=2, exit_code=1))
        assert h.coord.generation == 2 and h.coord.members == [0, 1]
        generation_sends = len(h.sent)
        if case == "older-generation":
            stale = [(r, h.reduced_msg(r, ids=old_plan[r], generation=1)) for r in (0, 1)]
        elif case == "future-generation":
            stale = [(r, h.reduced_msg(r, generation=3)) for r in (0, 1)]
        elif case == "wrong-step":
            stale = [(r, h.reduced_msg(r, step=1)) for r in (0, 1)]
        else:  # the lost replica and a replica that never existed
            stale = [(2, h.reduced_msg(0, generation=2)), (7, h.reduced_msg(1, generation=2))]
        for replica, msg in stale:
            await h.coord.reduced(replica, msg)
        assert h.coord.stale_reports == len(stale)
        assert len(h.sent) == generation_sends and not h.messages("commit")
        assert await h.stored_steps() == []
        if case == "non-member":
            await h.reduce([0])  # replica 2's stale report must not stand in for replica 1
            assert not h.messages("commit")
            await h.reduce([1])
        else:
            await h.reduce()
        commits = h.messages("commit")
        assert commits and commits[0][1].generation == 2
        assert h.coord.stale_reports == len(stale)
    asyncio.run(body())


@scenario
async def test_reduced_before_start_is_stale():
    h = Harness(make_job(replicas=1, m=2))
    await h.coord.register_agent("a", "h", 1)
    await h.coord.reduced(0, pb.Reduced(generation=0, step=0, microbatch_ids=[0, 1]))
    assert h.coord.stale_reports == 1 and not h.messages("commit")


@pytest.mark.parametrize(("reports", "why"), [
    pytest.param({0: (0, 1), 1: (2,)}, "not its plan's [2, 3]", id="missing"),
    pytest.param({0: (0, 1), 1: (1, 2, 3)}, "reported microbatches [1, 2, 3]", id="duplicated"),
])
def test_a_report_that_is_not_the_plan_costs_its_member_not_the_job(reports, why):
    """Issue 22: one member's bad report drops that member like a crash (its share is
    recomputed by the others); it no longer fails the job (tests/unit/test_reports.py)."""
    async def body():
        h = Harness(make_job(replicas=2, m=4))
        await h.start()
        for replica, ids in reports.items():
            await h.coord.reduced(replica, h.reduced_msg(replica, ids=ids))
        assert h.coord.state is JobState.RUNNING and h.coord.members == [0]
        [(_, stop)] = h.messages("stop_replica")
        assert stop.replica == 1 and why in stop.reason
        assert not h.messages("commit") and await h.stored_steps() == []
        await h.reduce()
        [(_, commit)] = h.messages("commit")
        assert commit.step == 0 and commit.microbatches == 4
    asyncio.run(body())


class BrokenPolicy(RecoverPolicy):
    def plan(self, members: Sequence[int], global_microbatches: int) -> PlanDecision:
        return PlanDecision({0: (0, 1), 1: (2,)}, "a bug: microbatch 3 is nobody's")


def test_a_plan_that_does_not_cover_all_microbatches_is_never_committed():
    """The backstop behind the members' checks: should the plan itself ever miss a
    microbatch (a bug), the step is refused and the job fails rather than drift."""
    async def body():
        h = Harness(make_job(replicas=2, m=4))
        h.coord.policy = BrokenPolicy()
        await h.start()
        for replica in (0, 1):
            await h.coord.reduced(replica, h.reduced_msg(replica))
        assert h.coord.state is JobState.FAILED
        assert "refusing to commit step 0" in h.coord.reason and "missing [3]" in h.coord.reason
        assert not h.messages("commit") and await h.stored_steps() == []
        shutdowns = h.messages("shutdown")
        assert sorted(a for a, _ in shutdowns) == ["a0", "a1"]
        assert all(not s.success and s.reason == h.coord.reason for _, s in shutdowns)
        assert h.coord.done.is_set()
        assert h.events("failed")
    asyncio.run(body())


@scenario
async def test_whoever_sees_the_job_end_sees_its_event() -> None:
    """`recover run` stops reading events once the job's state is terminal: the end's event
    must be in the log from the moment that state is, not once the store writes before it
    are done (on etcd they take milliseconds, and a failover test's launcher missed it)."""
    h = Harness(make_job(replicas=2, steps=1, m=4))
    await h.start()
    await h.reduce()
    seen: list[bool] = []
    for name in ("put", "put_many", "transaction"):
        original = getattr(h.store, name)

        async def watched(*args, _original=original, **kwargs):  # type: ignore[no-untyped-def]
            if h.coord.state is JobState.SUCCEEDED:  # a reader could ask now, while it waits
                seen.append(bool(h.events("succeeded")))
            return await _original(*args, **kwargs)

        setattr(h.store, name, watched)
    await h.apply(0)
    assert h.coord.state is JobState.SUCCEEDED
    assert seen and all(seen), seen
