"""The coordinator feeds measured speeds to a quota policy: with `policy = "proportional"`
the plan each commit hands out follows the members' reported compute times (the pure
policy is tested in test_quotas.py; here: the wiring, in-process, on a fake clock)."""

from __future__ import annotations

import asyncio

from recover.proto import pb
from tests.unit.coordinator_harness import Harness, make_job, plan_dict


def reduced(h: Harness, replica: int, seconds_per_mb: float, lead_s: float = 0.0) -> pb.Reduced:
    msg = h.reduced_msg(replica)
    msg.compute_s = seconds_per_mb * len(msg.microbatch_ids)
    msg.lead_s = lead_s
    return msg


async def train(h: Harness, steps: int, seconds_per_mb: dict[int, float],
                leads: dict[int, float] | None = None
                ) -> list[tuple[dict[int, tuple[int, ...]], str]]:
    """Run `steps` steps in which member r takes seconds_per_mb[r] per microbatch (and
    starts them leads[r] after the commit); the plan each commit handed out (with its
    reason), in order."""
    for _ in range(steps):
        step = h.coord.step
        for m in h.coord.members:
            await h.coord.reduced(m, reduced(h, m, seconds_per_mb[m], (leads or {}).get(m, 0.0)))
        await h.apply(step)
    by_step = {c.step: c.next_plan for _, c in h.messages("commit") if c.HasField("next_plan")}
    return [(plan_dict(p), p.reason) for _, p in sorted(by_step.items())]


async def started(replicas: int = 4, m: int = 16, steps: int = 6) -> Harness:
    """A started in-process coordinator of a job with `--policy proportional`."""
    job = make_job(replicas=replicas, steps=steps, m=m)
    job.policy = "proportional"
    h = Harness(job)
    await h.start()
    return h


def quotas(plan: dict[int, tuple[int, ...]]) -> dict[int, int]:
    assert sorted(mb for ids in plan.values() for mb in ids) == list(range(16))
    return {r: len(ids) for r, ids in plan.items()}


def test_a_replica_twice_as_slow_gets_half_the_share_and_equal_ones_stay_uniform():
    async def body():
        h = await started()
        first = quotas(dict(h.coord.plan))  # nobody measured yet: uniform
        return first, await train(h, 5, {0: 0.1, 1: 0.1, 2: 0.2, 3: 0.1})

    first, plans = asyncio.run(body())
    assert first == {0: 4, 1: 4, 2: 4, 3: 4}
    # One measured step is enough; makespan 0.5 s instead of uniform's 0.8 s.
    assert [quotas(p) for p, _ in plans] == [{0: 5, 1: 5, 2: 2, 3: 4}] * 5
    assert "replica 2 measured 2.0x slower than the median: 2 of 16" in plans[0][1]
    assert "predicted step 0.5s (uniform 0.8s)" in plans[0][1]
    assert "the current quotas are already the best" in plans[-1][1]  # hysteresis: kept


def test_a_replica_that_starts_its_share_late_gets_fewer():
    # Its lead (pb.Reduced.lead_s): replica 0 evaluates for 20 ms after every commit while
    # the others start 2 ms after it; its microbatches even measure faster (the others,
    # done, leave it the cores), which without leads handed it more.
    async def body():
        h = await started()
        return await train(h, 4, {0: 0.003, 1: 0.004, 2: 0.004, 3: 0.004},
                           {0: 0.020, 1: 0.002, 2: 0.002, 3: 0.002})

    plans = asyncio.run(body())
    assert [quotas(p) for p, _ in plans] == [{0: 1, 1: 5, 2: 5, 3: 5}] * 4
    assert "replica 0 starts its share 18 ms after the median (its time between steps)" \
        in plans[0][1]


def test_equal_replicas_with_noise_keep_the_uniform_plan():
    async def body():
        h = await started()
        return await train(h, 5, {0: 0.100, 1: 0.103, 2: 0.098, 3: 0.101})

    plans = asyncio.run(body())
    assert [quotas(p) for p, _ in plans] == [{0: 4, 1: 4, 2: 4, 3: 4}] * 5


def test_a_lost_members_microbatches_go_where_they_finish_earliest():
    async def body():
        h = await started(replicas=3, m=12, steps=10)
        await train(h, 3, {0: 0.1, 1: 0.3, 2: 0.1})  # replica 1 measured 3x slower
        before = dict(h.coord.plan)
        await h.coord.worker_exited(pb.WorkerExited(replica=2, signal=9))
        return before, dict(h.coord.plan)

    before, after = asyncio.run(body())
    gained = {r: len(after[r]) - len(before[r]) for r in after}
    assert set(after) == {0, 1} and after[0][:len(before[0])] == before[0]
    assert gained[0] > gained[1]  # the fast survivor takes most of the lost share
    assert sorted(mb for ids in after.values() for mb in ids) == list(range(12))


def test_quotas_and_measured_speeds_are_visible_in_status_and_metrics():
    from recover.cli.inspect import format_status
    from recover.controller.control import job_status
    from recover.controller.metrics import ControllerCollector

    async def body():
        h = await started()
        await train(h, 2, {0: 0.1, 1: 0.1, 2: 0.2, 3: 0.1}, {0: 0.002, 1: 0.002, 2: 0.002})
        return h

    h = asyncio.run(body())
    status = job_status(h.coord)
    assert [(e.replica, e.microbatches, e.microbatch_s, e.lead_s) for e in status.load] == [
        (0, 5, 0.1, 0.002), (1, 5, 0.1, 0.002), (2, 2, 0.2, 0.002), (3, 4, 0.1, 0.0)]
    assert "plan        0:5@100ms+2ms 1:5@100ms+2ms 2:2@200ms+2ms 3:4@100ms" in format_status(status)
    metrics = {m.name: m for m in ControllerCollector(h.coord).collect()}
    samples = {s.labels["replica"]: s.value for s in metrics["recover_microbatch_seconds"].samples}
    assert samples == {"0": 0.1, "1": 0.1, "2": 0.2, "3": 0.1}
    leads = {s.labels["replica"]: s.value for s in metrics["recover_lead_seconds"].samples}
    assert leads == {"0": 0.002, "1": 0.002, "2": 0.002}  # 3 reported none: not measured
    quotas_metric = {s.labels["replica"]: s.value
                     for s in metrics["recover_microbatches_planned"].samples}
    assert quotas_metric == {"0": 5, "1": 5, "2": 2, "3": 4}
