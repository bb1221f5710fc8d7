"""The step's reduction started during the last microbatch's backward (fast and exact mode).

DDP reduces a gradient bucket as soon as backward has produced it, so most of the
reduction hides behind the rest of the backward; a ReCoVer step used to reduce after its
last microbatch. Here the fast accumulator's pieces (fastreduce.py: the end of a large
gradient bucket, whose parameters backward finishes first) are reduced on a thread of
their own as soon as the last microbatch's backward has added its gradient to every
parameter of a piece; what is left (the bucket's head, other buckets, the statistics)
follows once the microbatch is done.

In exact mode the accumulation is the quantization of each microbatch's gradient (not
backward's sum into `.grad`), so the hooked microbatch's pieces are quantized and added
on this thread of backward's, as it completes each (`ExactAccumulator.piece_ready`), and
only their copy and allreduce go to the reducing thread: a hooked reduction dropped before
its pieces went leaves the sum complete. Whether a piece fit its scale is read once the
microbatch is over (on a GPU a read per piece would make backward's thread wait for the
device each time); not with loss scaling (its non-finite rule looks at the whole microbatch).

Why this keeps every guarantee:
- Every member issues the same collectives in the same order, whether it started some
  early or none (a replica recomputing a lost one's microbatches, one whose last microbatch
  was not hooked): the pieces in `FastAccumulator.pieces` order, then the rest
  (`FastAccumulator.schedule`). A piece starts only once the pieces before it have, so the
  order does not depend on which gradient backward happens to produce first.
- Only a microbatch that is certainly the replica's last of the step is hooked: a closed
  plan (work-stealing may still grow an open one) and one process per replica.
- The reduction works on copies, as always: a collective cut by a failure leaves the
  accumulation intact, the next generation's plan adds microbatches to it, and the
  reduction runs again (hooked anew if a microbatch is computed). A reduction started
  for a group that is no longer the replica's, or for fewer microbatches than it now
  holds, is waited for and dropped.
- On a GPU the backward's kernels are queued ahead of the host: each piece's copy waits
  on an event recorded when autograd queued its last accumulation, on a stream of its
  own, and the step's result waits for that stream.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch

from recover.trainer.digest import local_part
from recover.trainer.fastreduce import FastAccumulator, Piece
from recover.trainer.groups import CollectiveAborted, CrossReplicaGroup
from recover.trainer.reduction import ExactAccumulator

log = logging.getLogger("recover.trainer")

PIECE_BYTES = 25 << 20
"""The size of a piece reduced on its own: DDP's default bucket (`bucket_cap_mb=25`). A
model whose gradient is smaller has no pieces and reduces as before, in one collective."""


def piece_bytes(reduce: str, after_backward: bool, own_backward: bool, ranks: int,
                size: int = 0) -> int:
    """The accumulator's piece size for a job: PIECE_BYTES where a reduction can start during
    the backward, else 0 (each buffer one collective, as before). In exact mode the hooked
    microbatch's integers are made piece by piece as backward completes them
    (`ExactAccumulator.piece_ready`; none with loss scaling). Not with
    `--no-overlap-reduce`, nor
    for a user's own `forward_backward` (it may run several backward passes, or change a
    gradient after one), nor for a replica of several ranks (FSDP2 writes the gradient
    shards itself). The same for every replica of a job, as their collectives must be.
    `size`: another piece size than PIECE_BYTES (tests, benchmarks)."""
    if after_backward or own_backward or ranks > 1:
        return 0
    return size or PIECE_BYTES


@dataclass
class _Hooked:
    """One hooked microbatch's reduction, from its backward to the step's result."""

    group: CrossReplicaGroup
    step: int
    done: int
    """Microbatches accumulated once the hooked one is: the reduction holds exactly these."""
    buffers: list[torch.Tensor]
    waiting: list[int]
    """Per piece: parameters whose gradient the hooked backward has not finished yet."""
    started: int = 0
    """Pieces handed to the reducing thread, in order."""
    futures: list[Future[None]] = field(default_factory=list)
    handles: list[Any] = field(default_factory=list)
    waits: list[tuple[torch.device, Callable[[], None]]] = field(default_factory=list)
    """The collectives started and not yet waited for, in order (and each one's device)."""
    failure: str | None = None


class EarlyReduction:
    """Hooks a replica's last microbatch of a step and reduces its pieces meanwhile."""

    def __init__(self, accumulator: FastAccumulator | ExactAccumulator, replica: int = 0) -> None:
        self.accumulator = accumulator
        self.replica = replica
        self.pieces: list[Piece] = list(accumulator.pieces)
        buckets = accumulator.grads.buckets
        self._params = [[buckets[p.bucket].params[i] for i in p.params] for p in self.pieces]
        self._views = [[buckets[p.bucket].flat[o:o + n] for o, n in _ranges(buckets[p.bucket], p)]
                       for p in self.pieces]
        self._pool: ThreadPoolExecutor | None = None
        self._streams: dict[torch.device, Any] = {}
        self._hooked: _Hooked | None = None
        self._told = False
        self.started_in_backward = 0
        """Pieces handed to the reducing thread while a backward still ran (tests, logs)."""

    # ------------------------------------------------------------ the executor's calls

    def hook(self, group: CrossReplicaGroup, step: int, done: int) -> None:
        """Before the step's last microbatch: reduce each piece once its backward is done.
        `done`: microbatches accumulated once this one is."""
        self.drop()
        self.accumulator.defer_pieces()
        buffers = self.accumulator.new_buffers()
        hooked = _Hooked(group, step, done, buffers, [len(ps) for ps in self._params])
        for index, params in enumerate(self._params):
            for position, param in enumerate(params):
                hooked.handles.append(param.register_post_accumulate_grad_hook(
                    partial(self._accumulated, hooked, index, position)))
        self._hooked = hooked

    def unhook(self) -> None:
        """After the hooked microbatch (done or failed): no later backward is watched."""
        if self._hooked is not None:
            for handle in self._hooked.handles:
                handle.remove()
            self._hooked.handles.clear()

    def take(self, group: CrossReplicaGroup | None, step: int, done: int) -> _Hooked | None:
        """The hooked reduction if it is this one's (same group, step and microbatches), else
        None, any earlier one waited for and dropped."""
        hooked = self._hooked
        if hooked is not None and hooked.group is group and hooked.step == step \
                and hooked.done == done and not hooked.handles:
            self._hooked = None
            return hooked
        self.drop()
        return None

    def finish(self, hooked: _Hooked) -> list[torch.Tensor]:
        """Reduce what is left after the pieces started early and wait for all of it: the
        reduced buffers (FastAccumulator.finish), or CollectiveAborted."""
        if not self._told:  # once per worker: that the overlap works, and how far
            self._told = True
            log.info("step %d: %d of %d gradient pieces started reducing during the last "
                     "backward", hooked.step, hooked.started, len(self.pieces),
                     extra={"step": hooked.step, "generation": hooked.group.spec.generation,
                            "replica": self.replica})
        self._start_pieces(hooked, every=True)  # those backward did not reach
        self.accumulator.fill_rest(hooked.buffers)
        rest = self.accumulator.schedule(hooked.buffers)[len(self.pieces):]
        hooked.futures.append(self._submit(partial(self._reduce_rest, hooked, rest,
                                                   _record_events(rest))))
        self._wait(hooked)
        if hooked.failure is not None:
            raise CollectiveAborted(hooked.failure)
        for device, stream in self._streams.items():  # the result is read on the step's stream
            torch.cuda.current_stream(device).wait_stream(stream)
        return hooked.buffers

    def drop(self) -> None:
        """Forget a hooked reduction that will not be used (its collectives ended first)."""
        hooked, self._hooked = self._hooked, None
        if hooked is not None:
            for handle in hooked.handles:
                handle.remove()
            if self._pool is not None:
                hooked.futures.append(self._submit(partial(self._settle, hooked)))
            self._wait(hooked)

    def close(self) -> None:
        self.drop()
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None

    # ------------------------------------------------------------ backward's side

    def _accumulated(self, hooked: _Hooked, index: int, position: int,
                     param: torch.Tensor) -> None:
        """Autograd added the hooked microbatch's gradient into `param.grad`."""
        view = self._views[index][position]
        grad = param.grad
        if grad is not None and local_part(grad).data_ptr() != view.data_ptr():
            # Autograd replaced `.grad` instead of adding into it (gradients.py): fold it
            # back now, as `repair_views` would after the microbatch, before it is copied.
            view.copy_((grad.to_dense() if grad.is_sparse else grad).reshape(-1))
            param.grad = view.view_as(param)
        hooked.waiting[index] -= 1
        before = hooked.started
        self._start_pieces(hooked)
        self.started_in_backward += hooked.started - before

    def _start_pieces(self, hooked: _Hooked, every: bool = False) -> None:
        """Hand the reducing thread each piece, in order, whose gradient is complete (`every`:
        the rest too, once the microbatch is over)."""
        while hooked.started < len(self.pieces) and (every or hooked.waiting[hooked.started] == 0):
            piece = self.pieces[hooked.started]
            self.accumulator.piece_ready(hooked.started)  # exact mode: its integers, here
            event = _record_event(self.accumulator.grads.buckets[piece.bucket].flat)
            hooked.futures.append(self._submit(partial(self._reduce_piece, hooked, piece, event)))
            hooked.started += 1

    # ------------------------------------------------------------ the reducing thread

    def _submit(self, work: Callable[[], None]) -> Future[None]:
        if self._pool is None:
            # One thread: the collectives are started in the order they are handed to it.
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="recover-reduce")
        return self._pool.submit(work)

    def _reduce_piece(self, hooked: _Hooked, piece: Piece, event: Any) -> None:
        if hooked.failure is not None:
            return  # the group failed: the collectives after it are never issued
        buffer = hooked.buffers[piece.group]
        try:
            with self._stream_for(buffer.device, event):
                self.accumulator.fill_piece(hooked.buffers, piece)
                hooked.waits.append((buffer.device, hooked.group.start_allreduce_sum_(
                    buffer[piece.start:piece.end])))
        except CollectiveAborted as exc:
            hooked.failure = str(exc)

    def _reduce_rest(self, hooked: _Hooked, rest: list[torch.Tensor], events: list[Any]) -> None:
        try:
            for buffer, event in zip(rest, events, strict=True):
                if hooked.failure is None:
                    with self._stream_for(buffer.device, event):
                        hooked.waits.append((buffer.device,
                                             hooked.group.start_allreduce_sum_(buffer)))
        except CollectiveAborted as exc:
            hooked.failure = str(exc)
        self._settle(hooked)

    def _settle(self, hooked: _Hooked) -> None:
        """Wait for every collective started, in order (after a failure each ends at once)."""
        for device, wait in hooked.waits:
            try:
                with self._stream_for(device, None):
                    wait()
            except CollectiveAborted as exc:
                hooked.failure = hooked.failure or str(exc)
        hooked.waits.clear()

    def _stream_for(self, device: torch.device, event: Any) -> Any:
        """The reducing thread's stream on `device`, made to wait for `event` (CPU: none)."""
        if device.type != "cuda":
            return contextlib.nullcontext()
        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams[device] = torch.cuda.Stream(device)
        if event is not None:
            stream.wait_event(event)
        return torch.cuda.stream(stream)

    @staticmethod
    def _wait(hooked: _Hooked) -> None:
        for future in hooked.futures:
            future.result()  # the work's own errors (not a lost peer) propagate


def _ranges(bucket: Any, piece: Piece) -> list[tuple[int, int]]:
    """(offset, numel) in the bucket's flat gradient of each of a piece's parameters (they
    lie one after the other from the piece's start)."""
    ranges, offset = [], piece.bucket_start
    for i in piece.params:
        ranges.append((offset, bucket.sizes[i]))
        offset += bucket.sizes[i]
    return ranges


def _record_event(tensor: torch.Tensor) -> Any:
    """An event after the work queued so far on `tensor`'s device (None on the CPU, where
    what autograd has done is done)."""
    if tensor.device.type != "cuda":
        return None
    return torch.cuda.current_stream(tensor.device).record_event()


def _record_events(buffers: list[torch.Tensor]) -> list[Any]:
    return [_record_event(buffer) for buffer in buffers]
