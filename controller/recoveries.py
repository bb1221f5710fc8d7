"""Failure records and how long each recovery took, phase by phase.

A recovery is timed from the first failure it handles: *detect* (kill to the
controller noticing), *plan* (noticing to the new generation), *rebuild* (the
slowest survivor's group rebuild), *recompute* (survivors computing again to
the commit record's write) and *commit* (that write). The coordinator feeds it
the moments; it keeps the records, persists them off the step's critical path
(batched with the events) and announces each recovery.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection

from recover.controller.events import EventLog
from recover.controller.records import Records
from recover.proto import pb

PHASES = ("detect", "plan", "rebuild", "recompute", "commit")


def observed_phase(replica: int, *, started: bool, resumed: Collection[int],
                   reduced: Collection[int]) -> str:
    """Where a replica that failed without saying so was, as the controller saw it."""
    if not started:
        return "startup"
    if replica not in resumed:
        return "rebuild"
    return "commit" if replica in reduced else "compute"


class RecoveryTracker:
    def __init__(self, events: EventLog, records: Records, clock: Callable[[], float]) -> None:
        self._events = events
        self._records = records
        self._clock = clock
        self.failures: list[pb.FailureRecord] = []
        self.timings: list[dict[str, float]] = []
        """Seconds per phase of each finished recovery, for metrics."""
        self._unrecovered: list[pb.FailureRecord] = []
        self._pending: dict[str, float] | None = None
        self._generation_started_at = 0.0
        self._rebuild_s: dict[int, float] = {}

    def failed(self, replica: int, cause: str, exited: pb.WorkerExited | None, *, step: int,
               generation: int, phase: str, during_training: bool) -> None:
        """Record a replica's failure; one during training opens (or joins) the recovery in
        progress. An injected fault knows its own step, phase and moment better than we do."""
        failure = pb.FailureRecord(step=step, replica=replica, cause=cause, phase=phase,
                                   detected_at=self._clock(), generation=generation)
        if exited is not None and exited.HasField("error"):
            failure.error.CopyFrom(exited.error)
        if exited is not None and exited.HasField("fault"):
            failure.phase = exited.fault.phase
            failure.killed_at = exited.fault.killed_at
            failure.step = exited.fault.step
        self.failures.append(failure)
        self._events.defer(self._records.failure_write(len(self.failures), failure))
        if during_training:
            self._unrecovered.append(failure)
        detail = f" ({exited.killed_by_agent})" if exited is not None and exited.killed_by_agent else ""
        if failure.HasField("error"):
            detail = f": {failure.error.message}"
        self._events.emit("replica-failed", f"{cause} failure in phase {failure.phase}{detail}",
                          step=failure.step, generation=generation, replica=replica,
                          level=logging.WARNING)

    def generation_started(self) -> None:
        self._generation_started_at = self._clock()
        self._rebuild_s = {}

    def resumed(self, replica: int, at: float, rebuild_s: float, resumed: set[int],
                members: list[int], step: int, generation: int) -> None:
        """`replica` computes again; once every member does, the open recovery is over."""
        self._rebuild_s[replica] = rebuild_s
        if not self._unrecovered or not resumed >= set(members):
            return
        for failure in self._unrecovered:
            failure.recovered_at = at
        first = self._unrecovered[0]
        self._pending = {
            "detect": first.detected_at - first.killed_at if first.killed_at else 0.0,
            "plan": max(self._generation_started_at - first.detected_at, 0.0),
            "rebuild": max(self._rebuild_s.values(), default=0.0),
            "resumed_at": at,
        }
        self._events.emit(
            "recovered",
            f"all {len(members)} survivors compute again in generation {generation}, "
            f"{at - first.detected_at:.3f}s after detection",
            step=step, generation=generation)
        self._unrecovered.clear()

    def committed(self, write_started_at: float) -> None:
        """The step after a recovery was written to the store: the recovery's timing is complete."""
        if self._pending is None:
            return
        timing, self._pending = self._pending, None
        resumed_at = timing.pop("resumed_at")
        timing["recompute"] = max(write_started_at - resumed_at, 0.0)
        timing["commit"] = self._clock() - write_started_at
        self.timings.append(timing)
