"""Gradient accumulation (trainer/reduction.py, trainer/gradients.py): `.grad` views into
per-dtype buckets, fast and exact reduction.

No processes: an allreduce SUM is emulated by summing the accumulators' `buffers()`,
and a microbatch's backward by adding its gradient into the bucket's flat buffer.
Most tests use one float32 bucket; the mixed-dtype tests at the end use several.
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from recover.trainer.gradients import GradientBuckets as FlatGradients
from recover.trainer.reduction import (
    ExactAccumulator,
    FastAccumulator,
    make_accumulator,
)

torch.set_num_threads(1)


M = 12
SIZES = (7, 5, 64, 3, 33)
SHAPES = ((7,), (5,), (8, 8), (3,), (3, 11))


def make_params() -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(1)
    return [torch.nn.Parameter(torch.randn(shape, generator=gen)) for shape in SHAPES]


def make_microbatch_grads(magnitudes: tuple[float, ...], seed: int = 0) -> list[torch.Tensor]:
    """M deterministic flat float32 gradients, tensor i of magnitude ~magnitudes[i]."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(M):
        parts = []
        for n, mag in zip(SIZES, magnitudes, strict=True):
            # Spread over ~2 decades within a tensor, random signs.
            spread = torch.exp(torch.empty(n, dtype=torch.float64).uniform_(-2.3, 2.3, generator=gen))
            parts.append(torch.randn(n, generator=gen, dtype=torch.float64).sign() * spread * mag)
        out.append(torch.cat(parts).float())
    return out


LOSSES = [2.0 + 0.37 * i + 1e-7 * i * i for i in range(M)]

MIXES = [
    pytest.param((1e-6, 1e-3, 1.0, 1e2, 3e-2), id="mixed-1e-6..1e2"),
    pytest.param((1.0, 1.0, 1.0, 1.0, 1.0), id="all-order-1"),
    pytest.param((1e2, 1e-6, 5e1, 1e-4, 2e0), id="mixed-shuffled"),
]


def run_partition(kind: str, partition: list[list[int]], grads_per_mb, observed=None,
                  scale_epoch: int = 0):
    """Each inner list is one replica's microbatches in its compute order; returns Reduced."""
    buffers = []
    accumulator = None
    for replica_ids in partition:
        params = make_params()
        flat = FlatGradients(params)
        accumulator = make_accumulator(kind, flat, M)
        if observed is not None:
            accumulator.observe_committed([observed])
        accumulator.reset(scale_epoch=scale_epoch)
        for mb in replica_ids:
            accumulator.before_microbatch()
            flat.buckets[0].flat.add_(grads_per_mb[mb])  # what backward does: accumulate into .grad
            accumulator.after_microbatch(LOSSES[mb])
        buffers.append(accumulator.buffers())
    return accumulator.finish(allreduce(buffers))


def allreduce(buffers: list[list[torch.Tensor]]) -> list[torch.Tensor]:
    """What a SUM allreduce leaves on every replica, summed in replica order."""
    total = [b.clone() for b in buffers[0]]
    for replica in buffers[1:]:
        for t, b in zip(total, replica, strict=True):
            t += b
    return total


def contiguous(r: int) -> list[list[int]]:
    base, extra = divmod(M, r)
    out, start = [], 0
    for i in range(r):
        n = base + (1 if i < extra else 0)
        out.append(list(range(start, start + n)))
        start += n
    return out


def partitions() -> list[list[list[int]]]:
    parts = [contiguous(r) for r in (1, 2, 3, 4, 5)]
    parts.append([list(range(M - 1, -1, -1))])  # one replica, reversed order
    parts.append([[i for i in range(M) if i % 3 == k] for k in range(3)])  # strided
    for seed in range(6):
        rng = random.Random(seed)
        ids = list(range(M))
        rng.shuffle(ids)
        r = rng.randint(1, 6)
        cuts = sorted(rng.sample(range(1, M), r - 1))
        parts.append([ids[a:b] for a, b in zip([0, *cuts], [*cuts, M], strict=True)])
    parts.append([[], list(range(M))])  # an idle replica contributes zeros
    return parts


# ---------------------------------------------------------------- FlatGradients

