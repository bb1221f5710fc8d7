"""The step digest off the critical path: hashed on a thread while the next step computes.

A member reports the sha256 of its parameters after every step it applies (the ledger's
bitwise proof). Hashing is CPU work: about 150 ms for 50M float32 parameters, which on
a GPU job is most of a step (measured on an H100: BENCHMARKS.md section 13), where the CPU
is otherwise idle as the next step computes on the GPU. So the digest is made on a thread;
each is delivered, in step order, by the training loop when it is ready (`deliver`), or at
once where something needs it (`settle`: before a donor's snapshot, a joiner's catch-up
step, a checkpoint). Nothing about the digest changes: the same bytes, the same names, the
same order.

What the thread hashes:
- GPU tensors are cloned on their device (cheap there) and copied to the host on a CUDA
  stream of its own, into pinned memory: a plain `.to("cpu")` is a pageable copy on the
  default stream, which every kernel of the next step queued after it waits for (and
  which waits for them), so the hash's copy took GPU time from the step it was meant to
  stay out of.
- Host parameters are hashed where they are, not copied (a copy costs a third of the
  hash, on cores the computation needs; on this project's 2-core machine the thread only
  moves the hash's ~20 ms from after the step into its microbatches: level, BENCHMARKS.md
  section 4c, and one path for every replica): nothing writes a parameter between a step's
  optimizer step and the next one, before which the executor waits for the hash
  (`release`). What could break that is a user's own write: a callback after the commit
  (`on_step_committed`, so with one the parameters are copied), or a write in place during
  the next step, which each parameter's version counter shows (a write through `.data`
  bypasses it): the digest is then flagged (`torn`) and the parameters are copied from
  then on.
- Buffers are always copied: the next forward rewrites them (BatchNorm's statistics).

Not used for a replica of several ranks (their digest is combined over the replica's
group, a collective that must stay in the ranks' lockstep). The thread hashes the
snapshot's chunks on a few more (digest.DIGEST_SCHEME).
"""

from __future__ import annotations

import logging
import os
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from recover.proto import pb
from recover.trainer.digest import step_digest

log = logging.getLogger("recover.trainer")

Named = Sequence[tuple[str, torch.Tensor]]

