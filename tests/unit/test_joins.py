"""Join decisions (controller/joins.py): donors, entry at a step boundary, retries."""

from __future__ import annotations

import dataclasses

import pytest

from recover.controller.joins import (
    MAX_ATTEMPTS,
    Join,
    JoinPhase,
    after_failure,
    check_snapshot,
    choose_donor,
    entry,
)


@pytest.mark.parametrize("members, load, donating, avoid, donor, reason", [
    ([0, 1, 2], {0: 4, 1: 4, 2: 4}, {}, [], 0, "replica 0 donates (feeds 0 other joins"),
    ([0, 1, 2], {0: 5, 1: 4, 2: 4}, {}, [], 1, "computes 4 microbatches"),
    ([0, 1, 2], {}, {0: 1}, [], 1, "replica 1 donates"),
    ([0, 1, 2], {}, {}, [0, 1], 2, "replica 2"),
    ([0], {}, {}, [0], 0, "replica 0"),  # the only member, though it failed before
    ([], {}, {}, [], None, "no live member"),
])
def test_choose_donor(members, load, donating, avoid, donor, reason):
    choice = choose_donor(members, load, donating, avoid)
    assert choice.donor == donor
    assert reason in choice.reason


def joined(step: int, phase: JoinPhase = JoinPhase.TRANSFERRING) -> Join:
    return Join(joiner=7, phase=phase, donor=0, step=step)


@pytest.mark.parametrize("join, enters_at, in_flight, members, final, enter, spare, reason", [
    (joined(10), 11, 1, 3, False, True, False, "caught up: it enters at step 11"),
    (joined(9), 11, 1, 3, False, False, False, "at step 9, 1 steps behind"),
    (joined(-1), 11, 1, 3, False, False, False, "has no state yet"),
    (joined(10, JoinPhase.WAITING_DONOR), 11, 1, 3, False, False, False,
     "no donor to send it step 10"),  # state kept from a failed attempt, stream gone
    (joined(10, JoinPhase.WAITING_DONOR), 10, 0, 0, False, True, False,
     "enters at step 10"),  # every member lost: what it holds is all there is
    (joined(10), 11, 1, 4, False, False, True, "hot spare: the job has its 4 members"),
    (joined(10), 11, 1, 3, True, False, False, "the job ends"),
    (joined(10), 10, 0, 0, False, True, False, "enters at step 10"),  # replacing lost members
    (joined(9), 10, 0, 0, False, False, False, "1 steps behind"),  # no donor left to send it
])
def test_entry(join, enters_at, in_flight, members, final, enter, spare, reason):
    verdict = entry(join, enters_at, in_flight=in_flight, members=members, target=4, final=final)
    assert (verdict.enter, verdict.spare) == (enter, spare)
    assert reason in verdict.reason


def test_after_failure_retries_then_gives_up():
    join = Join(joiner=3, attempts=1)
    retry = after_failure(join, "peer closed")
    assert retry.retry and f"attempt 2 of {MAX_ATTEMPTS}" in retry.reason
    retry = after_failure(dataclasses.replace(join, attempts=MAX_ATTEMPTS), "peer closed")
    assert not retry.retry and "abandoned" in retry.reason and "peer closed" in retry.reason


@pytest.mark.parametrize("reported, committed, trusted, reason", [
    ("aa", {"aa"}, True, "the snapshot holds the parameters committed at step 4"),
    ("aa", {"aa", "bb"}, True, "committed at step 4"),  # a divergence already reported elsewhere
    ("cc", {"aa"}, False, "the snapshot from replica 2 holds other parameters than those "
                          "committed at step 4 (cc against aa)"),
    ("", {"aa"}, True, "not verifiable"),   # a worker that sends no digest
    ("cc", set(), True, "not verifiable"),  # nothing committed yet to compare with
])
def test_check_snapshot(reported, committed, trusted, reason):
    check = check_snapshot(reported, committed, step=5, donor=2)
    assert check.trusted is trusted and reason in check.reason
