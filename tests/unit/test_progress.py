"""The progress file and the hang verdict (common/progress.py)."""

from __future__ import annotations

import multiprocessing
import time
from pathlib import Path

import pytest

from recover.common import progress
from recover.common.progress import ProgressBeacon, ProgressSnapshot, judge

NOW = 100.0
TIMEOUT = 2.0
FACTOR = 10.0


def snap(beat_at: float, computing: bool = False, started: float = 0.0, typical: float = 0.0,
         microbatches: int | None = None) -> ProgressSnapshot:
    if microbatches is None:  # a typical time exists once a microbatch finished
        microbatches = 1 if typical > 0 else 0
    return ProgressSnapshot(beat_at, computing, started, typical, microbatches)


JUDGE_ROWS = [
    pytest.param(snap(0.0), False, "not started yet", id="not-started"),
    pytest.param(snap(0.0, computing=True, started=1.0, typical=0.1), False, "not started yet",
                 id="not-started-ignores-stale-compute"),
    pytest.param(snap(99.9), False, "alive, not computing", id="fresh-beat-idle"),
    pytest.param(snap(99.9, started=10.0, typical=0.1), False, "alive, not computing",
                 id="idle-long-after-last-microbatch"),
    pytest.param(snap(97.0), True, "no liveness beat for 3.0s (bound 2.0s)", id="stale-beat-stopped"),
    pytest.param(snap(97.0, computing=True, started=99.5, typical=0.1), True, "no liveness beat",
                 id="stale-beat-wins-over-compute"),
    pytest.param(snap(98.0), False, "alive", id="beat-exactly-at-timeout"),
    pytest.param(snap(97.99), True, "no liveness beat", id="beat-just-past-timeout"),
    pytest.param(snap(99.95, computing=True, started=99.0, typical=0.1), False,
                 "computing for 1.00s of 2.0s", id="computing-within-timeout"),
    pytest.param(snap(99.95, computing=True, started=97.5, typical=0.1), True,
                 "one microbatch has run for 2.5s (bound 2.0s = max(2.0s, 10 x typical 100ms))",
                 id="computing-beyond-timeout-spin-or-deadlock"),
    pytest.param(snap(99.95, computing=True, started=98.0, typical=0.1), False,
                 "computing for 2.00s of 2.0s", id="computing-exactly-at-bound"),
    pytest.param(snap(99.95, computing=True, started=97.99, typical=0.1), True,
                 "one microbatch has run for 2.0s", id="computing-just-past-bound"),
    pytest.param(snap(99.95, computing=True, started=95.0, typical=1.0), False,
                 "computing for 5.00s of 10.0s", id="slow-but-alive-factor-dominates"),
    pytest.param(snap(99.95, computing=True, started=89.5, typical=1.0), True,
                 "bound 10.0s = max(2.0s, 10 x typical 1000ms)", id="beyond-factor-times-typical"),
    pytest.param(snap(99.95, computing=True, started=99.0, typical=0.0), False,
                 "first microbatch for 1.00s of 120s", id="first-microbatch-no-typical-yet"),
    pytest.param(snap(99.95, computing=True, started=90.0, typical=0.0), False,
                 "first microbatch for 10.00s of 120s", id="first-microbatch-warms-up-slowly"),
    pytest.param(snap(99.95, computing=True, started=-30.0, typical=0.0), True,
                 "its first microbatch has run for 130.0s (bound 120s)",
                 id="first-microbatch-beyond-its-grace"),
]


@pytest.mark.parametrize(("snapshot", "hung", "reason"), JUDGE_ROWS)
def test_judge(snapshot, hung, reason):
    verdict = judge(snapshot, NOW, TIMEOUT, FACTOR)
    assert verdict.hung is hung, verdict
    assert reason in verdict.reason, verdict.reason


def test_judge_factor_and_timeout_are_used():
    s = snap(99.95, computing=True, started=95.0, typical=1.0)
    assert not judge(s, NOW, TIMEOUT, 10.0).hung
    assert judge(s, NOW, TIMEOUT, 4.0).hung  # bound max(2, 4) = 4 < 5
    assert not judge(s, NOW, 6.0, 4.0).hung  # bound max(6, 4) = 6 > 5
    assert judge(snap(97.0), NOW, 2.5, FACTOR).hung
    assert not judge(snap(97.0), NOW, 3.5, FACTOR).hung


# ---------------------------------------------------------------- the file itself

