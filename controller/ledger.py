"""The job's ledger as a leader holds it: one record per committed step, in order, with the
failures each step's commit carried and the parameter digests the replicas reported after
applying it.

A failure goes in the record of the first step committed after it was seen, so the ledger
also knows which of the job's failures no record holds yet (they ride with the next
commit). The records are persisted by controller/records.py; this holds them in memory and
judges the replicas' `Applied` reports against them.
"""

from __future__ import annotations

from collections.abc import Sequence
from enum import StrEnum

from recover.proto import pb


class AppliedVerdict(StrEnum):
    """What a replica's report of having applied a step did to the ledger."""

    STALE = "stale"
    """Of a step this ledger has no record of (a report sent to an older leader)."""
    KNOWN = "known"
    """Its digest was recorded already (replayed to a new leader that had it from the store)."""
    RECORDED = "recorded"
    """Its digest is in the step's record now, the same as every other replica's."""
    DIVERGED = "diverged"
    """Recorded, and another replica reported other parameters after the same step."""


class Ledger:
    def __init__(self) -> None:
        self.steps: list[pb.StepRecord] = []
        """The committed steps' records, step 0 first (a resumed job: from its checkpoint)."""
        self._failures_held = 0
        """How many of the job's failures (in order) the records hold."""
        self._commit_waits: dict[int, list[float]] = {}
        """Per step: the replicas' reported waits for its commit, sorted (its median is kept)."""

    @property
    def last(self) -> pb.StepRecord | None:
        return self.steps[-1] if self.steps else None

    def load(self, steps: Sequence[pb.StepRecord]) -> None:
        """The records a new leader or a resumed job starts from."""
        self.steps = list(steps)
        self._failures_held = sum(len(r.failures) for r in self.steps)

    def failures(self) -> list[pb.FailureRecord]:
        """Every failure the records hold, in order."""
        return [f for record in self.steps for f in record.failures]

    def unrecorded(self, failures: Sequence[pb.FailureRecord]) -> tuple[pb.FailureRecord, ...]:
        """The failures (of all the job's, in order) that no record holds yet."""
        return tuple(failures[self._failures_held:])

    def committed(self, record: pb.StepRecord) -> None:
        self.steps.append(record)
        self._failures_held += len(record.failures)

    def applied(self, replica: int, msg: pb.Applied) -> AppliedVerdict:
        """Record `replica`'s parameter digest after step `msg.step` (and its commit wait)."""
        if not 0 <= msg.step < len(self.steps):
            return AppliedVerdict.STALE
        record = self.steps[msg.step]
        if any(d.replica == replica for d in record.param_sha256):
            return AppliedVerdict.KNOWN
        record.param_sha256.append(pb.ReplicaDigest(replica=replica, param_sha256=msg.param_sha256))
        waits = sorted([*self._commit_waits.get(msg.step, []), msg.commit_wait_s])
        self._commit_waits[msg.step] = waits
        record.commit_wait_s = waits[len(waits) // 2]
        if len({d.param_sha256 for d in record.param_sha256}) > 1:
            return AppliedVerdict.DIVERGED
        return AppliedVerdict.RECORDED
