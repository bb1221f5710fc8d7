"""Work-stealing in the step executor, in one process: replica threads on the fake group
(test_executor_fake's harness), a fake controller that plays one steal by the protocol.

Replica 2 is held inside a microbatch of step 1 (a gate in its hooks) while the others
finish theirs; the fake controller then sends it a Release, opens the gate, and hands what
it released to replica 0. Everything is ordered by the gate and the reports, never by
time, so each test sees exactly one steal, and checks the two things that must hold: the
giver answers with exactly the microbatches it had not started, and the parameters after
every step are bitwise the failure-free run's (exact mode).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

import pytest

from recover.proto import pb
from recover.trainer.executor import StepExecutor
from recover.trainer.hooks import StepHooks
from tests.unit.test_executor_fake import (
    SAFETY_S,
    FakeController,
    Run,
    assert_survivors_match,
    train,
)

STEAL_STEP = 1
GIVER, TAKER, BYSTANDER = 2, 0, 1


@dataclass
class StealingController(FakeController):
    """Open plans; in STEAL_STEP, once the taker and the bystander are idle, asks the giver
    to release `asked` and gives what it released to the taker. Idle members are closed
    (ShareUpdate open=false) when no steal is pending."""

    asked: list[int] = field(default_factory=list)
    gate: threading.Event = field(default_factory=threading.Event)
    """Opened once the Release is sent: the giver goes on."""
    at_gate: threading.Event = field(default_factory=threading.Event)
    """Set by the giver when it reaches the gate: the Release is sent only then, so where
    the giver is when it reads it does not depend on how the threads were scheduled."""
    idle: set[int] = field(default_factory=set)
    stealing: bool = False
    released: list[int] | None = None
    summed: dict[tuple[int, int], list[int]] = field(default_factory=dict)
    """(step, replica) -> the microbatches its reduction summed."""

    def as_plan(self, step: int, plan: dict[int, list[int]]) -> pb.Plan:
        message = super().as_plan(step, plan)
        message.open = True
        return message

    def new_generation(self) -> None:
        self.idle = set()
        super().new_generation()

    def maybe_commit(self) -> None:
        if set(self.reduced) == set(self.members):
            for replica, reduced in self.reduced.items():
                self.summed[(self.step, replica)] = list(reduced.microbatch_ids)
            self.idle = set()
        super().maybe_commit()

    def share(self, replica: int, open_: bool) -> None:
        self.send([replica], share=pb.ShareUpdate(
            generation=self.generation, step=self.step, replica=replica,
            microbatch_ids=self.plan[replica], open=open_))

    def on_report(self, report: pb.WorkerReport) -> None:
        kind = report.WhichOneof("kind")
        if kind == "progress":
            p = report.progress
            if p.step != self.step or list(p.done) != self.plan[report.replica]:
                return  # not idle yet
            self.idle.add(report.replica)
            if self.step == STEAL_STEP and self.released is None:
                if {TAKER, BYSTANDER} <= self.idle and not self.stealing:
                    self.stealing = True
                    assert self.at_gate.wait(SAFETY_S), "the giver never reached its gate"
                    self.send([GIVER], release=pb.Release(
                        generation=self.generation, step=self.step, replica=GIVER, steal=1,
                        microbatch_ids=self.asked))
                    self.gate.set()
                return
            self.close_idle()
        elif kind == "released":
            self.released = list(report.released.microbatch_ids)
            gone = set(self.released)
            self.plan[GIVER] = [mb for mb in self.plan[GIVER] if mb not in gone]
            if self.released:
                self.plan[TAKER] = self.plan[TAKER] + self.released
                self.idle.discard(TAKER)
                self.share(TAKER, True)
            self.close_idle()
        else:
            super().on_report(report)

    def close_idle(self) -> None:
        for replica in sorted(self.idle):
            self.share(replica, False)
        self.idle = set()


class Gate(StepHooks):
    """Holds the giver after its `position`-th microbatch of STEAL_STEP until the fake
    controller has sent the Release (which the giver then reads at the boundary)."""

    def __init__(self, gate: threading.Event, at_gate: threading.Event, position: int) -> None:
        self.gate, self.at_gate, self.position = gate, at_gate, position

    def after_microbatch(self, step: int, position: int, count: int, grads: Any) -> None:
        if step == STEAL_STEP and position == self.position:
            self.at_gate.set()
            assert self.gate.wait(SAFETY_S), "the fake controller never sent the release"


@pytest.fixture(scope="module")
def baseline() -> Run:
    """The failure-free run with uniform, closed plans (no stealing)."""
    return train()


def steal(asked_positions: slice, gate_after: int, **train_args: Any
          ) -> tuple[Run, StealingController]:
    made: list[StealingController] = []

    def controller(*args: Any, **kwargs: Any) -> StealingController:
        made.append(StealingController(*args, **kwargs))
        return made[0]

    def prepare(executors: dict[int, StepExecutor]) -> None:
        fake = made[0]
        share = fake.uniform(list(range(len(executors))))[GIVER]
        fake.asked = share[asked_positions]
        executors[GIVER].hooks = Gate(fake.gate, fake.at_gate, gate_after)

    run = train(controller_of=controller, prepare=prepare, **train_args)
    return run, made[0]


def test_a_release_gives_only_unstarted_microbatches_and_the_step_learns_the_same(
        baseline: Run) -> None:
    # The giver (2 microbatches: 4, 5) is held after its first; asked for 5, it releases
    # it, replica 0 computes it, and step 1 sums the same six microbatches.
    run, fake = steal(slice(1, None), gate_after=0)
    assert fake.released == [5]
    assert fake.summed[(STEAL_STEP, GIVER)] == [4]
    assert fake.summed[(STEAL_STEP, TAKER)] == [0, 1, 5]
    assert fake.summed[(STEAL_STEP, BYSTANDER)] == [2, 3]
    assert_survivors_match(run, baseline, lost=[])


def test_a_release_of_started_microbatches_gives_nothing(baseline: Run) -> None:
    # Held after its last microbatch, the giver has started (finished) both it was asked
    # for: it releases neither, and nothing moves.
    run, fake = steal(slice(None), gate_after=1)
    assert fake.released == []
    assert fake.summed[(STEAL_STEP, GIVER)] == [4, 5]
    assert fake.summed[(STEAL_STEP, TAKER)] == [0, 1]
    assert_survivors_match(run, baseline, lost=[])
