"""The cross-replica group interface (trainer/groups/): the spec, the factory, host staging
of device buffers for gloo, the NCCL slot on a CPU-only torch, and the in-process fake's
sums and injected failures. Multi-process gloo behaviour is tests/integration/test_collectives.py."""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch

from recover.trainer.groups import (
    CollectiveAborted,
    CrossReplicaGroup,
    GroupSpec,
    build_group,
    group_factory,
)
from recover.trainer.groups import nccl as nccl_module
from recover.trainer.groups.fake import FakeGroup, FakeRendezvous, FakeWorld, MemberKilled
from recover.trainer.groups.gloo import GenerationGroup, RendezvousServer
from recover.trainer.groups.nccl import NcclGroup, nccl_available
from recover.trainer.groups.staging import (
    MAX_CACHED,
    HostStaging,
    blocking,
    needs_staging,
    staged_reduce,
)
from tests.unit.background import in_background

torch.set_num_threads(1)
JOIN_S = 30.0  # safety net only


def in_threads(world: FakeWorld, ranks: list[int], action: Callable[[FakeGroup], Any]
               ) -> tuple[dict[int, Any], list[threading.Thread]]:
    """Run `action(group)` for each rank on a thread of its own; results or exceptions."""
    results: dict[int, Any] = {}

    def body(rank: int) -> None:
        try:
            results[rank] = action(world.group(rank))
        except BaseException as exc:  # noqa: BLE001 - the test looks at it
            results[rank] = exc

    threads = [threading.Thread(target=body, args=(r,), daemon=True) for r in ranks]
    for thread in threads:
        thread.start()
    return results, threads


def join(threads: list[threading.Thread]) -> None:
    for thread in threads:
        thread.join(JOIN_S)
        assert not thread.is_alive()


# ---------------------------------------------------------------- spec and factory

def test_the_store_prefix_keeps_shard_zero_as_it_was_and_separates_shards() -> None:
    spec = GroupSpec(4, 0, 2, "h", 1)
    assert spec.store_prefix == "gen/4/"
    assert GroupSpec(4, 0, 2, "h", 1, secret="s3").store_prefix == "gen/4/s3/"
    assert GroupSpec(4, 0, 2, "h", 1, secret="s3", shard=2).store_prefix == "gen/4/s3/shard/2/"
    assert spec.shard == 0


def test_the_factory_picks_the_backend_and_every_group_fits_the_interface() -> None:
    spec = GroupSpec(1, 0, 1, "127.0.0.1", 1)
    group = build_group(spec)
    assert isinstance(group, GenerationGroup) and isinstance(group, CrossReplicaGroup)
    group.close()
    assert isinstance(FakeWorld(1).group(0), CrossReplicaGroup)
    with pytest.raises(ValueError, match="unknown group backend 'mpi'"):
        build_group(spec, "mpi")


@pytest.mark.skipif(nccl_available(), reason="checks the CPU-only build's error")
def test_the_nccl_group_says_why_it_cannot_be_built_without_cuda() -> None:
    with pytest.raises(RuntimeError, match="needs a CUDA build of torch with NCCL"):
        build_group(GroupSpec(1, 0, 1, "127.0.0.1", 1), "nccl")
    assert {"connect", "allreduce_sum_", "abort", "close", "aborted"} <= set(dir(NcclGroup))


# ---------------------------------------------------------------- host staging

def test_a_staged_reduce_goes_through_one_cached_host_copy_each_way() -> None:
    staging = HostStaging()
    seen: list[torch.Tensor] = []

    def reduce_host(host: torch.Tensor) -> None:
        seen.append(host)
        host.mul_(3)

    buffer = torch.arange(6, dtype=torch.float64)
    staged_reduce(buffer, blocking(reduce_host), staging, force=True)
    assert seen[0].data_ptr() != buffer.data_ptr()  # reduced elsewhere, copied back
    assert torch.equal(buffer, torch.arange(6, dtype=torch.float64) * 3)
    staged_reduce(buffer, blocking(reduce_host), staging, force=True)
    assert seen[1].data_ptr() == seen[0].data_ptr() and len(staging) == 1  # the same one
    staged_reduce(buffer.float(), blocking(reduce_host), staging, force=True)
    assert seen[2].data_ptr() != seen[0].data_ptr() and len(staging) == 2  # another dtype, another tensor


def test_a_failed_staged_reduce_leaves_the_buffer_alone_and_drops_its_staging() -> None:
    staging = HostStaging()

    def fail(host: torch.Tensor) -> None:
        host.fill_(99)
        raise CollectiveAborted("peer lost")

    buffer = torch.ones(4)
    with pytest.raises(CollectiveAborted):
        staged_reduce(buffer, blocking(fail), staging, force=True)
    assert torch.equal(buffer, torch.ones(4)) and len(staging) == 0


