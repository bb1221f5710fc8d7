"""The reduction started during the last backward (trainer/overlap.py) and the pieces it
reduces (FastAccumulator's layout): what each member reduces is the same, piece by piece,
as one collective per buffer; a replica lost during a piece's collective or its backward
leaves the survivors where a run without pieces leaves them.

Executors run in one process on the fake group (as in test_executor_fake.py): the fake
sums contributions in rank order, so with or without pieces each element's sum is the same
float operations, and fast mode's results compare bitwise.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from recover.trainer.buffers import reduced_buckets
from recover.trainer.fastreduce import FastAccumulator, Reduced
from recover.trainer.gradients import GradientBuckets
from recover.trainer.groups import GroupSpec
from recover.trainer.groups.fake import FakeRendezvous
from recover.trainer.overlap import PIECE_BYTES, EarlyReduction, piece_bytes
from recover.trainer.sources import FunctionMicrobatches
from recover.trainer.workload import Workload
from tests.unit.test_executor_fake import REPLICAS, STEPS, Run, data, kill, mse, train
from tests.unit.test_executor_stealing import steal

torch.set_num_threads(1)

PIECE = 64
"""Bytes: the test MLP's gradient (4x16 + 16 + 16 + 1 floats) then has two pieces."""


def final(run: Run, replica: int) -> torch.Tensor:
    return torch.cat([p.flatten() for p in run.params(replica)])


@pytest.fixture(scope="module")
def whole() -> Run:
    """Fast mode, each buffer reduced by one collective after the last backward."""
    return train(reduce="fast")


# ------------------------------------------------------------------ the layout


def accumulator(sizes: list[int], piece: int, dtype: torch.dtype = torch.float32
                ) -> FastAccumulator:
    torch.manual_seed(0)
    params = [nn.Parameter(torch.randn(n, dtype=dtype)) for n in sizes]
    grads = GradientBuckets(params)
    for p in params:
        p.grad.copy_(torch.randn(p.shape, dtype=dtype))
    return FastAccumulator(grads, piece_bytes=piece)


def reduce_pairwise(a: FastAccumulator, b: FastAccumulator) -> list[torch.Tensor]:
    """What two members' allreduces leave in `a`'s buffers, collective by collective."""
    mine, theirs = a.buffers(), b.buffers()
    for view, other in zip(a.schedule(mine), b.schedule(theirs), strict=True):
        view.add_(other)
    return mine


@pytest.mark.parametrize(("sizes", "piece", "pieces"), [
    ([64, 16, 16, 1], 64, [(2, 3), (1,)]),      # tail first; the first parameter never
    ([64, 16, 16, 1], 4, [(3,), (2,), (1,)]),   # one parameter each
    ([64, 16, 16, 1], 1 << 20, []),             # smaller than a piece: one collective
    ([100], 4, []),                             # one parameter: it stays with the rest
    ([8, 300], 64, [(1,)]),                     # a parameter larger than a piece is one
])
def test_pieces_are_whole_parameters_from_the_end_never_the_first(
        sizes: list[int], piece: int, pieces: list[tuple[int, ...]]) -> None:
    acc = accumulator(sizes, piece)
    assert [p.params for p in acc.pieces] == pieces
    for p in acc.pieces:
        assert (p.bucket_end - p.bucket_start) * 4 >= piece
    out = acc.buffers()
    views = acc.schedule(out)
    assert len(views) == len(pieces) + len(out)
    # The collectives cover every element of every buffer exactly once.
    covered = [torch.zeros(b.numel(), dtype=torch.int32) for b in out]
    for view in views:
        buffer = next(i for i, b in enumerate(out)
                      if b.data_ptr() <= view.data_ptr() < b.data_ptr() + b.numel() * 4)
        start = (view.data_ptr() - out[buffer].data_ptr()) // 4
        covered[buffer][start:start + view.numel()] += 1
    assert all(bool((c == 1).all()) for c in covered)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_sum_reduced_piece_by_piece_finishes_as_the_whole_one(dtype: torch.dtype) -> None:
    sizes = [64, 16, 16, 1]
    results = []
    for piece in (0, 64):
        a, b = accumulator(sizes, piece, dtype), accumulator(sizes, piece, dtype)
        for acc, loss in ((a, 1.5), (b, 2.5)):
            acc.after_microbatch(loss)
        results.append(a.finish(reduce_pairwise(a, b)))
    assert results[1].loss == results[0].loss == 2.0 and results[1].microbatches == 2
    if dtype == torch.bfloat16:  # statistics in a float64 buffer of their own, reduced last
        assert len(accumulator(sizes, 64, dtype).new_buffers()) == 2
    assert all(torch.equal(x, y) for x, y in zip(results[0].grads, results[1].grads, strict=True))