def test_grads_are_views_into_flat():
    params = make_params()
    flat = FlatGradients(params)
    assert flat.buckets[0].flat.numel() == sum(SIZES)
    for p in params:
        assert p.grad is not None and p.grad.shape == p.shape
        assert p.grad.untyped_storage().data_ptr() == flat.buckets[0].flat.untyped_storage().data_ptr()
    flat.buckets[0].flat.copy_(torch.arange(sum(SIZES), dtype=torch.float32))
    offset = 0
    for p, n in zip(params, SIZES, strict=True):
        assert torch.equal(p.grad.reshape(-1), torch.arange(offset, offset + n, dtype=torch.float32))
        offset += n
    flat.zero()
    assert all(float(p.grad.abs().sum()) == 0.0 for p in params)
    flat.load([torch.full((sum(SIZES),), 3.0)])
    assert all(bool((p.grad == 3.0).all()) for p in params)


def test_backward_accumulates_in_place_into_the_views():
    params = make_params()
    flat = FlatGradients(params)
    views = [p.grad for p in params]

    def loss_fn(scale: float) -> torch.Tensor:
        return sum(scale * (i + 1) * p.sum() for i, p in enumerate(params))

    loss_fn(1.0).backward()
    loss_fn(2.0).backward()
    for i, (p, view) in enumerate(zip(params, views, strict=True)):
        assert p.grad is view, "autograd replaced .grad instead of accumulating in place"
        assert p.grad.data_ptr() == view.data_ptr()
        assert bool((p.grad == 3.0 * (i + 1)).all())
    expected = torch.cat([torch.full((n,), 3.0 * (i + 1)) for i, n in enumerate(SIZES)])
    assert torch.equal(flat.buckets[0].flat, expected)
    flat.zero()
    loss_fn(0.5).backward()
    assert torch.equal(flat.buckets[0].flat, expected / 6)


# ---------------------------------------------------------------- partition independence

@pytest.mark.parametrize("magnitudes", MIXES)
def test_exact_is_bitwise_identical_across_partitions(magnitudes):
    grads = make_microbatch_grads(magnitudes)
    reference = run_partition("exact", [list(range(M))], grads)
    assert reference.overflow == 0 and reference.microbatches == M
    ref_bytes = reference.grads[0].numpy().tobytes()
    for partition in partitions():
        got = run_partition("exact", partition, grads)
        assert got.overflow == 0 and got.microbatches == M
        assert torch.equal(got.grads[0], reference.grads[0]), partition
        assert got.grads[0].numpy().tobytes() == ref_bytes, partition
        assert got.loss == reference.loss, partition


def test_exact_is_bitwise_identical_across_partitions_after_observe_committed():
    grads = make_microbatch_grads((1e-6, 1e-3, 1.0, 1e2, 3e-2), seed=5)
    observed = torch.stack(grads).double().mean(0).float()
    reference = run_partition("exact", [list(range(M))], grads, observed=observed)
    assert reference.overflow == 0
    for partition in partitions():
        got = run_partition("exact", partition, grads, observed=observed)
        assert got.grads[0].numpy().tobytes() == reference.grads[0].numpy().tobytes(), partition
        assert got.loss == reference.loss


def test_fast_is_not_bitwise_identical_across_partitions():
    """Control: the same check tells float32 accumulation apart (so the test above can fail)."""
    grads = make_microbatch_grads((1e-6, 1e-3, 1.0, 1e2, 3e-2))
    reference = run_partition("fast", [list(range(M))], grads)
    differing = [p for p in partitions()
                 if not torch.equal(run_partition("fast", p, grads).grads[0], reference.grads[0])]
    assert differing, "float32 sums happened to agree for every partition: pick other data"


# ---------------------------------------------------------------- accuracy

def errors(grads_per_mb, observed=None, lo: int = 0, hi: int | None = None) -> tuple[float, float]:
    """Max abs error vs a float64 reference over flat[lo:hi]: (exact, float32 accumulation)."""
    ref = torch.stack(grads_per_mb).double().sum(0) / M
    fp32 = torch.zeros_like(grads_per_mb[0])
    for g in grads_per_mb:
        fp32 += g
    fp32 = fp32 / M
    exact = run_partition("exact", contiguous(3), grads_per_mb, observed=observed)
    assert exact.overflow == 0
    exact_err = float((exact.grads[0].double() - ref)[lo:hi].abs().max())
    fp32_err = float((fp32.double() - ref)[lo:hi].abs().max())
    return exact_err, fp32_err


