"""A worker's progress, shared with its agent through a small mapped file.

The worker writes; the agent reads. Nothing crosses a socket, so the
failure-free path pays a few stores per microbatch. Times are
`time.monotonic()` (CLOCK_MONOTONIC: one clock for every process of a host).

Two signals tell hangs apart from slowness:
* a **beat** written every BEAT_PERIOD_S by a side thread: it stops when the
  process is stopped (SIGSTOP) or a C call holds the GIL;
* the **compute phase** (start time of the microbatch being computed, and the
  typical microbatch time): it overruns when the main thread deadlocks or
  loops, even though the side thread still beats.
Waiting for peers or for the controller is not computing and is never
judged here: a peer's hang is that peer's agent's business.
"""

from __future__ import annotations

import mmap
import os
import struct
import threading
import time
from dataclasses import dataclass
from pathlib import Path

BEAT_PERIOD_S = 0.1
FIRST_MICROBATCH_GRACE_S = 120.0
"""Bound on a worker's first microbatch, before it has a typical time: the first one pays
for warm-up (allocator, kernels, torch.compile, a lazy data load) and may take a while."""
# beat_at, computing, compute_started_at, typical_s, microbatches, killed_at (wall clock)
_LAYOUT = struct.Struct("<6d")
SIZE = _LAYOUT.size
_BEAT_AT, _COMPUTING, _COMPUTE_STARTED_AT, _TYPICAL, _MICROBATCHES, _KILLED_AT = range(0, SIZE, 8)


@dataclass(frozen=True)
class ProgressSnapshot:
    beat_at: float
    """Last liveness beat (monotonic seconds); 0 before the worker's first beat."""
    computing: bool
    compute_started_at: float
    typical_microbatch_s: float
    """Moving average of this worker's microbatch time (0 until one finished)."""
    microbatches: int
    killed_at: float = 0.0
    """Unix time at which the worker SIGKILLed itself (fault injection), else 0."""


def create(path: Path) -> None:
    path.write_bytes(bytes(SIZE))


def read(path: Path) -> ProgressSnapshot | None:
    try:
        data = path.read_bytes()
    except OSError:
        return None
    if len(data) < SIZE:
        return None
    beat, computing, started, typical, count, killed_at = _LAYOUT.unpack_from(data)
    return ProgressSnapshot(beat, computing > 0.5, started, typical, int(count), killed_at)


@dataclass(frozen=True)
class HangVerdict:
    hung: bool
    reason: str


def judge(snapshot: ProgressSnapshot, now: float, timeout_s: float, factor: float,
          first_grace_s: float = FIRST_MICROBATCH_GRACE_S) -> HangVerdict:
    """Is the worker hung? A pure decision with its reason (see the module docstring).
    `first_grace_s`: the bound on its first microbatch (the job's --first-microbatch-grace)."""
    if snapshot.beat_at <= 0:
        return HangVerdict(False, "not started yet")
    silent = now - snapshot.beat_at
    if silent > timeout_s:
        return HangVerdict(True, f"no liveness beat for {silent:.1f}s (bound {timeout_s:.1f}s): "
                                 "the process is stopped or a call holds the GIL")
    if snapshot.computing:
        running = now - snapshot.compute_started_at
        if snapshot.microbatches == 0:
            bound = max(timeout_s, first_grace_s)
            if running > bound:
                return HangVerdict(True, f"its first microbatch has run for {running:.1f}s "
                                         f"(bound {bound:.0f}s)")
            return HangVerdict(False, f"first microbatch for {running:.2f}s of {bound:.0f}s")
        bound = max(timeout_s, factor * snapshot.typical_microbatch_s)
        if running > bound:
            return HangVerdict(True, f"one microbatch has run for {running:.1f}s (bound {bound:.1f}s "
                                     f"= max({timeout_s:.1f}s, {factor:g} x typical "
                                     f"{snapshot.typical_microbatch_s * 1000:.0f}ms))")
        return HangVerdict(False, f"computing for {running:.2f}s of {bound:.1f}s")
    return HangVerdict(False, "alive, not computing")


class ProgressBeacon:
    """The worker's writer: a beat thread plus compute-phase markers."""

    EMA_WEIGHT = 0.2

    def __init__(self, path: Path) -> None:
        fd = os.open(path, os.O_RDWR)
        try:
            self._map = mmap.mmap(fd, SIZE)
        finally:
            os.close(fd)
        self._typical = 0.0
        self._count = 0
        self._started = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="progress-beat", daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        while not self._stop.is_set():
            self._write(_BEAT_AT, time.monotonic())
            self._stop.wait(BEAT_PERIOD_S)

    def _write(self, offset: int, *values: float) -> None:
        # Not struct.pack_into: it zero-fills its target before packing, and a
        # reader in that window saw "computing since 0" (measured: ~1 in 20,000
        # reads under a busy writer), which the watchdog took for a hang.
        self._map[offset:offset + 8 * len(values)] = struct.pack(f"<{len(values)}d", *values)

    def compute_started(self) -> None:
        # The start time lands before the flag: whoever sees the flag sees this start.
        self._started = time.monotonic()
        self._write(_COMPUTE_STARTED_AT, self._started)
        self._write(_COMPUTING, 1.0)

    def compute_finished(self) -> None:
        took = time.monotonic() - self._started
        self._typical = took if self._count == 0 else (
            (1 - self.EMA_WEIGHT) * self._typical + self.EMA_WEIGHT * took)
        self._count += 1
        self._write(_COMPUTING, 0.0)
        self._write(_TYPICAL, self._typical, float(self._count))

    def mark_killed(self) -> None:
        """Stamp the moment of an injected kill, right before it (no RPC in between)."""
        self._write(_KILLED_AT, time.time())

    def close(self) -> None:
        """Stop beating and unmap; the watchdog then sees the beat age grow (the worker is exiting)."""
        self._stop.set()
        self._thread.join(timeout=2 * BEAT_PERIOD_S)
        if not self._thread.is_alive():  # never unmap under a writer
            self._map.close()
