"""Step digests hashed on a thread with the host parameters borrowed, not copied
(trainer/stepdigest.py): what is hashed is the state after the step, whatever the training
loop does next. The hashing thread is held busy so that each write lands while the digest
waits to be hashed: no timing is assumed."""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch

from recover.proto import pb
from recover.trainer.digest import step_digest
from recover.trainer.stepdigest import BackgroundDigests

SAFETY_S = 30.0


@contextmanager
def hashing_held(digests: BackgroundDigests) -> Iterator[None]:
    """The hashing thread is busy until the block ends: what the block submits is hashed
    after everything the block wrote."""
    go = threading.Event()
    busy = digests._pool.submit(go.wait)
    try:
        yield
    finally:
        go.set()
        busy.result(SAFETY_S)


def reports() -> tuple[list[pb.WorkerReport], BackgroundDigests]:
    sent: list[pb.WorkerReport] = []
    return sent, BackgroundDigests(0, sent.append)


def test_borrowed_parameters_are_hashed_in_place_and_released_before_they_change() -> None:
    sent, digests = reports()
    weight, stats = torch.arange(6.0), torch.ones(3)
    expected = step_digest([("w", weight.clone())], [("b", stats.clone())])
    with hashing_held(digests):
        digests.submit(0, pb.StepRecord(step=0), 0.0, [("w", weight)], [("b", stats)])
        assert digests._pending[0].borrowed
        stats.add_(1)  # the next forward rewrites the buffers: they were copied
        releaser = threading.Thread(target=digests.release)
        releaser.start()
        releaser.join(0.2)
        assert releaser.is_alive() and sent == []  # the optimizer waits for the hash
    releaser.join(SAFETY_S)
    assert [r.applied.param_sha256 for r in sent] == [expected]
    weight.mul_(2)  # the optimizer step after the release: nothing pending reads it
    assert digests.borrowing and not digests._pending
    digests.close()


def test_a_parameter_written_while_it_waits_to_be_hashed_is_flagged_then_copied(
        caplog: pytest.LogCaptureFixture) -> None:
    # A write outside the optimizer step (a user's in-place edit during the next step): the
    # digest may be torn, so it is flagged and the parameters are copied from then on.
    sent, digests = reports()
    weight = torch.arange(6.0)
    with hashing_held(digests):
        digests.submit(0, pb.StepRecord(step=0), 0.0, [("w", weight)], [])
        weight.add_(1)
    with caplog.at_level(logging.WARNING, logger="recover.trainer"):
        digests.release()
    assert not digests.borrowing
    assert "step 0: a parameter was written in place while its digest was hashed" in caplog.text
    after = step_digest([("w", weight.clone())])
    with hashing_held(digests):
        digests.submit(1, pb.StepRecord(step=1), 0.0, [("w", weight)], [])
        assert not digests._pending[-1].borrowed
        weight.add_(1)  # written before the hash ran: the copy is what is hashed
    digests.settle()
    assert sent[-1].applied.step == 1 and sent[-1].applied.param_sha256 == after
    digests.close()


def test_without_borrowing_the_parameters_are_copied_when_submitted() -> None:
    # A callback after the commit may write the parameters (executor.py passes
    # borrow=False then), as may a parameter that is not a plain host tensor.
    sent, digests = reports()
    weight = torch.arange(6.0)
    expected = step_digest([("w", weight.clone())])
    with hashing_held(digests):
        digests.submit(0, pb.StepRecord(step=0), 0.0, [("w", weight)], [], borrow=False)
        assert not digests._pending[0].borrowed
        weight.add_(1)
    digests.release()  # nothing borrowed: returns without waiting for the hash
    digests.settle()
    assert [r.applied.param_sha256 for r in sent] == [expected]
    assert digests.borrowing  # nothing was torn
    digests.close()
