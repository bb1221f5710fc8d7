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


def test_background_digests_never_hold_more_than_two_snapshots() -> None:
    # Steps that outrun the hash wait for the oldest digest instead of piling up copies of
    # the parameters on the device.
    sent: list[pb.WorkerReport] = []
    release = threading.Event()
    digests = BackgroundDigests(0, sent.append)
    blocked = digests._pool.submit(release.wait)  # the hashing thread is busy
    records = [pb.StepRecord(step=s) for s in range(3)]
    tensors = [("w", torch.ones(2))]
    digests.submit(0, records[0], 0.0, tensors, [], borrow=False)
    digests.submit(1, records[1], 0.0, tensors, [], borrow=False)
    waiter = threading.Thread(target=digests.submit, args=(2, records[2], 0.0, tensors, []),
                              kwargs={"borrow": False})
    waiter.start()
    waiter.join(0.2)
    assert waiter.is_alive() and sent == []  # the third waits for room
    release.set()
    waiter.join(SAFETY_S)
    blocked.result()
    digests.settle()
    assert [r.applied.step for r in sent] == [0, 1, 2]
    assert all(len(r.param_sha256) == 1 for r in records)
    digests.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: the side-stream "
                    "copy of a GPU snapshot cannot run here (scripts/gpu_check.sh runs it)")
def test_a_gpu_snapshot_is_hashed_as_it_was_taken_while_the_parameters_change() -> None:
    # The hashing thread copies the snapshot on a stream of its own: the copy must wait for
    # the clone (queued on the default stream behind a long kernel) and see none of what
    # the next step then writes into the parameters.
    weight = torch.randn(4096, 4096, device="cuda")
    expected = step_digest([("w", weight.cpu())])
    sent: list[pb.WorkerReport] = []
    digests = BackgroundDigests(0, sent.append)
    busy = torch.randn(8192, 8192, device="cuda")
    for _ in range(10):  # ~0.2 s of kernels queued before the snapshot's clone
        busy = busy @ busy / 8192
    digests.submit(0, pb.StepRecord(step=0), 0.0, [("w", weight)], [])  # cloned on the GPU
    for _ in range(8):
        weight.mul_(1.5)  # the next step's writes, queued after the snapshot
    digests.settle()
    assert [r.applied.param_sha256 for r in sent] == [expected]
    assert step_digest([("w", weight.cpu())]) != expected
    digests.close()