def test_read_missing_or_short_file(tmp_path):
    assert progress.read(tmp_path / "absent") is None
    short = tmp_path / "short"
    short.write_bytes(b"\0" * (progress.SIZE - 1))
    assert progress.read(short) is None
    fresh = tmp_path / "fresh"
    progress.create(fresh)
    assert fresh.stat().st_size == progress.SIZE
    assert progress.read(fresh) == ProgressSnapshot(0.0, False, 0.0, 0.0, 0, 0.0)
    assert not judge(progress.read(fresh), time.monotonic(), TIMEOUT, FACTOR).hung


def wait_for(predicate, timeout: float = 2.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.01)
    raise AssertionError("condition not met in time")


def test_beacon_beats_marks_compute_and_stops(tmp_path):
    path = tmp_path / "progress"
    progress.create(path)
    beacon = ProgressBeacon(path)
    try:
        first = wait_for(lambda: (s := progress.read(path)) and s.beat_at > 0 and s)
        assert abs(first.beat_at - time.monotonic()) < 1.0
        assert not first.computing and first.microbatches == 0
        time.sleep(0.3)
        later = progress.read(path)
        assert later.beat_at > first.beat_at + 0.15  # beats every 0.1 s
        assert later.beat_at <= time.monotonic()
        assert not judge(later, time.monotonic(), TIMEOUT, FACTOR).hung

        before = time.monotonic()
        beacon.compute_started()
        during = progress.read(path)
        assert during.computing
        assert before <= during.compute_started_at <= time.monotonic()
        assert "first microbatch for" in judge(during, time.monotonic(), TIMEOUT, FACTOR).reason
        time.sleep(0.03)
        beacon.compute_finished()
        after = progress.read(path)
        assert not after.computing
        assert after.microbatches == 1
        assert 0.03 <= after.typical_microbatch_s < 1.0
        assert after.compute_started_at == during.compute_started_at
        first_typical = after.typical_microbatch_s

        beacon.compute_started()
        beacon.compute_finished()  # ~0 s: the moving average moves 20% of the way
        second = progress.read(path)
        assert second.microbatches == 2
        assert 0.75 * first_typical <= second.typical_microbatch_s <= 0.85 * first_typical

        wall = time.time()
        beacon.mark_killed()
        assert abs(progress.read(path).killed_at - wall) < 1.0
    finally:
        beacon.close()
    assert not beacon._thread.is_alive(), "close() returned with the beat thread still running"
    assert beacon._map.closed
    stopped = progress.read(path).beat_at
    time.sleep(0.3)
    assert progress.read(path).beat_at == stopped, "beats went on after close()"
    assert judge(progress.read(path), stopped + TIMEOUT + 0.5, TIMEOUT, FACTOR).hung


def _busy_writer(path: str, seconds: float) -> None:
    beacon = ProgressBeacon(Path(path))
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        beacon.compute_started()
        beacon.compute_finished()
    beacon.close()


def test_reader_never_sees_a_half_written_snapshot(tmp_path):
    """A reader racing a busy writer process sees each field either old or new,
    never a state that no write produced. (struct.pack_into zero-fills before it
    packs: the watchdog once read "computing since 0" in a failure-free run.)"""
    path = tmp_path / "progress"
    progress.create(path)
    writer = multiprocessing.get_context("spawn").Process(target=_busy_writer,
                                                          args=(str(path), 3.0))
    writer.start()
    reads, count, torn = 0, 0, []
    try:
        wait_for(lambda: (s := progress.read(path)) and s.microbatches > 0, timeout=30)
        while writer.is_alive() and reads < 300_000:
            s = progress.read(path)
            reads += 1
            if (s.computing and s.compute_started_at <= 0) or s.microbatches < count or (
                    s.microbatches > 0 and s.typical_microbatch_s <= 0) or s.beat_at <= 0:
                torn.append(s)
            count = s.microbatches
    finally:
        writer.join(10)
    assert reads > 10_000, "the writer ended before the reader got going"
    assert torn == [], f"{len(torn)} of {reads} reads were half-written, e.g. {torn[0]}"


def test_the_first_microbatch_grace_is_the_jobs_own():
    """--first-microbatch-grace: a job whose first microbatch compiles for minutes says so."""
    slow_start = snap(99.95, computing=True, started=-30.0, typical=0.0)  # 130 s so far
    assert not judge(slow_start, 100.0, 2.0, 10.0, first_grace_s=300.0).hung
    verdict = judge(slow_start, 100.0, 2.0, 10.0, first_grace_s=60.0)
    assert verdict.hung and "(bound 60s)" in verdict.reason
