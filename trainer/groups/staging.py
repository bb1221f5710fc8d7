"""Host staging for device buffers reduced by a host-only backend (gloo).

The gradient buckets stay on the model's device (trainer/gradients.py), but gloo reduces
host memory only. So a device buffer is copied into a host tensor, reduced there and copied
back. The host tensor is pinned when the buffer is on a CUDA device, so both copies are DMA
transfers that need no extra bounce buffer, and it is cached by shape and dtype: the
buckets have the same shapes every step, and pinning memory is expensive (a cudaHostAlloc
per step would cost more than the copy).

The copies are pipelined with the reduction: a large buffer goes in pieces of `PIECE_BYTES`,
each piece's reduction started as soon as its bytes are on the host, and each reduced piece
copied back while the later ones are still reduced. Measured on an H200 host (BENCHMARKS.md
section 13): in plain torch (`bench/scripts/allreduce_shapes_gpu.py`) 200 MB staged whole
took 114 ms against 92 ms for the same allreduce of host memory, and 95 ms in 16 pipelined
pieces; through this group (`bench/scripts/staging_pipeline.py`) 105 ms whole, 100 ms in
pieces.

Run on GPUs (scripts/gpu_check.sh); without a GPU the same code runs with `force=True`,
which stages a CPU buffer exactly as it would a device one.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable

import torch

_Key = tuple[tuple[int, ...], torch.dtype, bool]
"""Shape, dtype, pinned."""

Wait = Callable[[], None]
StartReduce = Callable[[torch.Tensor], Wait]
"""Starts reducing a host tensor in place and returns what waits for the result (and raises
if the reduction failed). Several may be in flight; they complete in the order started."""

PIECE_BYTES = 12 << 20
"""A staged buffer is reduced in pieces of this size (the last one shorter): small enough
that the first copy and the last copy back, which nothing overlaps, are short (under a
millisecond at PCIe speeds), large enough that a reduction's per-call cost stays small."""

MIN_PIECES = 4
"""A buffer of fewer pieces goes whole: each piece is a collective of its own, with its own
latency, and at 25 MB pieces measured no better than one copy each way (BENCHMARKS.md
section 13)."""

MAX_CACHED = 256
"""Staging tensors kept: a model has one reduce buffer per (device, dtype), and the pieces
reduced during the last backward (overlap.py: 25 MB each, 8 for a 50M-parameter float32
gradient, 160 for 1B) are one more each; the bound only stops a caller with ever-changing
shapes from growing it without end."""


def needs_staging(buffer: torch.Tensor) -> bool:
    """Whether a host-only backend must stage `buffer` (it lives on some device)."""
    return buffer.device.type != "cpu"


def _synchronize(device: torch.device) -> None:
    """Wait until the copies queued on `device`'s current stream are done (CUDA copies are
    asynchronous with non_blocking; other device types copied synchronously)."""
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