@pytest.mark.parametrize(("reduce", "after_backward", "own_backward", "ranks", "size", "bytes_"), [
    ("fast", False, False, 1, 0, PIECE_BYTES),
    ("fast", False, False, 1, 4096, 4096),        # --overlap-piece-kb 4
    ("exact", False, False, 1, 0, PIECE_BYTES),    # the last microbatch's integers in pieces
    ("fast", True, False, 1, 0, 0),                # --no-overlap-reduce
    ("fast", False, True, 1, 0, 0),                # the user's forward_backward
    ("fast", False, False, 2, 0, 0),               # FSDP2 writes the shards itself
])
def test_which_jobs_reduce_in_pieces(reduce: str, after_backward: bool, own_backward: bool,
                                     ranks: int, size: int, bytes_: int) -> None:
    assert piece_bytes(reduce, after_backward, own_backward, ranks, size) == bytes_


# ------------------------------------------------------------------ the executor


@pytest.mark.parametrize(("reduce", "piece"), [("fast", PIECE), ("exact", PIECE * 2)])
def test_pieces_started_in_backward_learn_what_one_collective_does(reduce: str,
                                                                   piece: int) -> None:
    """Exact mode too: the hooked microbatch's pieces are quantized as backward completes
    them (`ExactAccumulator.piece_ready`) and reduced meanwhile; integer sums do not depend
    on when a piece goes, so every step is bitwise the run that reduces after backward."""
    whole = train(reduce=reduce)
    run = train(reduce=reduce, piece_bytes=piece)
    assert run.controller.lost == []
    for replica in range(REPLICAS):
        assert torch.equal(final(run, replica), final(whole, 0))
        for step in range(STEPS):
            assert run.controller.digests[step][replica] == whole.controller.digests[step][0]
        early = run.executors[replica].early
        assert early is not None and early.started_in_backward > 0
        assert len(run.executors[replica].accumulator.pieces) == 2


MODES = [("fast", PIECE), ("exact", PIECE * 2)]
"""Each mode with the piece size that makes two pieces of the test MLP (exact: float64)."""


@pytest.mark.parametrize("phase", ["backward", "forward"])
@pytest.mark.parametrize(("reduce", "piece"), MODES)
def test_a_replica_lost_while_the_others_reduce_early_changes_nothing(
        phase: str, reduce: str, piece: int) -> None:
    clean = train(reduce=reduce, faults=(kill(1, 2, phase),))
    run = train(reduce=reduce, faults=(kill(1, 2, phase),), piece_bytes=piece)
    assert run.controller.lost == clean.controller.lost == [2]
    assert run.controller.commits == clean.controller.commits
    for replica in (0, 1):
        assert torch.equal(final(run, replica), final(clean, 0))


@pytest.mark.parametrize(("reduce", "piece"), MODES)
def test_a_replica_lost_inside_a_piece_s_collective_leaves_no_trace(reduce: str,
                                                                     piece: int) -> None:
    # Per step: the two pieces, then the rest. Replica 1 dies in the second collective of
    # step 0, a piece started during its last backward on the reducing thread.
    clean = train(reduce=reduce, faults=(kill(0, 1, "backward"),))
    run = train(reduce=reduce, crash_in_allreduce=(1, 1), piece_bytes=piece)
    assert run.controller.lost == [1]
    assert "died in allreduce 1" in (run.rendezvous.worlds[1].broken or "")
    for replica in (0, 2):
        assert torch.equal(final(run, replica), final(clean, 0))


def test_pieces_under_work_stealing_reduce_as_one_collective_does() -> None:
    # Open plans are never hooked (a member's last microbatch is not known in advance), but
    # every member still issues the pieces, then the rest: a step with a steal sums the same.
    plain, _ = steal(slice(1, None), gate_after=0, reduce="fast")
    pieced, fake = steal(slice(1, None), gate_after=0, reduce="fast", piece_bytes=PIECE)
    assert fake.released == [5]
    for replica in range(REPLICAS):
        assert torch.equal(final(pieced, replica), final(plain, 0))


def test_a_gradient_replaced_before_the_last_backward_is_folded_before_it_is_sent(
        whole: Run) -> None:
    # User code that assigns `.grad` (here: a copy of the last parameter's) makes backward
    # add into a tensor outside the bucket: the hook must fold it into the bucket before
    # the piece is copied (after the microbatch, `repair_views` would be too late).
    def replacing(executors: dict[int, object]) -> None:
        for executor in executors.values():
            workload = executor.workload  # type: ignore[attr-defined]
            last = list(workload.model.parameters())[-1]

            def loss_fn(m: nn.Module, batch: object, last: nn.Parameter = last) -> torch.Tensor:
                last.grad = last.grad.clone()
                return mse(m, batch)

            workload.loss_fn = loss_fn

    run = train(reduce="fast", piece_bytes=PIECE, prepare=replacing)
    for replica in range(REPLICAS):
        assert torch.equal(final(run, replica), final(whole, 0))


