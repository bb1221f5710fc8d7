"""The determinism check: compute one microbatch twice and compare the gradients bitwise.

Exact mode is only as good as the workload's determinism. ReCoVer seeds
torch's default generators per microbatch (so dropout and a bare
``torch.rand`` are covered), but not Python's ``random``, numpy's global
generator or a ``torch.Generator`` the user made, and it cannot make a
non-deterministic kernel deterministic. Computing the same microbatch twice
on one replica catches those; comparing the digest of that gradient across
replicas (the controller does, from each replica's `ready` report) catches
what differs between hosts: torch builds, thread counts, hardware.

The check leaves no trace: the model's parameters and buffers are restored
and the gradients zeroed, so the trajectory is the same with or without it.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

import torch

from recover.trainer.digest import tensor_digest
from recover.trainer.errors import WorkloadError, contract_error
from recover.trainer.gradients import GradientBuckets
from recover.trainer.workload import Workload

LIKELY_CAUSES = ("a random generator ReCoVer does not seed (Python's random, numpy, a "
                 "torch.Generator of your own), a non-deterministic kernel "
                 "(torch.use_deterministic_algorithms(True) finds them), or state the loss "
                 "function changes between calls")


@dataclass(frozen=True)
class DeterminismCheck:
    step: int
    microbatch: int
    gradient_sha256: str
    """Digest of the microbatch's gradient: replicas compare it (host-to-host differences)."""


def _gradients(workload: Workload, grads: GradientBuckets, step: int,
               microbatch: int) -> list[torch.Tensor]:
    """The microbatch's gradient buckets, then (buffers reduced) its buffer-update buckets:
    an update that differs between two computations would break the guarantee as surely."""
    buffers = workload.model_buffers.buckets if workload.model_buffers is not None else []
    grads.zero()
    for bucket in buffers:
        bucket.flat.zero_()
    workload.compute(step, microbatch)
    grads.repair_views()
    return [bucket.flat.clone() for bucket in [*grads.buckets, *buffers]]


def batch_digest(batch: Any) -> str:
    """A digest of a batch however it nests tensors (lists, tuples, dicts) and other values
    (their repr): two loads of one microbatch must give the same."""
    h = hashlib.sha256()

    def walk(value: Any, path: str) -> None:
        if isinstance(value, torch.Tensor):
            h.update(tensor_digest([(path, value)]).encode())
        elif isinstance(value, dict):
            for key in value:
                walk(value[key], f"{path}[{key!r}]")
        elif isinstance(value, list | tuple):
            for index, item in enumerate(value):
                walk(item, f"{path}[{index}]")
        else:
            h.update(f"{path}={value!r}".encode())

    walk(batch, "batch")
    return h.hexdigest()


def check_batch(workload: Workload, step: int = 0, microbatch: int = 0) -> None:
    """Load one microbatch's batch twice (past any prefetching) and compare: a source
    that is not a pure function of (step, microbatch) fails in one line naming it."""
    source = workload.source
    load = getattr(source, "load", source.batch)
    if batch_digest(load(step, microbatch)) != batch_digest(load(step, microbatch)):
        raise contract_error(
            f"determinism check failed: the batch of microbatch {microbatch} of step {step} "
            "differed between two loads; the microbatch source must return the same batch for "
            "the same (step, microbatch) (a random transform needs a generator seeded from "
            "them)", where="determinism check", step=step, microbatch=microbatch)


def check_determinism(workload: Workload, grads: GradientBuckets, step: int = 0,
                      microbatch: int = 0) -> DeterminismCheck:
    """Raise a WorkloadError naming the first differing parameter (or the batch, when two
    loads of it differ); else the gradient digest."""
    check_batch(workload, step, microbatch)
    # Forward may update buffers (batch norm statistics, non-persistent caches too):
    # every parameter and buffer is kept aside, on the CPU, and put back bit for bit.
    tensors = [*workload.model.parameters(), *workload.model.buffers()]
    with torch.no_grad():
        saved = [t.detach().to("cpu", copy=True) for t in tensors]

    def restore() -> None:
        with torch.no_grad():
            for t, s in zip(tensors, saved, strict=True):
                t.copy_(s)

    try:
        first = _gradients(workload, grads, step, microbatch)
        restore()
        second = _gradients(workload, grads, step, microbatch)
    finally:
        restore()
        grads.zero()
        if workload.model_buffers is not None:
            workload.model_buffers.zero()
    for bucket, a, b in zip(grads.buckets, first, second, strict=False):
        if _same_bits(a, b):
            continue
        offset = 0
        for p, n in zip(bucket.params, bucket.sizes, strict=True):
            if not _same_bits(a[offset:offset + n], b[offset:offset + n]):
                diff = float((a[offset:offset + n].double() - b[offset:offset + n].double())
                             .abs().nan_to_num(nan=float("inf")).max())
                raise _failed(workload, p, diff, step, microbatch)
            offset += n
    count = len(grads.buckets)
    for a, b in zip(first[count:], second[count:], strict=True):
        if not _same_bits(a, b):
            raise contract_error(
                f"determinism check failed: microbatch {microbatch} of step {step} updated the "
                f"model's buffers differently when computed twice; likely causes: "
                f"{workload.determinism_hint}{LIKELY_CAUSES}", where="determinism check",
                step=step, microbatch=microbatch)
    return DeterminismCheck(step, microbatch, tensor_digest(
        (f"bucket{i}", g) for i, g in enumerate(first)))


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit, so that a NaN equals itself (a loss-scaled gradient may overflow)."""
    if a.is_floating_point() and a.is_contiguous() and b.is_contiguous():
        return torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    return torch.equal(a, b)


def _failed(workload: Workload, param: torch.nn.Parameter, diff: float, step: int,
            microbatch: int) -> WorkloadError:
    names = {id(p): name for name, p in workload.model.named_parameters()}
    name = names.get(id(param), f"of shape {tuple(param.shape)}")
    return contract_error(
        f"determinism check failed: microbatch {microbatch} of step {step} gave different "
        f"gradients when computed twice (first in parameter {name}, max difference {diff:.3g}); "
        f"likely causes: {LIKELY_CAUSES}", where="determinism check", step=step,
        microbatch=microbatch)