class PiecewiseReduction:
    """A reduction whose pieces finish only when waited for, recording what happened when."""

    def __init__(self, fail_at: int | None = None) -> None:
        self.events: list[tuple[str, int]] = []
        self.fail_at = fail_at
        self.pieces: list[torch.Tensor] = []

    def start(self, host: torch.Tensor):  # type: ignore[no-untyped-def]
        index = len(self.pieces)
        self.pieces.append(host)
        self.events.append(("start", index))

        def wait() -> None:
            self.events.append(("wait", index))
            if index == self.fail_at:
                host.fill_(-1)
                raise CollectiveAborted("peer lost")
            host.mul_(10)  # "the sum over the members"
        return wait


def test_a_staged_reduce_starts_every_piece_before_waiting_and_copies_each_back() -> None:
    reduction = PiecewiseReduction()
    staging = HostStaging(piece_bytes=16)  # 4 floats a piece
    buffer = torch.arange(18, dtype=torch.float32)
    staging.reduce(buffer, reduction.start)
    assert [len(p) for p in reduction.pieces] == [4, 4, 4, 4, 2]
    # Pipelined: every piece is in flight before the first is waited for, and each is
    # waited for once, in the order started.
    assert reduction.events == [("start", i) for i in range(5)] + [("wait", i) for i in range(5)]
    assert torch.equal(buffer, torch.arange(18, dtype=torch.float32) * 10)
    assert len(staging) == 1
    # A buffer of fewer than MIN_PIECES pieces goes whole (one collective).
    small = PiecewiseReduction()
    staging.reduce(torch.ones(12), small.start)
    assert [len(p) for p in small.pieces] == [12]


def test_a_piece_that_fails_leaves_the_later_pieces_alone_and_every_piece_is_waited_for() -> None:
    reduction = PiecewiseReduction(fail_at=1)
    staging = HostStaging(piece_bytes=16)
    buffer = torch.arange(18, dtype=torch.float32)
    with pytest.raises(CollectiveAborted, match="peer lost"):
        staging.reduce(buffer, reduction.start)
    # The piece reduced before the failure is back; the failed one and the later ones are
    # as they were (the caller reduces a copy anyway); the later pieces' reductions are
    # still waited for, so nothing is left in flight on the group.
    assert torch.equal(buffer[:4], torch.arange(4, dtype=torch.float32) * 10)
    assert torch.equal(buffer[4:], torch.arange(4, 18, dtype=torch.float32))
    assert reduction.events[5:] == [("wait", i) for i in range(5)]
    assert len(staging) == 0  # the staging tensor the failed reduction wrote is dropped


def test_buffers_of_one_shape_in_flight_together_each_have_a_host_copy_kept_for_next_time() -> None:
    # overlap.py starts several pieces before waiting for the first; pieces of one size
    # must not share a staging tensor, and each is cached for the next step's.
    reduction = PiecewiseReduction()
    staging = HostStaging()
    buffers = [torch.full((6,), float(i)) for i in range(3)]
    waits = [staging.start(b, reduction.start) for b in buffers]
    assert len({p.data_ptr() for p in reduction.pieces}) == 3
    for wait in waits:
        wait()
    assert [float(b[0]) for b in buffers] == [0.0, 10.0, 20.0]
    assert len(staging) == 3
    again = PiecewiseReduction()
    waits = [staging.start(b, again.start) for b in buffers]
    for wait in waits:
        wait()
    assert {p.data_ptr() for p in again.pieces} == {p.data_ptr() for p in reduction.pieces}


def test_host_buffers_are_reduced_in_place_and_the_cache_is_bounded() -> None:
    buffer = torch.ones(3)
    staged_reduce(buffer, blocking(lambda host: host.add_(1)))
    assert not needs_staging(buffer) and torch.equal(buffer, torch.full((3,), 2.0))
    assert needs_staging(torch.empty(2, device="meta"))
    staging = HostStaging()
    for n in range(MAX_CACHED + 3):
        staged_reduce(torch.zeros(n + 1), blocking(lambda host: None), staging, force=True)
    assert len(staging) == MAX_CACHED


