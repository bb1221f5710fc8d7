"""The coordinator driven directly (tests/unit/coordinator_harness.py): failures and
recovery, the end of a job, liveness, recovery timing."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from recover.controller.coordinator import JobState
from recover.proto import pb
from tests.unit.coordinator_harness import (
    JOB_ID,
    Harness,
    make_job,
    plan_dict,
    scenario,
)

# ---------------------------------------------------------------- failures

@scenario
async def test_worker_exit_mid_step_makes_generation_2_keeping_survivors_ids():
    h = Harness(make_job(replicas=3, m=6))
    await h.start()
    assert h.coord.plan == {0: (0, 1), 1: (2, 3), 2: (4, 5)}
    await h.reduce([0])  # progress of generation 1 must not count in generation 2
    h.clock.now = 1010.0
    await h.coord.worker_exited(pb.WorkerExited(
        replica=1, signal=9, observed_at=1009.9,
        fault=pb.FaultNote(step=0, phase="backward", killed_at=1009.5)))
    views = h.messages("generation")[3:]  # after the three views of generation 1
    assert [a for a, _ in views] == ["a0", "a2"], "no view for an agent without members"
    view = views[0][1]
    assert view.generation == 2 and list(view.members) == [0, 2]
    assert view.plan.step == 0 and view.plan.generation == 2
    assert plan_dict(view.plan) == {0: (0, 1, 2), 2: (4, 5, 3)}
    assert "replicas [1] lost" in view.plan.reason
    assert h.coord.recoveries == 1
    [failure] = h.coord.failures
    assert (failure.step, failure.replica, failure.cause, failure.phase) == (0, 1, "injected",
                                                                             "backward")
    assert failure.killed_at == 1009.5 and failure.detected_at == 1010.0
    assert failure.generation == 1 and failure.recovered_at == 0
    assert h.events("replica-failed")[0].replica == 1
    # Only the survivors' reports in generation 2 commit the step.
    await h.reduce([0])
    assert not h.messages("commit")
    await h.reduce([2])
    [(_, commit), _] = h.messages("commit")
    assert (commit.step, commit.generation) == (0, 2)
    assert plan_dict(commit.next_plan) == {0: (0, 1, 2), 2: (3, 4, 5)}


@pytest.mark.parametrize(("resumed", "reduced", "phase"), [
    pytest.param(False, False, "rebuild", id="before-resumed"),
    pytest.param(True, False, "compute", id="computing"),
    pytest.param(True, True, "commit", id="after-reducing"),
])
def test_external_exit_records_observed_phase(resumed, reduced, phase):
    async def body():
        h = Harness(make_job(replicas=2, m=4))
        await h.start()
        if resumed:
            await h.coord.resumed(1, pb.Resumed(generation=1, step=0, at=1000.0))
        if reduced:
            await h.reduce([1])
        await h.coord.worker_exited(pb.WorkerExited(replica=1, exit_code=3))
        [failure] = h.coord.failures
        assert (failure.cause, failure.phase, failure.step) == ("external", phase, 0)
        assert h.coord.generation == 2 and h.coord.members == [0]
    asyncio.run(body())


@scenario
async def test_two_replicas_of_one_agent_lost_at_once():
    h = Harness(make_job(replicas=4, m=8))
    await h.start([("a", 2), ("b", 2)])
    await h.coord.agent_lost("b", "session closed")
    assert h.coord.generation == 2 and h.coord.members == [0, 1]
    assert h.coord.plan == {0: (0, 1, 4, 6), 1: (2, 3, 5, 7)}
    assert [(f.replica, f.cause) for f in h.coord.failures] == [(2, "agent-lost"),
                                                                (3, "agent-lost")]
    assert h.coord.recoveries == 1
    await h.coord.agent_lost("b", "again")  # idempotent
    assert h.coord.generation == 2 and len(h.coord.failures) == 2


@scenario
async def test_losing_every_replica_fails_the_job():
    h = Harness(make_job(replicas=2, m=4))
    await h.start()
    await h.coord.worker_exited(pb.WorkerExited(replica=0, exit_code=1))
    assert h.coord.state is JobState.RUNNING and h.coord.generation == 2
    await h.coord.worker_exited(pb.WorkerExited(replica=1, signal=9))
    assert h.coord.state is JobState.FAILED
    assert "all replicas lost" in h.coord.reason and "signal 9" in h.coord.reason
    assert h.coord.generation == 2, "no generation without members"
    assert [s.success for _, s in h.messages("shutdown")] == [False, False]
    assert h.coord.done.is_set()
    # Events are flushed to the store when the job ends.
    stored = await h.store.get_prefix(f"/recover/{JOB_ID}/events/")
    assert [pb.Event.FromString(v).kind for _, v in stored][-1] == "failed"
    assert len(stored) == len(h.coord.events)


@scenario
async def test_worker_exit_before_start_fails_the_job():
    h = Harness(make_job(replicas=2))
    await h.coord.register_agent("a", "h", 2)
    await h.coord.worker_ready(0, pb.Ready(pid=1))
    await h.coord.worker_exited(pb.WorkerExited(replica=1, exit_code=2))
    assert h.coord.state is JobState.FAILED
    assert h.coord.reason == "replica 1 exited (exit code 2) before training started"
    assert [f.phase for f in h.coord.failures] == ["startup"]
    assert not h.messages("generation")
    assert [(a, s.success) for a, s in h.messages("shutdown")] == [("a", False)]
    await h.coord.worker_ready(0, pb.Ready(pid=1))
    assert h.coord.state is JobState.FAILED and h.coord.stale_reports == 1


@scenario
async def test_agent_lost_before_start_leaves_the_job_waiting_for_a_replacement():
    h = Harness(make_job(replicas=2))
    await h.coord.register_agent("a", "h", 1)
    await h.coord.register_agent("b", "h", 1)
    await h.coord.agent_lost("b", "session closed")
    assert h.coord.state is JobState.WAITING  # a replacement host may come
    shutdowns = h.messages("shutdown")  # fencing: the lost one stands down, should it wake up
    assert [a for a, _ in shutdowns] == ["b"] and "declared lost" in shutdowns[0][1].reason
    assert await h.coord.register_agent("c", "h", 1) == [2]  # a fresh replica id
    await h.coord.worker_ready(0, pb.Ready(pid=1))
    await h.coord.worker_ready(2, pb.Ready(pid=2))
    assert h.coord.state is JobState.RUNNING and h.coord.members == [0, 2]


# ---------------------------------------------------------------- the end

@scenario
async def test_final_step_succeeds_only_after_every_member_applied():
    h = Harness(make_job(replicas=2, steps=2, m=4))
    await h.start()
    await h.reduce()
    await h.apply(0)
    await h.reduce()
    [_, (_, final)] = [c for c in h.messages("commit") if c[0] == "a0"]
    assert final.step == 1 and final.final and not final.HasField("next_plan")
    assert h.coord.state is JobState.RUNNING
    await h.apply(1, replicas=[0])
    assert h.coord.state is JobState.RUNNING and not h.messages("shutdown")
    h.clock.now = 1100.0
    await h.apply(1, replicas=[1])
    assert h.coord.state is JobState.SUCCEEDED
    assert h.coord.reason == "2 steps committed" and h.coord.finished_at == 1100.0
    shutdowns = h.messages("shutdown")
    assert sorted(a for a, _ in shutdowns) == ["a0", "a1"]
    assert all(s.success for _, s in shutdowns)
    assert h.coord.done.is_set()
    assert [r.step for r in await h.stored_steps()] == [0, 1]
    assert not h.events("divergence")


@scenario
async def test_member_lost_while_final_step_is_acknowledged():
    h = Harness(make_job(replicas=3, steps=1, m=3))
    await h.start()
    await h.reduce()
    await h.apply(0, replicas=[0, 1])
    assert h.coord.state is JobState.RUNNING
    await h.coord.worker_exited(pb.WorkerExited(replica=2, exit_code=1))
    assert h.coord.state is JobState.SUCCEEDED
    assert h.coord.generation == 1, "no new generation after the final commit"


@scenario
async def test_divergent_applied_digests_emit_divergence():
    h = Harness(make_job(replicas=2, steps=2, m=4))
    await h.start()
    await h.reduce()
    await h.apply(0, digest="aa" * 32, replicas=[0])
    assert not h.events("divergence")
    await h.apply(0, digest="bb" * 32, replicas=[1])
    [event] = h.events("divergence")
    assert event.step == 0 and "disagree" in event.message
    assert {(d.replica, d.param_sha256) for d in h.coord.steps[0].param_sha256} == {
        (0, "aa" * 32), (1, "bb" * 32)}


@scenario
async def test_applied_for_uncommitted_step_is_stale():
    h = Harness(make_job(replicas=1, steps=1, m=1))
    await h.start()
    await h.coord.applied(0, pb.Applied(step=0, param_sha256="x"))
    assert h.coord.stale_reports == 1 and h.coord.state is JobState.RUNNING


# ---------------------------------------------------------------- liveness

@scenario
async def test_check_liveness_declares_a_silent_agent_lost():
    h = Harness(make_job(replicas=2, m=4), agent_timeout_s=3.0)
    await h.start()  # both agents registered at t=1000
    h.clock.now = 1002.5
    h.coord.heartbeat("a0")
    h.coord.heartbeat("nobody")  # unknown agents are ignored
    h.clock.now = 1003.0
    await h.coord.check_liveness()
    assert h.coord.generation == 1, "3.0s of silence is not more than the timeout"
    h.clock.now = 1004.0
    await h.coord.check_liveness()
    assert not h.coord.agents["a1"].alive and h.coord.agents["a0"].alive
    assert h.coord.generation == 2 and h.coord.members == [0]
    [lost] = h.events("agent-lost")
    assert "agent a1: no heartbeat for 4.0s" in lost.message
    assert [(f.replica, f.cause, f.detected_at) for f in h.coord.failures] == [
        (1, "agent-lost", 1004.0)]
    assert h.coord.state is JobState.RUNNING


@scenario
async def test_check_liveness_fails_a_job_that_never_starts():
    h = Harness(make_job(replicas=2), agent_timeout_s=1e9)
    await h.coord.register_agent("a", "h", 1)
    await h.coord.worker_ready(0, pb.Ready(pid=1))
    h.clock.now += h.coord.start_timeout_s
    await h.coord.check_liveness()
    assert h.coord.state is JobState.WAITING
    h.clock.now += 1
    await h.coord.check_liveness()
    assert h.coord.state is JobState.FAILED
    assert "only 1 of 2 replicas were ready after 120s" in h.coord.reason


# ---------------------------------------------------------------- recovery time

@scenario
async def test_resumed_from_every_member_sets_recovered_at():
    h = Harness(make_job(replicas=3, m=6))
    await h.start()
    h.clock.now = 1010.0
    await h.coord.worker_exited(pb.WorkerExited(replica=1, signal=9))
    [failure] = h.coord.failures
    await h.coord.resumed(0, pb.Resumed(generation=1, step=0, at=1011.0))  # old generation
    await h.coord.resumed(1, pb.Resumed(generation=2, step=0, at=1011.0))  # not a member
    assert h.coord.stale_reports == 2
    await h.coord.resumed(0, pb.Resumed(generation=2, step=0, at=1011.25))
    assert failure.recovered_at == 0 and not h.events("recovered")
    await h.coord.resumed(2, pb.Resumed(generation=2, step=0, at=1011.5))
    assert failure.recovered_at == 1011.5
    [event] = h.events("recovered")
    assert "1.500s after detection" in event.message and event.generation == 2
    # A later resume in the same generation does not move the recorded time.
    await h.coord.resumed(0, pb.Resumed(generation=2, step=0, at=1020.0))
    assert failure.recovered_at == 1011.5 and len(h.events("recovered")) == 1


@scenario
async def test_overflow_redoes_the_step_then_fails_instead_of_looping():
    """A gradient that never fits (NaN/inf) must end the job, not redo it forever."""
    h = Harness(make_job(replicas=2, m=4))
    await h.start()
    for epoch in range(1, 4):
        for replica in h.coord.members:
            await h.coord.reduced(replica, pb.Reduced(
                **{**_fields(h.reduced_msg(replica)), "overflow": 1}))
        assert h.coord.state is JobState.RUNNING
        assert (h.coord.scale_epoch, h.coord.step) == (epoch, 0)
        generation = h.messages("generation")[-1][1]
        assert generation.plan.scale_epoch == epoch, "the redo must carry the lower scale"
    assert not h.messages("commit")
    for replica in h.coord.members:
        await h.coord.reduced(replica, pb.Reduced(
            **{**_fields(h.reduced_msg(replica)), "overflow": 1}))
    assert h.coord.state is JobState.FAILED
    assert "still overflow after 3 rescalings" in h.coord.reason
    assert "non-finite" in h.coord.reason
    assert not h.messages("commit") and await h.stored_steps() == []


def _fields(message: pb.Reduced) -> dict[str, Any]:
    return {f.name: v for f, v in message.ListFields()}


@scenario
async def test_step_records_carry_their_failures_so_a_resumed_job_keeps_them():
    """A checkpoint carries the ledger: each step's record holds the failures recorded since
    the previous one, and a job resumed from it reports them in its summary."""
    h = Harness(make_job(replicas=3, m=6, steps=5))
    await h.start()
    await h.coord.worker_exited(pb.WorkerExited(
        replica=1, signal=9, fault=pb.FaultNote(step=0, phase="backward", killed_at=1.0)))
    await h.reduce()
    await h.apply(0)
    await h.reduce()  # step 1: no failure
    await h.apply(1)
    first, second = h.coord.steps
    assert [(f.step, f.replica, f.phase) for f in first.failures] == [(0, 1, "backward")]
    assert list(second.failures) == []  # each failure in one record only
    stored = await h.stored_steps()
    assert [len(r.failures) for r in stored] == [1, 0]  # durable with the commit

    resumed = Harness(make_job(replicas=3, m=6, steps=5))
    resumed.coord.resume_from(pb.CheckpointMeta(step=2, ledger=[first, second]))
    assert [(f.step, f.replica) for f in resumed.coord.failures] == [(0, 1)]
    assert resumed.coord.recoveries == 1
