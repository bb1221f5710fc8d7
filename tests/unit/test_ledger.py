"""The ledger a leader holds (controller/ledger.py): which failures its records hold, and the
replicas' Applied reports judged against it, table-style."""

from __future__ import annotations

import pytest

from recover.controller.ledger import AppliedVerdict, Ledger
from recover.proto import pb


def failure(step: int) -> pb.FailureRecord:
    return pb.FailureRecord(step=step, replica=1, phase="forward")


def test_failures_ride_with_the_next_commit_and_a_load_counts_those_held() -> None:
    ledger = Ledger()
    seen = [failure(0), failure(0)]
    assert ledger.unrecorded(seen) == tuple(seen) and ledger.last is None
    ledger.committed(pb.StepRecord(step=0, failures=seen))
    seen.append(failure(1))
    assert ledger.unrecorded(seen) == (seen[2],) and ledger.last.step == 0
    resumed = Ledger()
    resumed.load(ledger.steps)
    assert resumed.failures() == seen[:2] and resumed.unrecorded(seen) == (seen[2],)


@pytest.mark.parametrize(("reports", "verdicts", "median_wait"), [
    ([(0, 0, "a", 0.1)], ["recorded"], 0.1),
    ([(0, 0, "a", 0.1), (1, 0, "a", 0.3), (2, 0, "a", 0.2)],
     ["recorded", "recorded", "recorded"], 0.2),
    ([(0, 0, "a", 0.1), (0, 0, "a", 0.9)], ["recorded", "known"], 0.1),  # a replay
    ([(0, 0, "a", 0.1), (1, 0, "b", 0.1)], ["recorded", "diverged"], 0.1),
    ([(0, 5, "a", 0.1), (0, -1, "a", 0.1)], ["stale", "stale"], 0.0),
])
def test_applied_reports(reports: list[tuple[int, int, str, float]], verdicts: list[str],
                         median_wait: float) -> None:
    ledger = Ledger()
    ledger.committed(pb.StepRecord(step=0))
    got = [ledger.applied(replica, pb.Applied(step=step, param_sha256=digest, commit_wait_s=wait))
           for replica, step, digest, wait in reports]
    assert got == [AppliedVerdict(v) for v in verdicts]
    assert ledger.steps[0].commit_wait_s == pytest.approx(median_wait)