def one_member_gloo(buffer: torch.Tensor, force_staging: bool) -> HostStaging:
    """A real gloo group of one member (a sum over one is the identity) reducing `buffer`."""
    server = RendezvousServer()
    staging = HostStaging()
    group = GenerationGroup(GroupSpec(1, 0, 1, "127.0.0.1", server.port, timeout_s=10),
                            staging=staging, force_staging=force_staging)
    try:
        group.connect()
        group.allreduce_sum_(buffer)
    finally:
        group.close()
        server.close()
    return staging


def test_the_gloo_group_stages_through_host_memory_when_told_to() -> None:
    buffer = torch.linspace(-1, 1, 1000)
    expected = buffer.clone()
    staging = one_member_gloo(buffer, force_staging=True)
    assert torch.equal(buffer, expected) and len(staging) == 1
    with pytest.raises(ValueError, match="contiguous"):
        GenerationGroup(GroupSpec(1, 0, 1, "127.0.0.1", 1)).allreduce_sum_(torch.ones(4, 2).t())


@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="no CUDA device: the staging of a GPU buffer cannot run here")
def test_the_gloo_group_reduces_a_cuda_buffer_through_pinned_memory() -> None:
    buffer = torch.linspace(-1, 1, 13_000_000, device="cuda")  # 52 MB: five pieces
    expected = buffer.clone()
    staging = one_member_gloo(buffer, force_staging=False)
    assert torch.equal(buffer, expected) and len(staging) == 1
    ((_, _, pinned),) = staging._cache.keys()
    ((host,),) = staging._cache.values()
    assert pinned and host.is_pinned()


needs_nccl = pytest.mark.skipif(not nccl_available(),
                                reason="no CUDA device with NCCL: the NCCL group cannot run here")


@needs_nccl
def test_the_nccl_group_reduces_a_cuda_buffer_and_refuses_a_host_one() -> None:
    server = RendezvousServer()
    group = NcclGroup(GroupSpec(1, 0, 1, "127.0.0.1", server.port, timeout_s=30))
    try:
        group.connect()
        buffer = torch.linspace(-1, 1, 1 << 16, device="cuda")
        expected = buffer.clone()
        group.allreduce_sum_(buffer)  # a sum over one member is the identity
        assert torch.equal(buffer, expected) and not group.aborted
        with pytest.raises(ValueError, match="reduces CUDA tensors"):
            group.allreduce_sum_(torch.ones(4))
    finally:
        group.close()
        server.close()
    with pytest.raises(CollectiveAborted):
        group.allreduce_sum_(buffer)


@needs_nccl
def test_abort_frees_a_member_whose_peer_never_comes_within_a_second() -> None:
    # The peer of a two-member generation never connects (it died before the rendezvous):
    # whether NCCL holds the member in its init or in the first allreduce, abort() from
    # another thread (the controller's new generation) must end the wait at once, not at
    # the group's 60 s timeout.
    server = RendezvousServer()
    group = NcclGroup(GroupSpec(2, 0, 2, "127.0.0.1", server.port, timeout_s=60))

    def member() -> None:
        group.connect()
        group.allreduce_sum_(torch.ones(1024, device="cuda"))

    thread, outcome = in_background(member)
    thread.join(2.0)
    assert thread.is_alive() and not outcome  # still waiting for the peer
    started = time.monotonic()
    group.abort()
    thread.join(10.0)
    took = time.monotonic() - started
    print(f"NCCL abort ended the wait in {took * 1000:.0f} ms")
    group.close()
    server.close()
    assert not thread.is_alive() and isinstance(outcome[0], CollectiveAborted)
    assert took < 1.0, f"abort took {took:.2f} s"


# ---------------------------------------------------------------- the fake

def test_the_fake_sums_across_its_members_every_round() -> None:
    world = FakeWorld(3)

    def two_rounds(group: FakeGroup) -> list[float]:
        group.connect()
        out = []
        for round_ in range(2):
            buffer = torch.full((5,), float(group.spec.rank + 1 + 10 * round_))
            group.allreduce_sum_(buffer)
            out.append(float(buffer[0]))
        return out

    results, threads = in_threads(world, [0, 1, 2], two_rounds)
    join(threads)
    assert results == {0: [6.0, 36.0], 1: [6.0, 36.0], 2: [6.0, 36.0]}
    assert world.completed == 2 and world.broken is None


def connected(world: FakeWorld) -> list[FakeGroup]:
    results, threads = in_threads(world, list(range(world.world_size)), lambda g: g.connect())
    join(threads)
    assert all(v is None for v in results.values()), results
    return [world.group(r) for r in range(world.world_size)]


