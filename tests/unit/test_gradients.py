"""Gradient buckets of several dtypes (trainer/gradients.py) and their reduction, fast and exact.

The single-dtype cases are in test_reduction.py; here a model mixes float32,
bfloat16, float16 and float64 parameters, as mixed-precision models do.
"""

from __future__ import annotations

import random

import pytest
import torch

from recover.trainer.gradients import GradientBuckets, GradientLayoutError
from recover.trainer.reduction import ExactAccumulator, FastAccumulator, make_accumulator

torch.set_num_threads(1)

M = 8
SPECS = ((torch.float32, (6,)), (torch.bfloat16, (4, 3)), (torch.float32, (5,)),
         (torch.float16, (7,)), (torch.float64, (3,)), (torch.bfloat16, (2,)))


def make_params() -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(shape, generator=gen).to(dtype)) for dtype, shape in SPECS]


def microbatch_grads(seed: int = 1) -> list[list[torch.Tensor]]:
    """M microbatches x one flat gradient per bucket (in the bucket's dtype)."""
    buckets = GradientBuckets(make_params()).buckets
    gen = torch.Generator().manual_seed(seed)
    return [[(torch.randn(b.numel, generator=gen, dtype=torch.float64)
              * 10.0 ** torch.empty(b.numel, dtype=torch.float64).uniform_(-3, 1, generator=gen))
             .to(b.dtype) for b in buckets] for _ in range(M)]


def reduce(kind: str, partition: list[list[int]], grads: list[list[torch.Tensor]],
           reduce_dtype: str = "grad"):
    per_replica = []
    acc = None
    for ids in partition:
        buckets = GradientBuckets(make_params())
        acc = make_accumulator(kind, buckets, M, reduce_dtype)
        acc.reset()
        for mb in ids:
            acc.before_microbatch()
            for bucket, g in zip(buckets.buckets, grads[mb], strict=True):
                bucket.flat.add_(g)
            acc.after_microbatch(1.0 + mb / 8)
        per_replica.append(acc.buffers())
    total = [b.clone() for b in per_replica[0]]
    for buffers in per_replica[1:]:
        for t, b in zip(total, buffers, strict=True):
            t += b
    return acc.finish(total)


def random_partitions() -> list[list[list[int]]]:
    out = [[list(range(M))], [list(range(M - 1, -1, -1))], [[0, 1, 2], [3, 4, 5], [6, 7]]]
    for seed in range(5):
        rng = random.Random(seed)
        ids = list(range(M))
        rng.shuffle(ids)
        cuts = sorted(rng.sample(range(1, M), rng.randint(1, 4)))
        out.append([ids[a:b] for a, b in zip([0, *cuts], [*cuts, M], strict=True)])
    return out


def test_one_bucket_per_device_and_dtype_with_grads_as_views() -> None:
    params = make_params()
    grads = GradientBuckets(params)
    assert [(str(b.device), b.dtype) for b in grads.buckets] == [
        ("cpu", torch.float32), ("cpu", torch.bfloat16), ("cpu", torch.float16),
        ("cpu", torch.float64)]
    assert grads.describe() == ["cpu float32 x 11", "cpu bfloat16 x 14", "cpu float16 x 7",
                                "cpu float64 x 3"]
    for p in params:
        assert p.grad is not None and p.grad.dtype == p.dtype and p.grad.shape == p.shape
    for bucket in grads.buckets:
        bucket.flat.fill_(2.0)
    assert all(bool((p.grad == 2).all()) for p in params)


def test_backward_of_a_bf16_model_fills_its_bucket() -> None:
    model = torch.nn.Linear(4, 2).to(torch.bfloat16)
    grads = GradientBuckets(list(model.parameters()))
    model(torch.ones(3, 4, dtype=torch.bfloat16)).sum().backward()
    assert grads.buckets[0].flat.dtype == torch.bfloat16
    assert float(grads.buckets[0].flat.abs().sum()) > 0


def test_a_replaced_grad_is_folded_back_into_its_bucket() -> None:
    params = make_params()
    grads = GradientBuckets(params)
    params[2].grad = torch.full_like(params[2], 5.0)  # what double backward or user code does
    grads.repair_views()
    assert bool((grads.buckets[0].flat[6:11] == 5.0).all())
    grads.zero()
    assert float(params[2].grad.abs().sum()) == 0.0  # a view again


