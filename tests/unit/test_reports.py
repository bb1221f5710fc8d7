"""A bad member costs that member, not the job (controller/reports.py; issue 22, point 3):
the pure checks table-style, then the coordinator acting on them."""

from __future__ import annotations

import math

import pytest

from recover.controller.coordinator import JobState
from recover.controller.reports import agree_on_loss, unplanned_ids
from recover.proto import pb
from tests.unit.coordinator_harness import Harness, make_job, plan_dict, scenario


@pytest.mark.parametrize(("planned", "reported", "why"), [
    ((0, 1, 2), (0, 1, 2), None),
    ((0, 1, 2), (2, 0, 1), None),  # a survivor sums what it had first, then what it took over
    ((0, 1, 2), (0, 1), "reported microbatches [0, 1] for step 4, not its plan's [0, 1, 2]"),
    ((0, 1), (0, 1, 7), "reported microbatches [0, 1, 7] for step 4, not its plan's [0, 1]"),
    ((0, 1), (0, 0), "reported microbatches [0, 0] for step 4"),
    ((), (3,), "not its plan's []"),
])
def test_unplanned_ids(planned, reported, why):
    got = unplanned_ids(2, 4, planned, reported)
    assert got is None if why is None else why in got


NAN = float("nan")


@pytest.mark.parametrize(("losses", "loss", "outliers", "why"), [
    ({0: 2.5, 1: 2.5, 2: 2.5}, 2.5, (), ""),
    ({0: 2.5, 1: 999.0, 2: 2.5}, 2.5, (1,), "2 of 3 agree on 2.5; replicas [1] are dropped"),
    ({0: 1.0, 1: 2.5, 2: 2.5, 3: 3.0}, 1.0, (), "no majority agrees; the ledger keeps replica 0's"),
    ({0: 2.5, 1: 999.0}, 2.5, (), "no majority agrees"),
    ({0: NAN, 1: NAN}, NAN, (), ""),  # the same bits agree, NaN or not
    ({3: 2.5}, 2.5, (), ""),
])
def test_agree_on_loss(losses, loss, outliers, why):
    verdict = agree_on_loss(losses)
    assert verdict.loss == loss or (math.isnan(loss) and math.isnan(verdict.loss))
    assert verdict.outliers == outliers
    assert why in verdict.reason and bool(verdict.reason) == bool(why)


def exact_job(**kw) -> pb.JobConfig:
    job = make_job(**kw)
    job.reduce = "exact"
    return job


async def ready(h: Harness, replica: int, digest: str) -> None:
    await h.coord.worker_ready(replica, pb.Ready(
        pid=100 + replica, transfer_address=f"10.0.0.{replica}:7000",
        workload=pb.WorkloadInfo(parameters=9, determinism_sha256=digest)))


@scenario
async def test_a_newcomer_with_another_determinism_digest_is_refused_not_the_job():
    h = Harness(exact_job(replicas=2, steps=10, m=4))
    h.job.spares = 1
    for agent in ("a0", "a1"):
        await h.coord.register_agent(agent, "host-" + agent, 1)
    for replica in (0, 1):
        await ready(h, replica, "d" * 64)
    assert h.coord.state is JobState.RUNNING
    await h.coord.register_agent("late", "host-late", 1)
    await ready(h, 2, "e" * 64)  # another torch build, or a forged report
    assert h.coord.state is JobState.RUNNING
    [(agent, stop)] = h.messages("stop_replica")
    assert agent == "late" and stop.replica == 2 and "refused" in stop.reason
    assert not h.coord.replicas[2].alive and 2 not in h.coord.joins.joins
    assert not h.messages("join") and not h.messages("donate")  # it never gets any state
    [refused] = h.events("replica-refused")
    assert refused.replica == 2 and "determinism check" in refused.message
    # Its exit after the stop is no failure of the job.
    await h.coord.worker_exited(pb.WorkerExited(replica=2, signal=9,
                                                killed_by_agent="stopped by the controller"))
    assert h.coord.failures == [] and h.coord.state is JobState.RUNNING


@scenario
async def test_a_digest_mismatch_at_the_start_still_fails_the_job():
    """Before training nobody is a member yet, so nobody can tell which side is right."""
    h = Harness(exact_job(replicas=2, steps=10, m=4))
    for agent in ("a0", "a1"):
        await h.coord.register_agent(agent, "host-" + agent, 1)
    await ready(h, 0, "d" * 64)
    await ready(h, 1, "e" * 64)
    assert h.coord.state is JobState.FAILED and "determinism check" in h.coord.reason


@scenario
async def test_a_report_with_other_microbatches_drops_that_member():
    h = Harness(make_job(replicas=3, steps=10, m=6))
    await h.start()
    await h.reduce([0])
    await h.coord.reduced(1, h.reduced_msg(1, ids=(2, 3, 4)))  # 4 is replica 2's
    assert h.coord.state is JobState.RUNNING
    assert h.coord.members == [0, 2] and not h.coord.replicas[1].alive
    [failure] = h.coord.failures
    assert (failure.replica, failure.cause) == (1, "refused")
    [(_, stop)] = h.messages("stop_replica")
    assert stop.replica == 1 and "not its plan's [2, 3]" in stop.reason
    view = h.messages("generation")[-1][1]
    assert view.generation == 2 and plan_dict(view.plan) == {0: (0, 1, 2), 2: (4, 5, 3)}
    await h.reduce()
    assert h.coord.step == 1 and len(h.coord.steps) == 1  # the job goes on without it


@scenario
async def test_a_member_whose_loss_the_others_contradict_is_dropped():
    h = Harness(make_job(replicas=3, steps=10, m=6))
    await h.start()
    for replica in (0, 1, 2):
        await h.coord.reduced(replica, h.reduced_msg(replica, loss=999.0 if replica == 1 else 2.5))
    assert not h.messages("commit")  # the step is reduced again without it
    assert h.coord.members == [0, 2] and h.coord.failures[0].cause == "refused"
    assert "replicas [1] are dropped" in h.events("loss-mismatch")[0].message
    await h.reduce()
    [record] = h.coord.steps
    assert record.loss == 2.5 and record.generation == 2
