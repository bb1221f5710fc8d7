"""Each replica's lead (pb.Reduced.lead_s: from handling a commit to the next step's first
microbatch), on the executor in one process: the fake group and the fake controller of
test_executor_fake.py, whose harness this uses (the quotas plan with the lead: quotas.py)."""

from __future__ import annotations

import time
from typing import Any

import pytest

from recover.trainer.executor import StepExecutor
from tests.unit.test_executor_fake import (
    REPLICAS,
    SAFETY_S,
    STEPS,
    Run,
    assert_survivors_match,
    failure_free,
    kill,
    train,
)


@pytest.fixture(scope="module")
def baseline() -> Run:
    return failure_free()


def test_the_time_between_steps_is_reported_as_each_replica_s_lead(baseline: Run) -> None:
    # pb.Reduced.lead_s: from handling the commit to the next step's first microbatch. A
    # replica whose callback after each commit takes 50 ms starts its share that much
    # later; the controller plans its quota with it (quotas.py).
    def slow_callback(executors: dict[int, StepExecutor]) -> None:
        executors[0].workload.on_step_committed = lambda info: time.sleep(0.05)

    run = train(prepare=slow_callback)
    assert_survivors_match(run, baseline, lost=[])
    leads = run.controller.leads
    assert [leads[(0, r)] for r in range(REPLICAS)] == [0.0] * REPLICAS  # no commit before
    for step in range(1, STEPS):
        assert leads[(step, 0)] >= 0.05
        assert all(leads[(step, r)] > 0 for r in range(1, REPLICAS))


def test_a_new_generation_before_the_first_microbatch_leaves_no_lead(baseline: Run) -> None:
    # Replica 0's callback after step 1's commit returns only once the generation that drops
    # replica 2 (killed in step 2's forward) waits in its channel: that wait is the failure's,
    # not time replica 0 spends between its steps, so step 2's reduction reports no lead.
    def wait_for_the_new_generation(executors: dict[int, StepExecutor]) -> None:
        channel = executors[0].channel

        def callback(info: Any) -> None:
            if info.step != 1:
                return
            deadline = time.monotonic() + SAFETY_S
            while not any(c.WhichOneof("kind") == "generation"
                          for c in list(channel._incoming.queue)):
                assert time.monotonic() < deadline
                time.sleep(0.005)

        executors[0].workload.on_step_committed = callback

    run = train(faults=(kill(2, 2, "forward"),), prepare=wait_for_the_new_generation)
    assert_survivors_match(run, baseline, lost=[2])
    assert (2, 2) in run.controller.commits
    assert run.controller.leads[(2, 0)] == 0.0
    assert run.controller.leads[(3, 0)] > 0  # measured again from the next commit