@pytest.mark.parametrize("params, message", [
    ([], "no trainable parameters"),
    ([torch.nn.Parameter(torch.zeros(2, dtype=torch.complex64))], "complex64"),
])
def test_parameters_that_cannot_be_reduced_are_refused(params, message) -> None:
    with pytest.raises(GradientLayoutError, match=message):
        GradientBuckets(params)


def test_a_sparse_gradient_lands_densely_in_its_bucket() -> None:
    embedding = torch.nn.Embedding(10, 3, sparse=True)
    grads = GradientBuckets(list(embedding.parameters()))
    embedding(torch.tensor([1, 2, 2])).sum().backward()
    grads.repair_views()
    assert torch.equal(grads.buckets[0].flat.view(10, 3).sum(1),
                       torch.tensor([0, 3, 6, 0, 0, 0, 0, 0, 0, 0], dtype=torch.float32))


def test_exact_is_bitwise_identical_across_partitions_with_mixed_dtypes() -> None:
    grads = microbatch_grads()
    reference = reduce("exact", [list(range(M))], grads)
    assert reference.overflow == 0 and reference.microbatches == M
    assert [g.dtype for g in reference.grads] == [torch.float32, torch.bfloat16, torch.float16,
                                                  torch.float64]
    for partition in random_partitions():
        got = reduce("exact", partition, grads)
        for a, b in zip(got.grads, reference.grads, strict=True):
            assert a.view(torch.uint8).numpy().tobytes() == b.view(torch.uint8).numpy().tobytes(), \
                partition
        assert got.loss == reference.loss


def test_exact_mean_is_close_to_the_float64_mean() -> None:
    grads = microbatch_grads(seed=4)
    got = reduce("exact", [[0, 1, 2, 3], [4, 5, 6, 7]], grads)
    for i, mean in enumerate(got.grads):
        want = sum(g[i].double() for g in grads) / M
        # One rounding to the bucket's dtype (the float64 bucket is held to float64 fixed point).
        tolerance = {torch.float64: 1e-9, torch.float32: 1e-6, torch.float16: 2e-3,
                     torch.bfloat16: 1e-2}[mean.dtype]
        assert torch.allclose(mean.double(), want, rtol=tolerance, atol=tolerance * 1e-2)


@pytest.mark.parametrize("reduce_dtype", ["grad", "float32"])
def test_fast_keeps_counts_exact_whatever_the_dtype(reduce_dtype: str) -> None:
    grads = microbatch_grads()
    got = reduce("fast", [[0, 1, 2], [3, 4, 5, 6, 7]], grads, reduce_dtype)
    assert got.microbatches == M
    assert got.loss == pytest.approx(sum(1.0 + mb / 8 for mb in range(M)) / M)
    assert [g.dtype for g in got.grads] == [torch.float32, torch.bfloat16, torch.float16,
                                            torch.float64]


def test_fast_in_a_bf16_only_model_carries_its_statistics_in_float64() -> None:
    params = [torch.nn.Parameter(torch.zeros(5, dtype=torch.bfloat16))]
    acc = FastAccumulator(GradientBuckets(params))
    for _ in range(3):
        acc.after_microbatch(0.1)
    buffers = acc.buffers()
    assert [b.dtype for b in buffers] == [torch.bfloat16, torch.float64]
    assert acc.finish(buffers).microbatches == 3
    assert [b.dtype for b in FastAccumulator(GradientBuckets(params), "float32").buffers()] == [
        torch.float32]


def test_exact_scale_state_survives_a_round_trip() -> None:
    grads = microbatch_grads()
    first = ExactAccumulator(GradientBuckets(make_params()), M)
    first.observe_committed(reduce("exact", [list(range(M))], grads).grads)
    second = ExactAccumulator(GradientBuckets(make_params()), M)
    second.load_state_dict(first.state_dict())
    for a, b in zip(first._parts, second._parts, strict=True):
        assert torch.equal(a.scale, b.scale)
    with pytest.raises(ValueError, match="this model has"):
        ExactAccumulator(GradientBuckets([torch.nn.Parameter(torch.zeros(2))]), M).load_state_dict(
            first.state_dict())


@pytest.mark.parametrize("loss", [float("nan"), float("inf"), 1e30])
def test_a_diverged_loss_counts_as_overflow_in_exact_mode(loss: float) -> None:
    acc = ExactAccumulator(GradientBuckets(make_params()), M)
    acc.reset()
    acc.before_microbatch()
    acc.after_microbatch(loss)
    acc.after_microbatch(1.0)
    reduced = acc.finish(acc.buffers())
    assert (reduced.overflow, reduced.microbatches) == (1, 2)