@pytest.mark.parametrize("magnitudes", MIXES)
def test_exact_is_at_least_as_accurate_as_float32(magnitudes):
    grads = make_microbatch_grads(magnitudes, seed=3)
    exact_err, fp32_err = errors(grads)
    assert exact_err <= fp32_err, f"exact max abs error {exact_err:.3e} > float32 {fp32_err:.3e}"
    # With scales predicted from a committed mean: overall and per tensor too. (With the
    # first step's default scale, a tensor of ~1e-6 is quantized at 2**-35 and is less
    # accurate than float32 on its own; only the overall max is compared there.)
    observed = torch.stack(grads).double().mean(0).float()
    exact_err, fp32_err = errors(grads, observed)
    assert exact_err <= fp32_err, f"exact max abs error {exact_err:.3e} > float32 {fp32_err:.3e}"
    offset = 0
    for i, n in enumerate(SIZES):
        exact_err, fp32_err = errors(grads, observed, offset, offset + n)
        assert exact_err <= fp32_err, (f"tensor {i}: exact max abs error {exact_err:.3e} > "
                                       f"float32 {fp32_err:.3e}")
        offset += n


def test_exact_loss_is_the_mean_loss():
    grads = make_microbatch_grads((1.0,) * 5)
    got = run_partition("exact", contiguous(4), grads)
    assert got.loss == pytest.approx(sum(LOSSES) / M, abs=2.0 ** -30)


# ---------------------------------------------------------------- overflow and scale epochs

def one_replica(acc: ExactAccumulator, flat: FlatGradients, gradient: torch.Tensor, times: int = 1):
    for _ in range(times):
        acc.before_microbatch()
        flat.buckets[0].flat.add_(gradient)
        acc.after_microbatch(1.0)


def test_overflow_then_scale_epoch_fits_and_stays_exact():
    params = make_params()
    flat = FlatGradients(params)
    acc = ExactAccumulator(flat, M)
    acc.observe_committed([torch.full((sum(SIZES),), 1e-6)])
    acc.reset(scale_epoch=0)
    big = torch.full((sum(SIZES),), 1e3)
    big[::2] = -777.125
    # Two replicas of 6 microbatches each: one overflowing microbatch anywhere counts.
    first = FlatGradients(make_params())
    first_acc = ExactAccumulator(first, M)
    first_acc.observe_committed([torch.full((sum(SIZES),), 1e-6)])
    one_replica(first_acc, first, torch.full((sum(SIZES),), 1e-6), times=6)
    one_replica(acc, flat, torch.full((sum(SIZES),), 1e-6), times=5)
    one_replica(acc, flat, big)
    result = acc.finish(allreduce([first_acc.buffers(), acc.buffers()]))
    assert result.overflow == 1
    assert result.microbatches == M

    for epoch in range(1, 6):
        acc.reset(scale_epoch=epoch)
        one_replica(acc, flat, big, times=M)
        result = acc.finish(acc.buffers())
        if result.overflow == 0:
            break
    else:
        pytest.fail("no scale epoch made a 1e3 gradient fit")
    assert epoch >= 1
    step = 1.0 / float(acc._parts[0].scale.max())  # quantization step at this epoch
    expected = big.double()
    worst = float((result.grads[0].double() - expected).abs().max())
    fp32_half_ulp = 2.0 ** (math.floor(math.log2(1e3)) - 24)  # the mean is returned as float32
    assert worst <= step + fp32_half_ulp, (worst, step)


def test_reset_with_same_epoch_keeps_the_scale_and_other_epochs_lower_it():
    flat = FlatGradients(make_params())
    acc = ExactAccumulator(flat, M)
    acc.reset(scale_epoch=0)
    base = acc._parts[0].scale.clone()
    acc.reset(scale_epoch=2)
    two = acc._parts[0].scale.clone()
    assert torch.equal(two, base * 2.0 ** -32)
    acc.reset(scale_epoch=2)
    assert torch.equal(acc._parts[0].scale, two)
    acc.reset(scale_epoch=0)
    assert torch.equal(acc._parts[0].scale, base)
    # observe_committed starts a fresh epoch 0.
    acc.reset(scale_epoch=3)
    acc.observe_committed([torch.ones(sum(SIZES))])
    assert acc.scale_epoch == 0
    assert torch.equal(acc._parts[0].scale, base)


