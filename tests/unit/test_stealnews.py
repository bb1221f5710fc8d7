"""What a member of an open plan reports (common/stealnews.py, trainer/stepstate.py): news
only, and what the controller assumes of its silence agrees with it."""

from __future__ import annotations

import pytest

from recover.common.stealnews import assumed_done, worth_reporting
from recover.controller.stealing import Member, assumed
from recover.trainer.stepstate import StepState


@pytest.mark.parametrize("left, elapsed, done_since, pace, news, why", [
    (3, 0.10, 2, 0.05, False, "on schedule"),
    (3, 0.11, 2, 0.05, False, "a little late: under a quarter microbatch"),
    (3, 0.09, 2, 0.05, False, "a little early"),
    (3, 0.113, 2, 0.05, True, "over a quarter microbatch late"),
    (3, 0.085, 2, 0.05, True, "more than a quarter early"),
    (3, 0.20, 2, 0.05, True, "2x slower"),
    (1, 0.10, 2, 0.05, True, "now on its last microbatch: a taker to be"),
    (0, 0.10, 2, 0.05, True, "idle"),
    (5, 0.10, 1, 0.00, True, "the controller assumes no pace yet"),
])
def test_worth_reporting(left: int, elapsed: float, done_since: int, pace: float, news: bool,
                         why: str) -> None:
    assert worth_reporting(left=left, elapsed_s=elapsed, done_since=done_since,
                           pace_s=pace) is news, why


@pytest.mark.parametrize("left, elapsed, pace, done", [
    (6, 0.00, 0.05, 0),
    (6, 0.049, 0.05, 0),   # still in the microbatch it was heard in
    (6, 0.05, 0.05, 1),
    (6, 0.17, 0.05, 3),
    (6, 9.00, 0.05, 4),    # at most to the start of its last: that one it reports
    (2, 9.00, 0.05, 0),    # one more, then its last: reported
    (6, 1.00, 0.00, 0),    # no pace: nothing assumed
])
def test_assumed_done(left: int, elapsed: float, pace: float, done: int) -> None:
    assert assumed_done(left=left, elapsed_s=elapsed, pace_s=pace) == done


def test_a_member_on_schedule_reports_only_its_last_and_its_end() -> None:
    # The worker's side and the controller's agree: while the member keeps to the assumed
    # pace it is silent, and the controller's prediction of it stays right.
    state = StepState(step=4, assigned=list(range(8)), open=True)
    began, pace = 10.0, 0.05
    state.heard(began, pace)
    book = Member(0, tuple(range(8)), 0, pace, began, quiet=True)
    reported, ended = [], began
    for i in range(8):
        ended += pace * (1.1 if i % 2 else 0.9)  # each microbatch's noise, under the margin
        state.done.append(i)
        if state.is_news(ended):
            reported.append(len(state.done))
            state.heard(ended, pace)
            book = Member(0, book.share, len(state.done), pace, ended, quiet=True)
        else:
            said = assumed(book, ended)
            assert abs(said.finish(ended) - (ended + (8 - len(state.done)) * pace)) \
                <= 0.25 * pace + 1e-9, f"after microbatch {i}"
    assert reported == [7, 8]  # on its last, then idle


def test_a_member_that_slows_down_says_so_once_and_is_then_silent_again() -> None:
    state = StepState(step=4, assigned=list(range(8)), open=True)
    state.heard(0.0, 0.05)
    reported, now = [], 0.0
    for i in range(8):
        took = 0.05 if i < 2 else 0.10  # 2x slower from its third microbatch
        now += took
        state.done.append(i)
        if state.is_news(now):
            reported.append(len(state.done))
            state.heard(now, took)
    assert reported == [3, 7, 8]  # the first slow one, then its last and its end


def test_after_a_new_generation_the_next_microbatch_is_reported() -> None:
    state = StepState(step=4, assigned=list(range(8)), open=True, done=[0, 1])
    assert state.heard_at is None and state.is_news(1.0)