def test_a_killed_member_fails_the_others_pending_and_later_collectives() -> None:
    world = FakeWorld(3)
    connected(world)
    buffers = {r: torch.full((4,), float(r + 1)) for r in (0, 1)}
    results, threads = in_threads(world, [0, 1], lambda g: g.allreduce_sum_(buffers[g.spec.rank]))
    assert world.wait_inside(0, 2, JOIN_S)
    world.kill(2)
    join(threads)
    assert all(isinstance(v, CollectiveAborted) for v in results.values())
    # Partially reduced, as gloo leaves an interrupted in-place allreduce: 1 + 2 each.
    assert torch.equal(buffers[0], torch.full((4,), 3.0))
    with pytest.raises(CollectiveAborted, match="member 2 of generation 1 died"):
        world.group(0).allreduce_sum_(torch.ones(1))
    assert world.group(1).aborted


def test_abort_fails_a_blocked_collective_and_is_idempotent() -> None:
    world = FakeWorld(2)
    groups = connected(world)
    results, threads = in_threads(world, [0], lambda g: g.allreduce_sum_(torch.ones(2)))
    assert world.wait_inside(0, 1, JOIN_S)
    stoppers = [threading.Thread(target=groups[0].abort) for _ in range(3)]
    for stopper in stoppers:
        stopper.start()
    join(stoppers + threads)
    assert isinstance(results[0], CollectiveAborted) and groups[0].aborted
    with pytest.raises(CollectiveAborted):  # and the peer's next one fails too
        groups[1].allreduce_sum_(torch.ones(2))
    groups[0].close()
    groups[0].abort()


def test_an_injected_connect_failure_fails_every_member() -> None:
    world = FakeWorld(2)
    world.fail_connect(1)
    results, threads = in_threads(world, [0, 1], lambda g: g.connect())
    join(threads)
    assert all(isinstance(v, CollectiveAborted) for v in results.values()), results
    assert "rank 1's connect failed" in str(results[1])


def test_a_member_that_dies_inside_an_allreduce_leaves_partial_sums_behind() -> None:
    world = FakeWorld(3)
    connected(world)
    world.crash_during_allreduce(2, call=1)
    buffers = {r: torch.full((2,), float(r + 1)) for r in range(3)}

    def two_rounds(group: FakeGroup) -> None:
        for _ in range(2):
            group.allreduce_sum_(buffers[group.spec.rank])

    results, threads = in_threads(world, [0, 1, 2], two_rounds)
    join(threads)
    assert isinstance(results[2], MemberKilled)
    assert isinstance(results[0], CollectiveAborted) and isinstance(results[1], CollectiveAborted)
    # Round 0 summed to 6 everywhere; round 1 failed once everyone was in: 6 + 6 + 6.
    assert torch.equal(buffers[0], torch.full((2,), 18.0))
    assert world.completed == 1


def test_the_fake_rendezvous_gives_each_generation_one_world() -> None:
    rendezvous = FakeRendezvous()
    a = rendezvous(GroupSpec(3, 0, 2, "fake", 0))
    b = rendezvous(GroupSpec(3, 1, 2, "fake", 0))
    assert a.world is b.world and a.spec.rank == 0 and b.spec.rank == 1
    assert rendezvous(GroupSpec(3, 0, 2, "fake", 0)) is a
    with pytest.raises(ValueError, match="generation 3 has 2 members, not 3"):
        rendezvous(GroupSpec(3, 0, 3, "fake", 0))


# ---------------------------------------------------------------- the job's backend


@pytest.mark.parametrize(("backend", "devices", "nccl", "outcome"), [
    ("", ["cpu"], False, "gloo"),
    ("gloo", ["cuda:0"], True, "gloo"),                    # GPU buffers staged through the host
    ("nccl", ["cuda:0", "cuda:0"], True, "nccl"),
    ("nccl", ["cuda:0"], False, "needs a CUDA build of torch with NCCL"),
    ("nccl", ["cuda:0", "cpu"], True, "gradients or buffers are on cpu"),
    ("mpi", ["cpu"], False, "unknown group backend 'mpi'"),
])
def test_the_job_s_group_backend_is_checked_against_where_its_buffers_live(
        monkeypatch: pytest.MonkeyPatch, backend: str, devices: list[str], nccl: bool,
        outcome: str) -> None:
    monkeypatch.setattr(nccl_module, "nccl_available", lambda: nccl)
    if outcome in ("gloo", "nccl"):
        factory = group_factory(backend, [torch.device(d) for d in devices])
        if outcome == "gloo":
            assert factory is build_group
        else:
            assert isinstance(factory, functools.partial) and factory.keywords == {"backend": "nccl"}
        return
    with pytest.raises(ValueError, match=outcome):
        group_factory(backend, [torch.device(d) for d in devices])
