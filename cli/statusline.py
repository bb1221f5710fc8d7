"""`recover run`'s display: one live status line on a terminal, the events that matter above it."""

from __future__ import annotations

import sys
import time
from typing import IO

from recover.cli.inspect import format_event, format_load
from recover.proto import pb

TERMINAL = ("succeeded", "failed", "stopped")
SHOWN_EVENTS = ("replica-failed", "generation", "recovered", "agent-lost", "failed", "divergence",
                "replica-joined", "spare-promoted", "state-transfer", "join-abandoned",
                "checkpoint-written", "checkpoint-failed", "resumed")


class Progress:
    """One live status line on a terminal; periodic lines otherwise. Events go above it."""

    def __init__(self, enabled: bool, stream: IO[str] = sys.stderr) -> None:
        self.enabled = enabled
        self.stream = stream
        self.tty = stream.isatty()
        self._last_line = 0.0
        self._width = 0

    def event(self, event: pb.Event) -> None:
        if self.enabled and event.kind in SHOWN_EVENTS:
            self._clear()
            print(format_event(event), file=self.stream, flush=True)

    def status(self, status: pb.JobStatus) -> None:
        if not self.enabled or status.state == "waiting":
            return
        load = format_load(status.load)
        joining = f"+{len(status.joining)} joining  " if status.joining else ""
        line = (f"step {status.steps_committed}/{status.steps_total}  loss {status.last_loss:.4f}"
                f"  gen {status.generation}  live {len(status.live_replicas)}  {joining}"
                f"microbatches [{load}]  recoveries {status.recoveries}  {status.elapsed_s:.1f}s")
        if self.tty:
            self._clear()
            self.stream.write(line)
            self.stream.flush()
            self._width = len(line)
        elif time.monotonic() - self._last_line > 2.0 or status.state in TERMINAL:
            print(line, file=self.stream, flush=True)
            self._last_line = time.monotonic()

    def _clear(self) -> None:
        if self.tty and self._width:
            self.stream.write("\r" + " " * self._width + "\r")
            self._width = 0

    def done(self) -> None:
        if self.tty and self._width:
            self.stream.write("\n")
            self._width = 0
