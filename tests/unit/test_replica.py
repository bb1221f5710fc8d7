"""trainer/replica.py: a microbatch split over a replica's ranks, and the lockstep its ranks
keep (rank 0's moves, the agreement after a reduction, the replica's digest), run by two
threads on a real gloo group built directly (no default process group in the test process)."""

from __future__ import annotations

import datetime
import hashlib
import threading
from collections import namedtuple
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist

from recover.proto import pb
from recover.trainer.replica import Lockstep, ReplicaBroken, ReplicaRanks, split_batch

Pair = namedtuple("Pair", "x y")

SPLIT_ROWS = [
    pytest.param(torch.arange(8).view(4, 2), 1, 2, torch.tensor([[4, 5], [6, 7]]), id="tensor"),
    pytest.param({"ids": torch.arange(4), "note": "keep"}, 0, 2,
                 {"ids": torch.tensor([0, 1]), "note": "keep"}, id="dict-non-tensors-whole"),
    pytest.param((torch.arange(6), [torch.arange(6)]), 2, 3,
                 (torch.tensor([4, 5]), [torch.tensor([4, 5])]), id="nested-tuple-list"),
    pytest.param(Pair(torch.arange(2), 7), 1, 2, Pair(torch.tensor([1]), 7), id="namedtuple"),
    pytest.param(torch.arange(4), 0, 1, torch.arange(4), id="one-rank-the-whole"),
]


def same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return type(a) is type(b) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return type(a) is type(b) and len(a) == len(b) and all(map(same, a, b))
    return bool(a == b)


@pytest.mark.parametrize(("batch", "rank", "size", "want"), SPLIT_ROWS)
def test_split_batch(batch: Any, rank: int, size: int, want: Any) -> None:
    assert same(split_batch(batch, rank, size), want)


@pytest.mark.parametrize(("batch", "message"), [
    pytest.param(torch.zeros(3, 2), "shape [3, 2] cannot be split evenly over the replica's "
                 "2 ranks: make the microbatch size a multiple of 2", id="uneven"),
    pytest.param(torch.tensor(1.0), "shape [] cannot be split", id="scalar"),
])
def test_split_batch_refuses_what_cannot_be_split_evenly(batch: torch.Tensor,
                                                         message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        split_batch(batch, 0, 2)


def on_two_ranks(body: Callable[[Lockstep], Any]) -> list[Any]:
    """Run `body` on rank 0 and rank 1 of a real two-rank gloo group (threads)."""
    store = dist.HashStore()
    results: list[Any] = [None, None]

    def rank(r: int) -> None:
        options = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
        options._timeout = datetime.timedelta(seconds=20)
        options._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
        group = dist.ProcessGroupGloo(dist.PrefixStore("t/", store), r, 2, options)
        try:
            results[r] = body(Lockstep(ReplicaRanks(r, 2, mesh=None, group=group)))
        except Exception as exc:  # noqa: BLE001 - handed to the test thread
            results[r] = exc

    threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return results


def test_followers_make_rank_0s_moves_in_order() -> None:
    view = pb.WorkerCommand(generation=pb.GenerationView(generation=3, members=[0, 2],
                                                         rendezvous="h:1"))
    moves: list[pb.WorkerCommand | None] = [view, None, pb.WorkerCommand(), None]

    def body(lockstep: Lockstep) -> list[pb.WorkerCommand | None]:
        if lockstep.ranks.leads:
            for move in moves:
                lockstep.lead(move)
            return moves
        return [lockstep.follow() for _ in moves]

    leader, follower = on_two_ranks(body)
    assert follower == moves  # the view round-trips as a typed message; None is "work"


def test_the_replica_reduced_only_if_every_rank_did() -> None:
    def body(lockstep: Lockstep) -> tuple[Any, Any]:
        r = lockstep.ranks.rank
        both = lockstep.agree(True, loss=1.0 + r, tokens=10, overflow=0)
        one_failed = lockstep.agree(r == 0, loss=1.0, tokens=10, overflow=r)
        return both, one_failed

    for both, one_failed in on_two_ranks(body):
        assert (both.reduced, both.loss, both.tokens, both.overflow) == (True, 1.5, 20, 0)
        assert not one_failed.reduced and one_failed.overflow == 1


def test_the_replica_digest_covers_every_rank_in_order() -> None:
    digests = ["a" * 64, "b" * 64]
    results = on_two_ranks(lambda lockstep: lockstep.combine_digest(digests[lockstep.ranks.rank]))
    want = hashlib.sha256(b"".join(hashlib.sha256(d.encode()).digest() for d in digests))
    assert results == [want.hexdigest()] * 2


def test_buffer_updates_are_averaged_over_the_ranks_to_the_same_bits_on_each() -> None:
    """Each rank's BatchNorm statistics are of its slices: the replica's update is their
    mean, identical on every rank (float32 statistics, float64 counters that stay whole)."""
    updates = [[torch.tensor([0.1, -2.0, 3.3]), torch.tensor([2.0])],
               [torch.tensor([0.7, 1.0, -0.3]), torch.tensor([2.0])]]
    results = on_two_ranks(lambda lockstep: lockstep.average(updates[lockstep.ranks.rank]))
    stats, counters = results[0]
    assert torch.equal(stats, (updates[0][0] + updates[1][0]) / 2)
    assert torch.equal(counters, torch.tensor([2.0]))
    assert all(torch.equal(a, b) for a, b in zip(results[0], results[1], strict=True))
    assert torch.equal(updates[0][0], torch.tensor([0.1, -2.0, 3.3]))  # inputs left as they are


def test_a_broken_rank_group_is_a_replica_broken() -> None:
    def body(lockstep: Lockstep) -> None:
        if not lockstep.ranks.leads:
            lockstep.follow()  # rank 0 never leads: it is gone
        # Rank 0 returns at once: its group goes with its thread, as a dead rank's
        # sockets close, and the follower's broadcast fails instead of waiting.

    results = on_two_ranks(body)
    assert results[0] is None and isinstance(results[1], ReplicaBroken)
