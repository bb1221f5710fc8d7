"""Both sides of a join: the donor streams, the joiner catches up (DESIGN.md "Joins").

The donor never stops training for a join. On the controller's word it takes a
snapshot of its state between two steps (a copy in memory: parameters,
optimizer, scheduler, extra state, exact-reduction scales, the step), and a
background thread sends it, then the reduced gradient of every step the donor
commits from then on. The joiner loads the snapshot and applies those
gradients with its own optimizer, exactly as the donor did, so it reaches the
donor's state bit for bit, and keeps up until the controller admits it into
a generation at a step boundary. The donor stops streaming once it has sent
every step before that boundary.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from recover.proto import pb
from recover.trainer.destinations import Destinations, OwnTensors
from recover.trainer.statewire import EncodedState, decode, tensor_metas
from recover.trainer.transfer import FrameKind, Listener, Stream, TransferError, connect

log = logging.getLogger("recover.trainer")

CONNECT_TIMEOUT_S = 30.0
"""How long a donor tries to reach its joiner, and a joiner waits for its donor."""
SEAL_FROM_BYTES = 1 << 20
"""Under TLS, a snapshot this large or larger goes in sealed records (trainer/sealed.py):
Python's TLS reads 16 KB a call, sealing costs one round trip more before the first byte
(0.13 ms on loopback, won back after ~0.4 MB: BENCHMARKS.md "Over TLS"). At the demo's 2 MB
the TLS join's wire rate doubles (736 -> 1,583 MB/s); 16 MiB before."""
MAX_BACKLOG_STEPS = 256
"""Committed steps a donor holds for a joiner that reads slower than it trains; beyond that
the join is given up (the controller starts another one from a fresh snapshot)."""
MAX_BACKLOG_BYTES = 1 << 30
"""The same bound in gradient bytes (held on the donor's device), for large models; two
steps are always allowed, or a large model could never be joined."""


@dataclass
class Committed:
    """One committed step, as a joiner must apply it."""

    step: pb.CatchUpStep
    grads: list[torch.Tensor]


class Donation:
    """The donor's side of one join; `offer` is called by the training loop after every
    applied step, the sending happens on a thread of its own."""

    def __init__(self, command: pb.Donate, donor: int, snapshot: EncodedState, step: int,
                 after_snapshot: Callable[[], None] | None = None) -> None:
        self.joiner = command.joiner
        self._after_snapshot = after_snapshot
        """The step hooks' point once the snapshot is sent (`--kill ...,phase=donate` kills the
        donor there, mid-stream); a no-op in production."""
        self._command = command
        self._donor = donor
        self._snapshot = snapshot
        self._next = step
        self._queue: queue.SimpleQueue[Committed | None] = queue.SimpleQueue()
        self._entry: int | None = None
        self._backlog_lock = threading.Lock()
        self._backlog = 0
        self._backlog_bytes = 0
        self.failed = ""
        self.done = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name=f"donate-to-{command.joiner}")
        self._thread.start()

    def offer(self, step: pb.CatchUpStep, grads: list[torch.Tensor]) -> None:
        if self.done.is_set():
            return
        size = sum(g.numel() * g.element_size() for g in grads)
        with self._backlog_lock:  # the sending thread takes off what this adds
            self._backlog += 1
            self._backlog_bytes += size
            steps, held = self._backlog, self._backlog_bytes
        if steps > MAX_BACKLOG_STEPS or (steps > 2 and held > MAX_BACKLOG_BYTES):
            self.failed = (f"the joiner fell {steps} steps ({held / 1e6:.0f} MB of gradients) "
                           "behind")
            self._queue.put(None)
            return
        self._queue.put(Committed(step, grads))

    def finish_before(self, entry_step: int) -> None:
        """The joiner enters at `entry_step`: send the steps before it, then end."""
        self._entry = entry_step
        self._queue.put(None)

    def _run(self) -> None:
        started = time.monotonic()
        stream: Stream | None = None
        try:
            stream = connect(self._command.address, pb.TransferHello(
                token=self._command.token, donor=self._donor, joiner=self.joiner),
                CONNECT_TIMEOUT_S, tls_sha256=self._command.tls_sha256,
                seal=self._snapshot.nbytes >= SEAL_FROM_BYTES)
            stream.settimeout(CONNECT_TIMEOUT_S)
            manifest = self._snapshot.manifest()
            manifest.step = self._next
            # The layout first: the joiner prepares memory for it, then reads the bytes.
            stream.send(FrameKind.PREVIEW, manifest)
            stream.send(FrameKind.SNAPSHOT, manifest, self._snapshot.tensors)
            self._snapshot = EncodedState(pb.StateNode())  # the copy is sent: free it
            log.info("sent replica %d a snapshot of step %d: %.1f MB in %.2fs", self.joiner,
                     manifest.step, stream.sent_bytes / 1e6, time.monotonic() - started)
            if self._after_snapshot is not None:
                self._after_snapshot()
            while self._entry is None or self._next < self._entry:
                item = self._queue.get()
                if self.failed:
                    break
                if item is None:
                    continue
                with self._backlog_lock:
                    self._backlog -= 1
                    self._backlog_bytes -= sum(g.numel() * g.element_size() for g in item.grads)
                stream.send(FrameKind.STEP, item.step, item.grads)
                self._next = item.step.step + 1
            stream.send(FrameKind.END, pb.TransferEnd(reason=self.failed))
        except TransferError as exc:
            self.failed = self.failed or str(exc)
        finally:
            if stream is not None:
                stream.close()
            if self.failed:
                log.warning("join of replica %d given up: %s", self.joiner, self.failed)
            self.done.set()


