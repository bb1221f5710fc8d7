"""An aborted gloo group stops waiting for a collective gloo itself does not end
(trainer/groups/gloo.py `wait_or_abort`, trainer/groups/graveyard.py).

gloo fails an operation whose peers hang up, and abort() makes them hang up; a test run
here once had a survivor wait anyway, 30 s, for a dead generation's allreduce. These tests
stand in for that gloo state with a Work that never completes by itself (the seam is the
group's process group, replaced after a real one-member connect), and check that the wait
ends within a slice of the abort, that close() does not block on the running operation, and
that the group is destroyed once the operation ends. One real gloo group checks that an
ordinary reduction is untouched by the sliced wait.
"""

from __future__ import annotations

import datetime
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch

from recover.trainer.groups import CollectiveAborted, GroupSpec, graveyard
from recover.trainer.groups.gloo import WAIT_SLICE, GenerationGroup, RendezvousServer, wait_or_abort
from tests.unit.background import in_background


class StuckWork:
    """A c10d Work as gloo's would behave for an operation it never ends by itself."""

    def __init__(self, slices_until_done: int | None = None, fails: bool = False) -> None:
        self.waits = 0
        self.done = threading.Event()
        self.slices_until_done = slices_until_done
        self.fails = fails

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        self.waits += 1
        if self.slices_until_done is not None and self.waits > self.slices_until_done:
            self.done.set()
        if timeout is not None and not self.done.wait(timeout.total_seconds()):
            raise RuntimeError("Operation timed out!")
        self.done.wait()
        if self.fails:
            raise RuntimeError("Connection closed by peer")
        return True

    def is_completed(self) -> bool:
        return self.done.is_set()


@pytest.mark.parametrize("work, aborted_after, finished, raises", [
    pytest.param(StuckWork(0), None, True, None, id="done-within-the-first-slice"),
    pytest.param(StuckWork(3), None, True, None, id="done-after-three-slices"),
    pytest.param(StuckWork(2, fails=True), None, True, "Connection closed", id="its-own-failure"),
    pytest.param(StuckWork(), 2, False, None, id="aborted-while-it-runs"),
])
def test_wait_or_abort(work: StuckWork, aborted_after: int | None, finished: bool,
                       raises: str | None) -> None:
    def aborted() -> bool:
        return aborted_after is not None and work.waits >= aborted_after

    if raises:
        with pytest.raises(RuntimeError, match=raises):
            wait_or_abort(work, aborted)
        return
    assert wait_or_abort(work, aborted) is finished


class StuckGroup:
    """A process group whose every allreduce hangs like the one in the clean-clone check."""

    def __init__(self) -> None:
        self.works: list[StuckWork] = []

    def allreduce(self, tensors: list[torch.Tensor], options: Any) -> StuckWork:
        self.works.append(StuckWork())
        return self.works[-1]


def test_an_aborted_group_stops_waiting_closes_at_once_and_is_destroyed_once_gloo_ends_it() -> None:
    server = RendezvousServer()
    group = GenerationGroup(GroupSpec(1, 0, 1, "127.0.0.1", server.port, timeout_s=10))
    try:
        group.connect()
        total = torch.ones(8)
        group.allreduce_sum_(total)  # the real gloo group: the sliced wait changes nothing
        assert torch.equal(total, torch.ones(8))
        stuck = StuckGroup()
        real, group._pg = group._pg, stuck  # type: ignore[assignment]
        thread, outcome = in_background(lambda: group.allreduce_sum_(torch.ones(8)))
        time.sleep(0.2)
        assert thread.is_alive() and stuck.works  # waiting for gloo
        aborted_at = time.monotonic()
        group.abort()  # a new generation
        thread.join(5)
        assert isinstance(outcome[0], CollectiveAborted)
        assert time.monotonic() - aborted_at < 0.5  # a slice or two, not the 10 s timeout
        closes_into_the_graveyard(group, stuck)
        del real
    finally:
        group.close()
        server.close()
    assert WAIT_SLICE.total_seconds() <= 0.05


def closes_into_the_graveyard(group: GenerationGroup, stuck: StuckGroup,
                              while_buried: Callable[[], None] = lambda: None) -> None:
    """close() returns at once, the group buried while its collective runs; once gloo ends
    the collective (its own timeout), the graveyard destroys the group."""
    before = graveyard.buried()
    closing = time.monotonic()
    group.close()
    assert time.monotonic() - closing < 0.5 and graveyard.buried() == before + 1
    while_buried()
    stuck.works[0].done.set()
    graveyard.purge()
    assert graveyard.buried() == before


def test_a_group_closed_under_a_started_unwaited_collective_is_buried_not_destroyed() -> None:
    # The once-in-a-while 30 s recovery (bench/results/flake-kill-each-phase): an exact
    # piece's reduction started during the backward, a peer died before it was waited for,
    # and close() destroyed the group under it, which waits for gloo's own timeout.
    server = RendezvousServer()
    group = GenerationGroup(GroupSpec(1, 0, 1, "127.0.0.1", server.port, timeout_s=10))
    try:
        group.connect()
        stuck = StuckGroup()
        real, group._pg = group._pg, stuck  # type: ignore[assignment]
        wait = group.start_allreduce_sum_(torch.ones(8))  # started, never waited for
        assert stuck.works and not stuck.works[0].is_completed()

        def late_wait() -> None:
            with pytest.raises(CollectiveAborted):
                wait()  # told the group is gone, at once

        closes_into_the_graveyard(group, stuck, late_wait)
        del real
    finally:
        group.close()
        server.close()