class HostStaging:
    """A cache of host tensors that device buffers are reduced through.

    A tensor is taken out of the cache while a reduction uses it and put back after, so
    two groups reducing at once (never the case with one group per process, but cheap to
    rule out) never share one. After a failed reduction it is dropped instead: the failed
    collective's last writes to it are nobody's business.
    """

    def __init__(self, piece_bytes: int = PIECE_BYTES) -> None:
        self.piece_bytes = piece_bytes
        """The size of the pieces reduced one after the other (a huge value: the whole
        buffer at once, as before the pipelining; the benchmark compares the two)."""
        self._lock = threading.Lock()
        self._cache: OrderedDict[_Key, list[torch.Tensor]] = OrderedDict()
        """Free host tensors by shape: several of one shape when pieces of one size are in
        flight together (overlap.py), the least recently used shape dropped first."""

    def __len__(self) -> int:
        return sum(map(len, self._cache.values()))

    def _take(self, buffer: torch.Tensor) -> tuple[_Key, torch.Tensor]:
        pin = buffer.device.type == "cuda"
        key = (tuple(buffer.shape), buffer.dtype, pin)
        with self._lock:
            free = self._cache.get(key)
            host = free.pop() if free else None
            if free is not None and not free:
                del self._cache[key]
        if host is None:
            host = torch.empty(buffer.shape, dtype=buffer.dtype, pin_memory=pin)
        return key, host

    def _give_back(self, key: _Key, host: torch.Tensor) -> None:
        with self._lock:
            self._cache.setdefault(key, []).append(host)
            self._cache.move_to_end(key)
            while sum(map(len, self._cache.values())) > MAX_CACHED:
                oldest = next(iter(self._cache))
                self._cache[oldest].pop(0)
                if not self._cache[oldest]:
                    del self._cache[oldest]

    def reduce(self, buffer: torch.Tensor, start_reduce: StartReduce) -> None:
        """Copy `buffer` to the host piece by piece, reduce each piece there as soon as it has
        arrived, and copy each result back as soon as it is ready.

        If a reduction fails, the pieces reduced before it are already back in `buffer` (a
        partly reduced buffer, as the group's contract allows: callers pass copies), the
        others are left as they were, the staging tensor is dropped and the error raised.
        """
        self.start(buffer, start_reduce)()

    def start(self, buffer: torch.Tensor, start_reduce: StartReduce) -> Wait:
        """`reduce` in two halves: copy `buffer` to the host and start reducing its pieces
        (returns once the last is started), then, in what this returns, wait for each and
        copy it back. Several buffers may be started before the first is waited for (the
        pieces of overlap.py); call the waits in the order started, on the same stream."""
        key, host = self._take(buffer)
        pinned = key[2]  # pinned host memory: both copies may be asynchronous
        per_piece = max(self.piece_bytes // buffer.element_size(), 1)
        if buffer.numel() < MIN_PIECES * per_piece:
            per_piece = max(buffer.numel(), 1)
        pieces = list(zip(buffer.view(-1).split(per_piece), host.view(-1).split(per_piece),
                          strict=True))
        waits: list[Wait] = []
        finished = 0

        def drain() -> None:
            for wait in waits[finished:]:  # the group is aborted by now: each ends at once
                try:
                    wait()
                except Exception:  # noqa: BLE001,S110 (the first failure is the one raised)
                    pass

        try:
            for device_piece, host_piece in pieces:
                # The buffer was produced on the current stream: the copy is queued behind it,
                # and the synchronize makes its bytes visible to the host before gloo reads
                # them. While this piece copies, the pieces started before it are reduced.
                host_piece.copy_(device_piece, non_blocking=pinned)
                _synchronize(buffer.device)
                waits.append(start_reduce(host_piece))
        except BaseException:
            drain()
            raise

        def wait() -> None:
            nonlocal finished
            try:
                for (device_piece, host_piece), piece_wait in zip(pieces, waits, strict=True):
                    finished += 1
                    piece_wait()
                    device_piece.copy_(host_piece, non_blocking=pinned)
            except BaseException:
                drain()
                raise
            # Also wait for the copies back: the host tensor is reused by the next reduce,
            # and the caller may read `buffer` from another stream or the host right away.
            _synchronize(buffer.device)
            self._give_back(key, host)

        return wait

    def clear(self) -> None:
        with self._lock:
            self._cache.clear()


_SHARED = HostStaging()


def shared_staging() -> HostStaging:
    """The process's staging cache: groups are rebuilt every generation, their buffers'
    shapes are not, so the pinned tensors outlive any one group."""
    return _SHARED


def staged_reduce(buffer: torch.Tensor, start_reduce: StartReduce,
                  staging: HostStaging | None = None, force: bool = False) -> None:
    """Reduce `buffer` with a host-only reduction: in place when it is a host tensor,
    through host copies when it lives on a device (or when `force`, to test that path)."""
    staged_start(buffer, start_reduce, staging, force)()


def staged_start(buffer: torch.Tensor, start_reduce: StartReduce,
                 staging: HostStaging | None = None, force: bool = False) -> Wait:
    """`staged_reduce` started: what it returns waits for the result (HostStaging.start)."""
    if not (force or needs_staging(buffer)):
        return start_reduce(buffer)
    return (staging if staging is not None else _SHARED).start(buffer, start_reduce)


def blocking(reduce_host: Callable[[torch.Tensor], None]) -> StartReduce:
    """A reduction that is done when it returns, as a `StartReduce` (tests, simple callers)."""
    def start(host: torch.Tensor) -> Wait:
        reduce_host(host)
        return lambda: None
    return start
