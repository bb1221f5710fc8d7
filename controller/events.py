"""The job's event log: what happened, when, to whom — for `recover events`."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from recover.controller.records import KeyValue, Records
from recover.proto import pb

log = logging.getLogger("recover.controller")


class EventLog:
    """Append-only, numbered events, mirrored into the job's records.

    Events are written to the store behind the critical path: losing the
    last few on a crash costs a line in `recover events`, never correctness.
    """

    def __init__(self, records: Records, clock: Callable[[], float] = time.time) -> None:
        self._records = records
        self._clock = clock
        self._events: list[pb.Event] = []
        self._pending: list[KeyValue] = []

    def emit(
        self,
        kind: str,
        message: str,
        *,
        step: int = -1,
        generation: int = -1,
        replica: int = -1,
        level: int = logging.INFO,
        pid: int = 0,
    ) -> pb.Event:
        event = pb.Event(
            seq=len(self._events) + 1,
            at=self._clock(),
            kind=kind,
            step=step,
            generation=generation,
            replica=replica,
            message=message,
            pid=pid,
        )
        self._events.append(event)
        self._pending.append(self._records.event_write(event))
        log.log(
            level,
            "%s: %s",
            kind,
            message,
            extra={"step": step, "generation": generation, "replica": replica},
        )
        return event

    def defer(self, write: KeyValue) -> None:
        """Write this with the next flush (off the critical path, like the events)."""
        self._pending.append(write)

    def restore(self, events: list[pb.Event]) -> None:
        """Continue the log a previous leader persisted (numbering goes on from its last event)."""
        self._events = sorted(events, key=lambda e: e.seq)

    async def flush(self) -> None:
        """Persist the events emitted since the last flush."""
        if self._pending:
            await self._records.put_many(self.take_pending())

    def take_pending(self) -> list[KeyValue]:
        """The writes waiting for the next flush, handed over to ride along with a write the
        caller makes anyway (a new generation): what led to it is then never lost with a
        leader that is deposed right after."""
        pending, self._pending = self._pending, []
        return pending

    def since(self, after_seq: int) -> list[pb.Event]:
        return self._events[max(after_seq, 0):]

    def __len__(self) -> int:
        return len(self._events)
