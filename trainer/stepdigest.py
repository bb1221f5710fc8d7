"""The step digest off the critical path, for replicas whose parameters live on a GPU.

A member reports the sha256 of its parameters after every step it applies (the ledger's
bitwise proof). Hashing is CPU work: about 150 ms for 50M float32 parameters, which on
a GPU job is most of a step (measured on an H100: BENCHMARKS.md section 13), while the
CPU is otherwise idle as the next step computes on the GPU. So the parameters are cloned
on their device (cheap there) and hashed on a thread; each digest is delivered, in step
order, by the training loop when it is ready (`deliver`), or at once where something
needs it (`settle`: before a donor's snapshot, a joiner's catch-up step, a checkpoint).
Nothing about the digest changes: the same bytes, the same names, the same order.

Not used for a replica of several ranks (their digest is combined over the replica's
group, a collective that must stay in the ranks' lockstep) nor for CPU parameters (the
copy would cost a third of the hash, on cores the computation needs).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from recover.proto import pb
from recover.trainer.digest import step_digest

Named = Sequence[tuple[str, torch.Tensor]]

MAX_PENDING = 2
"""Snapshots hashing or waiting at once: where steps outrun the hash, the step waits for
the oldest rather than copies of the parameters piling up on the device."""


def snapshot(named: Named) -> list[tuple[str, torch.Tensor]]:
    """Copies of the tensors as they are now, on their own device."""
    return [(name, tensor.detach().clone()) for name, tensor in named]


@dataclass
class _Pending:
    step: int
    digest: Future[str]
    record: pb.StepRecord
    """The ledger's record of the step: its digest is filled in on delivery."""
    commit_wait_s: float


class BackgroundDigests:
    """Step digests hashed on one thread, delivered in step order."""

    def __init__(self, replica: int, send: Callable[[pb.WorkerReport], None]) -> None:
        self._replica = replica
        self._send = send
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="recover-digest")
        self._pending: deque[_Pending] = deque()

    def submit(self, step: int, record: pb.StepRecord, commit_wait_s: float,
               params: Named, buffers: Named) -> None:
        """Hash a snapshot (taken by the caller, now) of the state after `step`."""
        while len(self._pending) >= MAX_PENDING:
            self._deliver_oldest()
        future = self._pool.submit(step_digest, params, buffers)
        self._pending.append(_Pending(step, future, record, commit_wait_s))

    def deliver(self, wait: bool = False) -> None:
        """Report the digests that are ready (all of them, with `wait`), oldest first."""
        while self._pending and (wait or self._pending[0].digest.done()):
            self._deliver_oldest()

    def _deliver_oldest(self) -> None:
        done = self._pending.popleft()
        digest = done.digest.result()
        done.record.param_sha256.append(pb.ReplicaDigest(replica=self._replica,
                                                         param_sha256=digest))
        self._send(pb.WorkerReport(applied=pb.Applied(
            step=done.step, param_sha256=digest, commit_wait_s=done.commit_wait_s)))

    def settle(self) -> None:
        """Every digest submitted is in its record and reported."""
        self.deliver(wait=True)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