HASH_THREADS = max(1, min(4, len(os.sched_getaffinity(0)) // 4))
"""Threads hashing one snapshot's chunks: enough that 200 MB hash within a GPU step (~40 ms
on 4), few enough that the GPUs' replicas sharing a host's cores do not crowd it."""

MAX_PENDING = 2
"""Snapshots hashing or waiting at once: where steps outrun the hash, the step waits for
the oldest rather than copies of the parameters piling up on the device."""


def snapshot(named: Named) -> list[tuple[str, torch.Tensor]]:
    """Copies of the tensors as they are now, on their own device."""
    return [(name, tensor.detach().clone()) for name, tensor in named]


def _borrowable(tensor: torch.Tensor) -> bool:
    """A host tensor whose own version counter shows every write to its bytes (a sharded
    tensor's wrapper would not: its local shard has its own)."""
    return tensor.is_cpu and type(tensor) in (torch.Tensor, torch.nn.Parameter)


class _HostCopies:
    """Device snapshots copied to pinned host memory on a side stream per device."""

    def __init__(self) -> None:
        self._streams: dict[torch.device, torch.cuda.Stream] = {}

    @staticmethod
    def ordered_after_now(named: Named) -> dict[torch.device, torch.cuda.Event]:
        """Per GPU, an event after the snapshot's clones (enqueued on its current stream)
        for the copies to wait on."""
        events = {}
        for device in {t.device for _, t in named if t.is_cuda}:
            events[device] = torch.cuda.Event()
            events[device].record(torch.cuda.current_stream(device))
        return events

    def to_host(self, named: Named, ready: dict[torch.device, torch.cuda.Event]) -> Named:
        if not ready:
            return named
        for device, event in ready.items():
            if device not in self._streams:
                self._streams[device] = torch.cuda.Stream(device)
            self._streams[device].wait_event(event)
        out: list[tuple[str, torch.Tensor]] = []
        for name, tensor in named:
            if tensor.is_cuda:
                with torch.cuda.stream(self._streams[tensor.device]):
                    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
                    host.copy_(tensor, non_blocking=True)
                tensor = host
            out.append((name, tensor))
        for device in ready:
            self._streams[device].synchronize()
        return out


@dataclass
class _Pending:
    step: int
    digest: Future[tuple[str, bool]]
    """The digest, and whether a borrowed tensor was written while it was hashed."""
    borrowed: bool
    record: pb.StepRecord
    """The ledger's record of the step: its digest is filled in on delivery."""
    commit_wait_s: float


class BackgroundDigests:
    """Step digests hashed on one thread, delivered in step order."""

    def __init__(self, replica: int, send: Callable[[pb.WorkerReport], None]) -> None:
        self._replica = replica
        self._send = send
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="recover-digest")
        self._chunks = ThreadPoolExecutor(max_workers=HASH_THREADS,
                                          thread_name_prefix="recover-digest-chunk")
        self._pending: deque[_Pending] = deque()
        self._host = _HostCopies()
        self.borrowing = True
        """Host parameters are hashed in place (else copied first): off once one was seen
        written while it was hashed."""

    def submit(self, step: int, record: pb.StepRecord, commit_wait_s: float,
               params: Named, buffers: Named, borrow: bool = True) -> None:
        """Hash the state after `step`, as it is now: the parameters' host tensors in place
        (with `borrow`, while `borrowing`: the caller calls `release` before they change),
        everything else copied now."""
        while len(self._pending) >= MAX_PENDING:
            self._deliver_oldest()
        borrow = borrow and self.borrowing
        kept: list[tuple[str, torch.Tensor]] = []
        borrowed: list[torch.Tensor] = []
        for name, tensor in params:
            if borrow and _borrowable(tensor):
                borrowed.append(tensor)
            else:
                tensor = tensor.detach().clone()
            kept.append((name, tensor))
        copies = snapshot(buffers)
        ready = self._host.ordered_after_now([*kept, *copies])
        future = self._pool.submit(self._hash, kept, copies, ready, borrowed,
                                   [t._version for t in borrowed])
        self._pending.append(_Pending(step, future, bool(borrowed), record, commit_wait_s))

    def _hash(self, params: Named, buffers: Named, ready: dict[torch.device, torch.cuda.Event],
              borrowed: Sequence[torch.Tensor], versions: Sequence[int]) -> tuple[str, bool]:
        on_host = self._host.to_host([*params, *buffers], ready)  # one wait for the copies
        digest = step_digest(on_host[:len(params)], on_host[len(params):], self._chunks)
        torn = any(t._version != v for t, v in zip(borrowed, versions, strict=True))
        return digest, torn

    def release(self) -> None:
        """The borrowed parameters are about to change: every hash that reads them is done
        (and its digest reported) when this returns."""
        while any(p.borrowed for p in self._pending):
            self._deliver_oldest()

    def deliver(self, wait: bool = False) -> None:
        """Report the digests that are ready (all of them, with `wait`), oldest first."""
        while self._pending and (wait or self._pending[0].digest.done()):
            self._deliver_oldest()

    def _deliver_oldest(self) -> None:
        done = self._pending.popleft()
        digest, torn = done.digest.result()
        if torn:
            self.borrowing = False
            log.warning("step %d: a parameter was written in place while its digest was "
                        "hashed (outside the optimizer step): this step's digest may not match "
                        "the other replicas'; parameters are copied before hashing from now on",
                        done.step, extra={"step": done.step, "replica": self._replica})
        done.record.param_sha256.append(pb.ReplicaDigest(replica=self._replica,
                                                         param_sha256=digest))
        self._send(pb.WorkerReport(applied=pb.Applied(
            step=done.step, param_sha256=digest, commit_wait_s=done.commit_wait_s)))

    @property
    def chunk_pool(self) -> Executor:
        """The threads chunks are hashed on (HASH_THREADS), for a digest outside a step: a
        joiner's of the state it loaded."""
        return self._chunks

    def settle(self) -> None:
        """Every digest submitted is in its record and reported."""
        self.deliver(wait=True)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._chunks.shutdown(wait=False, cancel_futures=True)
