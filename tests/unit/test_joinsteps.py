"""The joiner's side of a failed join (trainer/joinsteps.py): admitted one step short, a
one-rank replica reports the failure and waits for another attempt; anything else that
cannot be met is an error, as before."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from recover.proto import pb
from recover.trainer.joinsteps import JoinSteps

JOIN = pb.Join(joiner=4, donor=0, token="t", attempt=2)


def joiner(*, admitted_at: int | None, step: int = 7, lockstep: Any = None) -> SimpleNamespace:
    sent: list[pb.WorkerReport] = []
    view = None if admitted_at is None else pb.GenerationView(
        generation=3, members=[1, 4], plan=pb.Plan(step=admitted_at))
    return SimpleNamespace(
        _admission=view, state=SimpleNamespace(step=step), lockstep=lockstep,
        _pending_join=None, state_loaded=True, join_failure_reported=False, sent=sent,
        channel=SimpleNamespace(send=sent.append), generation=0, replica=4,
        _ctx=lambda: {}, entered=[],
        _enter_generation=lambda v: None)


def end(worker: SimpleNamespace, failure: str) -> None:
    worker._enter_generation = worker.entered.append
    JoinSteps._join_ended(worker, JOIN, failure)  # type: ignore[arg-type]


@pytest.mark.parametrize("admitted_at, failure, reported", [
    pytest.param(8, "the peer closed the connection",
                 "admitted at step 8 one step short: the peer closed the connection",
                 id="admitted-short-reports-and-waits"),
    pytest.param(None, "the peer closed the connection", "the peer closed the connection",
                 id="not-admitted-reports"),
])
def test_a_failed_attempt_is_reported_with_what_the_joiner_holds(admitted_at, failure,
                                                                  reported):
    worker = joiner(admitted_at=admitted_at)
    end(worker, failure)
    (report,) = worker.sent
    assert report.join_failed == pb.JoinFailed(donor=0, reason=reported, attempt=2, step=7)
    assert worker._admission is None and worker.join_failure_reported and not worker.entered


def test_an_admission_it_holds_the_state_for_is_entered():
    worker = joiner(admitted_at=7)
    end(worker, "the peer closed the connection")  # a spare: every step it needs is here
    assert [v.generation for v in worker.entered] == [3] and not worker.sent


@pytest.mark.parametrize("failure, lockstep", [
    pytest.param("", None, id="stream-ended-cleanly-yet-short"),
    pytest.param("the peer closed the connection", object(), id="several-ranks"),
])
def test_what_cannot_be_waited_out_is_an_error(failure, lockstep):
    worker = joiner(admitted_at=8, lockstep=lockstep)
    with pytest.raises(RuntimeError, match="admitted at step 8 while at step 7"):
        end(worker, failure)
    assert not worker.sent
