"""A new generation's group meets while the survivors compute (trainer/groups/meeting.py).

In-process, on the fake group: a survivor must not wait for the slowest member's group
build before computing the step's microbatches (its own and the lost replica's); only the
reduction waits for the group. The gate below holds the recovery generation's meeting shut
until every survivor has computed its whole share: with a worker that met first, nobody
would compute and the test would fail at its safety timeout instead.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from recover.trainer.executor import StepExecutor
from recover.trainer.groups import CollectiveAborted, CrossReplicaGroup, GroupSpec
from recover.trainer.groups.fake import FakeWorld
from recover.trainer.groups.meeting import Meeting
from tests.unit.test_executor_fake import (
    REPLICAS,
    SAFETY_S,
    Run,
    assert_survivors_match,
    kill,
    train,
)


class GatedGroup:
    """A group whose connect() waits for `gate` first (everything else is the group's)."""

    def __init__(self, group: CrossReplicaGroup, gate: threading.Event) -> None:
        self._group, self._gate = group, gate

    def connect(self) -> None:
        if not self._gate.wait(SAFETY_S):
            raise CollectiveAborted("the gate never opened: nobody computed before meeting")
        self._group.connect()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._group, name)


@pytest.fixture(scope="module")
def baseline() -> Run:
    """The failure-free run, every group meeting at once."""
    return train()


def test_survivors_compute_their_share_before_the_new_group_has_met(baseline: Run) -> None:
    gate = threading.Event()
    recovery_generation = 2  # replica 2 is lost in step 1's forward: generation 2 follows
    survivors = [r for r in range(REPLICAS) if r != 2]

    def prepare(executors: dict[int, StepExecutor]) -> None:
        for executor in executors.values():
            build = executor.build_group

            def gated(spec: GroupSpec, build: Any = build) -> Any:
                group = build(spec)
                return GatedGroup(group, gate) if spec.generation == recovery_generation \
                    else group
            executor.build_group = gated

        def open_once_computed() -> None:
            deadline = time.monotonic() + SAFETY_S
            while time.monotonic() < deadline:
                if all(e.generation == recovery_generation and e.state.assigned
                       and len(e.state.done) == len(e.state.assigned)
                       for e in (executors[r] for r in survivors)):
                    gate.set()
                    return
                time.sleep(0.005)
        threading.Thread(target=open_once_computed, daemon=True).start()

    run = train(faults=(kill(1, 2, "forward"),), prepare=prepare)
    assert gate.is_set()
    assert run.controller.commits[1] == (1, recovery_generation)
    assert_survivors_match(run, baseline, [2])


def test_a_meeting_reports_its_group_met_or_why_not() -> None:
    def spec(rank: int) -> GroupSpec:
        return GroupSpec(generation=1, rank=rank, world_size=2, store_host="fake", store_port=0)
    world = FakeWorld(2, 1, timeout_s=SAFETY_S)
    meetings = [Meeting(world.group(rank, spec(rank))) for rank in range(2)]
    assert [m.wait() for m in meetings] == [None, None]
    assert all(m.met and m.took_s is not None for m in meetings)
    # A meeting the group's abort() ends: not met, and the reason kept.
    lonely = FakeWorld(2, 2, timeout_s=SAFETY_S).group(0, spec(0))
    meeting = Meeting(lonely)
    assert not meeting.met
    lonely.abort()
    assert meeting.wait() is not None and not meeting.met