def test_nan_or_inf_gradient_counts_as_overflow():
    flat = FlatGradients(make_params())
    acc = ExactAccumulator(flat, M)
    for bad in (math.nan, math.inf, -math.inf):
        acc.reset()
        g = torch.zeros(sum(SIZES))
        g[3] = bad
        one_replica(acc, flat, g)
        assert acc.finish(acc.buffers()).overflow == 1, bad
    # NaN in only the max (or only the min) bound must not slip through either.
    for g in (torch.tensor([1.0, math.nan]), torch.tensor([math.nan, -1.0])):
        acc.reset()
        full = torch.zeros(sum(SIZES))
        full[:2] = g
        one_replica(acc, flat, full)
        assert acc.finish(acc.buffers()).overflow == 1, g


def test_high_scale_epochs_clamp_instead_of_flushing_to_zero():
    flat = FlatGradients(make_params())
    acc = ExactAccumulator(flat, M)
    acc.reset(scale_epoch=40)  # 2**-640 would be 0.0 in float32
    assert bool((acc._parts[0].scale > 0).all())
    assert float(acc._parts[0].scale.min()) == 2.0 ** -126


def test_observe_committed_keeps_the_previous_scale_for_non_finite_tensors():
    flat = FlatGradients(make_params())
    acc = ExactAccumulator(flat, M)
    acc.observe_committed([torch.full((sum(SIZES),), 1e-3)])
    before = acc._parts[0].scale.clone()
    mean = torch.full((sum(SIZES),), 1e-3)
    mean[0] = math.nan
    mean[SIZES[0] + 1] = math.inf
    acc.observe_committed([mean])  # must not raise
    assert torch.equal(acc._parts[0].scale, before)


def test_observe_committed_predicts_per_tensor_exponents():
    flat = FlatGradients(make_params())
    acc = ExactAccumulator(flat, M)
    mean = torch.cat([torch.full((n,), 1e-3 * (1000.0 if i == 2 else 1.0))
                      for i, n in enumerate(SIZES)])
    acc.observe_committed([mean])
    offsets = [sum(SIZES[:i]) for i in range(len(SIZES))]
    scales = [float(acc._parts[0].scale[o]) for o in offsets]
    for o, n, s in zip(offsets, SIZES, scales, strict=True):
        assert bool((acc._parts[0].scale[o:o + n] == s).all())  # one scale per tensor
        assert math.log2(s) == int(math.log2(s))  # a power of two
    small, large = scales[0], scales[2]
    assert all(s == small for i, s in enumerate(scales) if i != 2)
    assert math.log2(small / large) in (9, 10), scales  # 1000 ~ 2**9.97


def test_halves_round_to_even_and_only_changed_scales_are_refilled():
    flat = FlatGradients(make_params())
    acc = ExactAccumulator(flat, M)
    acc.observe_committed([torch.full((sum(SIZES),), 1e-3)])
    exponents = list(acc._parts[0].filled)
    # A new mean changes one tensor's exponent: the scale is what a full refill gives.
    mean = torch.full((sum(SIZES),), 1e-3)
    mean[SIZES[0]:SIZES[0] + SIZES[1]] = 1.0
    acc.observe_committed([mean])
    assert acc._parts[0].filled[1] != exponents[1]
    assert [e for i, e in enumerate(acc._parts[0].filled) if i != 1] == \
        [e for i, e in enumerate(exponents) if i != 1]
    refilled = torch.cat([torch.full((n,), 2.0 ** e) for n, e in zip(SIZES, acc._parts[0].filled,
                                                                     strict=True)])
    assert torch.equal(acc._parts[0].scale, refilled)
    acc.reset()
    halves = torch.tensor([-1.5, -0.5, 0.5, 1.5, 2.5])
    g = torch.cat([halves.repeat(n)[:n] * 2.0 ** -e
                   for n, e in zip(SIZES, acc._parts[0].filled, strict=True)])
    one_replica(acc, flat, g)
    expected = torch.cat([torch.tensor([-2.0, -0.0, 0.0, 2.0, 2.0]).repeat(n)[:n] for n in SIZES])
    assert torch.equal(acc.buffers()[0][:sum(SIZES)], expected)


