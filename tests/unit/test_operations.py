"""Operator requests (controller/operations.py): the decision and its reason, table-style,
and a stop and a drain carried out at the step boundary."""

from __future__ import annotations

import pytest

from recover.controller.jobstate import JobState
from recover.controller.operations import drain_decision, spares_decision, stop_decision
from recover.proto import pb
from tests.unit.coordinator_harness import Harness, make_job, scenario, with_a_spare

RUNNING, WAITING = JobState.RUNNING, JobState.WAITING


@pytest.mark.parametrize("state, stopping, accepted, reason", [
    (RUNNING, "", True, "once the step in flight commits"),
    (WAITING, "", True, "had not started: it stops now"),
    (RUNNING, "stopped by bob", False, "under way already (stopped by bob)"),
    (JobState.SUCCEEDED, "", False, "the job is succeeded already"),
    (JobState.STOPPED, "", False, "is stopped already"),
])
def test_stop_decision(state, stopping, accepted, reason):
    decision = stop_decision(state, stopping)
    assert decision.accepted is accepted and reason in decision.reason


ALIVE = {"a0": True, "a1": True, "gone": False}


@pytest.mark.parametrize("agent, state, hosted, draining, accepted, reason", [
    ("a1", RUNNING, [1], set(), True, "'a1' leaves at the next step boundary with replicas [1]; "
                                      "1 members go on"),
    ("a1", WAITING, [1], set(), False, "only a running job drains"),
    ("nope", RUNNING, [], set(), False, "no agent 'nope' in this job (agents: a0, a1, gone)"),
    ("gone", RUNNING, [], set(), False, "gone already"),
    ("a1", RUNNING, [1], {"a1"}, False, "being drained already"),
    ("a0", RUNNING, [0, 1], set(), False, "would leave no member: stop the job instead"),
    ("a0", RUNNING, [], set(), True, "with replicas []"),  # hosts only spares
])
def test_drain_decision(agent, state, hosted, draining, accepted, reason):
    decision = drain_decision(agent, state=state, alive=ALIVE, hosted_members=hosted,
                              members=[0, 1], draining=draining)
    assert decision.accepted is accepted and reason in decision.reason


@pytest.mark.parametrize("spares, current, spare_replicas, accepted, stop, reason", [
    (2, 1, [5], True, [], "spares 1 -> 2: room for 1 more"),
    (0, 2, [5, 7], True, [5, 7], "stopping spare replicas [5, 7]"),
    (1, 2, [7, 5], True, [7], "spares 2 -> 1; stopping spare replicas [7]"),
    (1, 2, [], True, [], "spares 2 -> 1"),  # the spare slots were empty anyway
    (1, 1, [5], True, [], "keeps 1 spares already"),
    (-1, 1, [], False, [], "between 0 and 1024, got -1"),
])
def test_spares_decision(spares, current, spare_replicas, accepted, stop, reason):
    decision, to_stop = spares_decision(spares, current, spare_replicas)
    assert (decision.accepted, to_stop) == (accepted, stop) and reason in decision.reason


async def commit(h: Harness) -> None:
    step = h.coord.step
    await h.reduce()
    await h.apply(step)


@scenario
async def test_a_stop_takes_effect_after_the_step_in_flight_commits():
    h = Harness(make_job(replicas=2, steps=10, m=4))
    await h.start()
    decision = await h.coord.request_stop("alice", "maintenance")
    assert decision.accepted and h.coord.state is RUNNING  # step 0 is in flight
    await h.reduce()
    commit_msg = h.messages("commit")[-1][1]
    assert commit_msg.step == 0 and commit_msg.checkpoint_now and not commit_msg.HasField("next_plan")
    # It waits for every member's acknowledgement, so the summary has the step's digests.
    await h.apply(0, replicas=[0])
    assert h.coord.state is RUNNING and not h.messages("shutdown")
    await h.apply(0, replicas=[1])
    assert h.coord.state is JobState.STOPPED and h.coord.reason == "stopped by alice: maintenance"
    assert {d.replica for d in h.coord.steps[0].param_sha256} == {0, 1}
    shutdown = h.messages("shutdown")[-1][1]
    assert shutdown.state == "stopped" and not shutdown.success
    stored = pb.Shutdown.FromString(await h.store.get("/recover/job-unit/result"))
    assert stored.state == "stopped" and not h.coord.failures


@scenario
async def test_a_stop_still_ends_when_a_member_dies_before_acknowledging():
    h = Harness(make_job(replicas=2, steps=10, m=4))
    await h.start()
    await h.coord.request_stop("alice", "")
    await h.reduce()
    await h.apply(0, replicas=[0])
    await h.coord.worker_exited(pb.WorkerExited(replica=1, signal=9))
    assert h.coord.state is JobState.STOPPED and h.coord.step == 1


@scenario
async def test_a_drained_agent_leaves_at_the_boundary_without_a_failure():
    h = Harness(make_job(replicas=3, steps=10, m=6))
    await h.start()
    decision = await h.coord.request_drain("a1", "alice", "new kernel")
    assert decision.accepted
    await commit(h)
    view = h.messages("generation")[-1][1]
    assert list(view.members) == [0, 2] and view.plan.step == 1
    assert ("a1", pb.Shutdown(reason="drained by an operator", success=True, state="drained")) \
        in h.messages("shutdown")
    await h.coord.worker_exited(pb.WorkerExited(replica=1, signal=15))  # its worker stops
    await h.coord.agent_lost("a1", "session closed")
    assert not h.coord.failures and h.coord.recoveries == 0 and h.coord.state is RUNNING


@scenario
async def test_fewer_spares_stop_the_newest_spare_without_a_failure():
    h, _ = await with_a_spare()
    assert h.coord.joins.spares == [2]
    decision = await h.coord.set_spares(0, "alice")
    assert decision.accepted and h.coord.job.spares == 0
    assert h.messages("stop_replica")[-1] == ("spare", pb.StopReplica(
        replica=2, reason="spares reduced to 0 by alice"))
    await h.coord.worker_exited(pb.WorkerExited(replica=2, signal=9))
    assert not h.coord.failures
    stored = pb.JobConfig.FromString(await h.store.get("/recover/job-unit/job"))
    assert stored.spares == 0  # a new leader keeps the operator's choice