def test_a_model_s_buffers_ride_with_the_rest_never_in_a_piece() -> None:
    # BatchNorm: float buffers and an integer counter (carried as float32 digits) reduced
    # with the gradient; the pieces hold gradients only, the statistics stay in the rest.
    def member(piece: int) -> FastAccumulator:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 16), nn.BatchNorm1d(16), nn.Linear(16, 1))
        source = FunctionMicrobatches(data)
        source.bind(4, 0)
        workload = Workload(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                            source=source, seed=0, loss_fn=mse, buffers="reduce")
        grads = GradientBuckets(workload.params)
        acc = FastAccumulator(reduced_buckets(grads, workload.model_buffers), piece_bytes=piece)
        workload.compute(0, 0)
        acc.after_microbatch(1.0)
        return acc

    assert any(b.integer for b in member(0).grads.buckets)
    pieced = member(PIECE)
    assert pieced.pieces and all(pieced.grads.buckets[p.bucket].params for p in pieced.pieces)
    results = [m.finish(reduce_pairwise(m, member(piece))) for piece in (0, PIECE)
               for m in [member(piece)]]
    assert results[0].microbatches == results[1].microbatches == 2
    assert all(torch.equal(x, y) for x, y in zip(results[0].grads, results[1].grads, strict=True))


DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _alone(device: str, reduce: str, piece: int, scale: float = 1.0) -> Reduced:
    """A member alone reduces two microbatches of a 6-layer MLP, the last one hooked (when
    `piece`); `scale` multiplies the last microbatch's gradient of the last layer's weight,
    which lies in a piece (a huge one overflows there only)."""
    from recover.trainer.reduction import make_accumulator

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(512, 512) for _ in range(6)]).to(device)
    grads = GradientBuckets(list(model.parameters()))
    acc = make_accumulator(reduce, grads, 2, piece_bytes=piece)
    early = EarlyReduction(acc)
    group = FakeRendezvous()(GroupSpec(generation=1, rank=0, world_size=1, store_host="",
                                       store_port=0))
    group.connect()
    x = torch.randn(2048, 512, device=device)
    for microbatch in range(2):
        acc.before_microbatch()
        last = microbatch == 1
        if last and piece:
            early.hook(group, step=0, done=2)
        handle = model[-1].weight.register_hook(lambda g: g * scale) if last else None
        model(x).tanh().square().mean().backward()
        if handle is not None:
            handle.remove()
        acc.after_microbatch(1.0)
    early.unhook()
    hooked = early.take(group, 0, 2)
    if piece:
        assert hooked is not None and 0 < early.started_in_backward <= len(acc.pieces)
        reduced = acc.finish(early.finish(hooked))
    else:
        reduced = acc.finish([b.clone() for b in acc.buffers()])
    early.close()
    return reduced


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("reduce", "piece"), [("fast", 1 << 20), ("exact", 2 << 20)])
def test_each_piece_is_copied_once_its_backward_is_done(device: str, reduce: str,
                                                        piece: int) -> None:
    # A member alone: its reduction is its own sum, so the result shows whether every piece
    # was copied after the backward had written it. On a GPU the host queues backward's
    # kernels far ahead of them: the copy must wait for the piece's own (an event), not
    # for the hook; in exact mode the piece is quantized on backward's stream first.
    # scripts/gpu_check.sh runs the CUDA cases.
    reduced = _alone(device, reduce, piece)
    assert reduced.microbatches == 2 and reduced.overflow == 0
    after = _alone(device, reduce, 0)  # the same microbatches reduced after the backward
    assert all(torch.equal(a, b) for a, b in zip(reduced.grads, after.grads, strict=True))


@pytest.mark.parametrize("device", DEVICES)
def test_an_exact_piece_that_does_not_fit_is_an_overflow_read_after_the_microbatch(
        device: str) -> None:
    # The fit of each piece is read once the microbatch is over (a read per piece would
    # stall a GPU's backward thread): a piece too large for its scale counts though the
    # rest fits, and the step is redone as without pieces.
    for scale in (2.0 ** 60, math.inf):
        pieced, whole = _alone(device, "exact", 2 << 20, scale), _alone(device, "exact", 0, scale)
        assert pieced.overflow == whole.overflow == 1
        assert pieced.microbatches == whole.microbatches == 2


# ------------------------------------------------------------------ exact mode


def test_exact_pieces_layout_and_where_there_are_none() -> None:
    """Float64 integers: pieces of at least `piece_bytes` from the largest bucket's end,
    whole parameters, never its first; the rest is reduced as the two ranges around them.
    None without a size, nor with loss scaling (its rule needs the whole microbatch)."""
    from recover.trainer.reduction import ExactAccumulator

    params = [nn.Parameter(torch.randn(n)) for n in (64, 16, 16, 1)]
    grads = GradientBuckets(params)
    acc = ExactAccumulator(grads, 4, piece_bytes=128)  # 16 float64 values
    assert [p.params for p in acc.pieces] == [(2, 3), (1,)]
    buffers = acc.new_buffers()
    views = acc.schedule(buffers)
    assert [v.numel() for v in views] == [17, 16, 64, 4]  # pieces, head, statistics
    assert sum(v.numel() for v in views) == buffers[0].numel()
    assert ExactAccumulator(grads, 4, piece_bytes=0).pieces == []
    assert ExactAccumulator(grads, 4, loss_scaled_buckets=1, piece_bytes=128).pieces == []