class Catchup:
    """The joiner's side of one join: the snapshot, then the donor's committed steps."""

    def __init__(self, listener: Listener, command: pb.Join,
                 stop: Callable[[], bool] | None = None, own: OwnTensors | None = None) -> None:
        """`own`: tensors of the joiner's state as built (never loaded) that may receive the
        snapshot in place; None when the joiner holds a state worth keeping."""
        self.command = command
        started = time.monotonic()
        self._stream, _ = listener.accept(command.token, CONNECT_TIMEOUT_S, stop)
        self.destinations: Destinations | None = None
        try:
            self._stream.settimeout(CONNECT_TIMEOUT_S)
            kind, manifest, tensors = self._stream.receive()
            if kind is FrameKind.PREVIEW and isinstance(manifest, pb.StateManifest):
                # Memory is prepared for what the preview announces before it is sent: only
                # a peer that presented this join's one-time token gets this far.
                try:
                    destinations = Destinations(manifest, own)
                except ValueError as exc:
                    raise TransferError(f"the donor's preview is impossible: {exc}") from None
                self.destinations = destinations
                kind, manifest, tensors = self._stream.receive(into=destinations.for_snapshot)
            if kind is not FrameKind.SNAPSHOT or not isinstance(manifest, pb.StateManifest):
                raise TransferError(f"expected a snapshot, got a {kind.name} frame")
            self.state: Any = decode(manifest.root, tensors)
        except TransferError:
            self._stream.close()
            raise
        self.step = manifest.step
        self.snapshot_bytes = self._stream.received_bytes
        self.snapshot_s = time.monotonic() - started

    @property
    def received_bytes(self) -> int:
        return self._stream.received_bytes

    def next(self) -> Committed | None:
        """The next committed step, or None when the donor sent everything before the entry
        step. Raises TransferError when the donor is gone or gives up."""
        kind, message, tensors = self._stream.receive()
        if kind is FrameKind.END:
            assert isinstance(message, pb.TransferEnd)
            if message.reason:
                raise TransferError(f"the donor gave up: {message.reason}")
            return None
        if kind is not FrameKind.STEP or not isinstance(message, pb.CatchUpStep):
            raise TransferError(f"expected a committed step, got a {kind.name} frame")
        if message.step != self.step:
            raise TransferError(f"the donor sent step {message.step}, this joiner needs {self.step}")
        self.step += 1
        return Committed(message, tensors)

    def close(self) -> None:
        self._stream.close()


def catch_up_step(step: int, loss: float, microbatches: int, tokens: int, generation: int,
                  grads: list[torch.Tensor]) -> pb.CatchUpStep:
    return pb.CatchUpStep(step=step, loss=loss, microbatches=microbatches, tokens=tokens,
                          generation=generation, tensors=tensor_metas(grads))
