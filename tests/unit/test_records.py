"""The job's records (controller/records.py): one layout, written and read back whole."""

from __future__ import annotations

import asyncio

import pytest

from recover.controller.records import JobKeys, PersistedJob, Records, WriteLatency
from recover.controller.store import MemoryStore
from recover.proto import pb


def plan(step: int, generation: int = 1) -> pb.Plan:
    return pb.Plan(step=step, generation=generation,
                   assignments=[pb.Assignment(replica=0, microbatch_ids=[0, 1])])


def test_the_layout_is_one_folder_per_job() -> None:
    keys = JobKeys("j")
    assert keys.step(7) == "/recover/j/steps/0000000007"
    assert keys.agent("a1") == "/recover/j/agents/a1"
    assert keys.event(3) == "/recover/j/events/000000000003"
    assert keys.failure(2) == "/recover/j/failures/000002"
    assert {keys.job, keys.generation, keys.plan, keys.result, keys.leader, keys.term,
            keys.workload} == {f"/recover/j/{k}" for k in
                               ("job", "generation", "plan", "result", "leader", "term",
                                "workload")}


def test_what_is_written_is_loaded() -> None:
    async def run() -> PersistedJob:
        records = Records(MemoryStore(), "j")
        job = pb.JobConfig(job_id="j", replicas=2)
        await records.save_agent(job, pb.AgentRecord(agent_id="a1", replica_ids=[0]))
        await records.save_workload(pb.WorkloadInfo(parameters=9))
        event = pb.Event(seq=1, kind="started")
        failure = pb.FailureRecord(replica=1, cause="crash")
        await records.save_view(pb.GenerationView(generation=1, members=[0, 1], plan=plan(0)),
                                [records.event_write(event), records.failure_write(1, failure)])
        first = pb.StepRecord(step=0, loss=1.0)
        await records.commit_step(first, None, plan(1))
        first.param_sha256.append(pb.ReplicaDigest(replica=0, param_sha256="ab"))
        await records.commit_step(pb.StepRecord(step=1), first, None)  # no plan: kept
        await records.save_result(pb.Shutdown(reason="done", success=True))
        return await records.load()

    persisted = asyncio.run(run())
    assert persisted.job.replicas == 2 and [a.agent_id for a in persisted.agents] == ["a1"]
    assert persisted.workload.parameters == 9 and persisted.view.members == [0, 1]
    assert [e.kind for e in persisted.events] == ["started"]
    assert [f.cause for f in persisted.failures] == ["crash"]
    assert [s.step for s in persisted.steps] == [0, 1]
    assert persisted.steps[0].param_sha256[0].param_sha256 == "ab"  # rode along
    assert persisted.plan.step == 1 and persisted.result.success


@pytest.mark.parametrize(("view_step", "stored_step", "step", "found", "why"), [
    (4, 4, 4, "view", "generation 1's plan of step 4"),
    (3, 4, 4, "stored", "stored with the last commit"),
    (3, None, 4, None, "no plan of step 4 was handed out"),
    (3, 3, 4, None, "no plan of step 4 was handed out"),
])
def test_the_plan_the_workers_hold(view_step: int, stored_step: int | None, step: int,
                                   found: str | None, why: str) -> None:
    view = pb.GenerationView(generation=1, plan=plan(view_step))
    stored = plan(stored_step, generation=2) if stored_step is not None else None
    held, reason = PersistedJob(view=view, plan=stored).plan_held_for(step)
    assert held == {"view": view.plan, "stored": stored, None: None}[found]
    assert why in reason


@pytest.mark.parametrize(("seconds", "in_buckets"), [
    (0.0002, 11),  # under the first bound: counted in every bucket
    (0.003, 8),  # between 2.5 ms and 5 ms
    (0.7, 1),  # only the 1 s bucket
    (3.0, 0),  # only +Inf (the count)
], ids=["sub-ms", "ms", "slow", "beyond"])
def test_store_write_times_fall_into_cumulative_buckets(seconds: float, in_buckets: int) -> None:
    latency = WriteLatency()
    latency.observe(seconds)
    assert sum(latency.buckets) == in_buckets and latency.count == 1
    assert latency.buckets == sorted(latency.buckets)  # cumulative: never fewer further up
    assert latency.total_s == seconds


def test_every_write_of_the_records_is_timed() -> None:
    async def run() -> Records:
        records = Records(MemoryStore(), "j")
        await records.save_job(pb.JobConfig(job_id="j"))
        await records.commit_step(pb.StepRecord(step=0), None, plan(1))
        await records.save_view(pb.GenerationView(generation=1), [])
        return records

    records = asyncio.run(run())
    assert records.write_latency.count == 3
    assert records.write_latency.buckets[-1] == 3  # the memory store: well under a second