def test_make_accumulator():
    flat = FlatGradients(make_params())
    assert isinstance(make_accumulator("exact", flat, M), ExactAccumulator)
    assert isinstance(make_accumulator("fast", flat, M), FastAccumulator)
    assert isinstance(make_accumulator("", flat, M), FastAccumulator)
    with pytest.raises(ValueError, match="unknown reduce mode 'bogus'"):
        make_accumulator("bogus", flat, M)


class _Buckets:
    """A BucketSet of given buckets (what buffers.StepBuckets hands the accumulator)."""

    def __init__(self, buckets: list) -> None:
        self.buckets = buckets

    def zero(self) -> None:
        for bucket in self.buckets:
            bucket.flat.zero_()


def _counters(numel: int, integer: bool) -> _Buckets:
    from recover.trainer.gradients import Bucket

    return _Buckets([Bucket(torch.device("cpu"), torch.float64, [], [numel - 1, 1],
                            torch.zeros(numel, dtype=torch.float64), integer=integer)])


@pytest.mark.parametrize("numel", [3, 100], ids=["checked-as-a-list", "checked-as-a-tensor"])
def test_integer_buffer_deltas_sum_unscaled_to_the_scaled_sums_bits(numel: int) -> None:
    # Integer buffers' deltas (whole numbers held in float64) skip the power-of-two scale:
    # scaling a whole number and undoing it is exact, so the means are the same bits as the
    # scaled path's, step after step (scales predicted in between), and the exact mean.
    gen = torch.Generator().manual_seed(5)
    accumulators = {integer: ExactAccumulator(_counters(numel, integer), M)
                    for integer in (True, False)}
    for step in range(3):
        deltas = [torch.randint(-10 ** (step + 2), 10 ** (step + 2), (numel,), generator=gen,
                                dtype=torch.int64).double() for _ in range(M)]
        means = {}
        for integer, acc in accumulators.items():
            acc.reset()
            for delta in deltas:
                acc.before_microbatch()
                acc.grads.buckets[0].flat.copy_(delta)
                acc.after_microbatch(1.0)
            reduced = acc.finish(acc.buffers())
            assert reduced.overflow == 0
            means[integer] = reduced.grads[0]
            acc.observe_committed(reduced.grads)
        assert torch.equal(means[True], means[False])
        assert torch.equal(means[True], torch.stack(deltas).sum(0) / M)
    assert accumulators[True]._parts[0].scale.numel() == 0  # never filled: never scaled


@pytest.mark.parametrize("numel", [3, 100], ids=["checked-as-a-list", "checked-as-a-tensor"])
@pytest.mark.parametrize("bad", [2.0 ** 52, -(2.0 ** 52), math.inf, math.nan])
def test_an_integer_delta_too_large_to_sum_exactly_is_an_overflow(numel: int, bad: float) -> None:
    acc = ExactAccumulator(_counters(numel, True), M)
    acc.before_microbatch()
    acc.grads.buckets[0].flat[numel // 2] = bad
    acc.after_microbatch(1.0)
    acc.before_microbatch()
    acc.grads.buckets[0].flat.fill_(3.0)
    acc.after_microbatch(1.0)
    reduced = acc.finish(acc.buffers())
    assert (reduced.overflow, reduced.microbatches) == (1, 2)
    assert torch.equal(reduced.grads[0], torch.full((numel,), 1.5, dtype=torch.float64))


@pytest.mark.parametrize("device", ["cpu"] + (["cuda"] if torch.cuda.is_available() else []))
def test_each_tensor_s_peak_is_its_max_magnitude_read_at_once_on_a_gpu(device: str) -> None:
    # The next step's scales come from these: on a GPU every tensor's bounds are read in one
    # go (a read each waited for the device), the same values. scripts/gpu_check.sh runs it.
    from recover.trainer.exactparts import peaks

    mean = torch.tensor([1.0, -3.0, 2.0, math.nan, 0.5, math.inf, -0.25], device=device)
    got = peaks(mean, [3, 0, 2, 1, 1])
    assert got[:2] == [3.0, 0.0] and got[4] == 0.25
    assert math.isnan(got[2]) and math.isnan(got[3])  # not finite: no scale from it
    assert peaks(mean[:0], []) == []
