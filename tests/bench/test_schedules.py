"""Failure schedules: the shipped files parse, bad files fail in one line, generators are right."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from recover.bench import schedules
from recover.bench.ckpt_policy import CheckpointPolicy, checkpoint_due, young_daly_interval_s
from recover.bench.schedules import ScheduleError

SHIPPED = Path(__file__).resolve().parents[2] / "bench" / "schedules"


@pytest.mark.parametrize("name", ["lose-half.json", "steady.json"])
def test_shipped_schedules_parse(name):
    schedule = schedules.load(SHIPPED / name, 4)
    assert schedule.events
    assert all(schedule.alive_slots(e.at_s) >= 1 for e in schedule.events)


def test_lose_half_loses_half_one_at_a_time_never_back():
    s = schedules.from_dict({"kind": "lose-half", "first_at_s": 5, "interval_s": 10}, 6)
    assert [(e.at_s, e.slot, e.returns_at_s) for e in s.events] == [
        (5.0, 5, None), (15.0, 4, None), (25.0, 3, None)]
    assert s.alive_slots(0) == 6 and s.alive_slots(30) == 3
    # 6 slots for 5 s, 5 for 10 s, 4 for 10 s, 3 for 5 s
    assert s.alive_slot_seconds(0, 30) == pytest.approx(6 * 5 + 5 * 10 + 4 * 10 + 3 * 5)


def test_steady_is_deterministic_and_repairs():
    raw = {"kind": "steady", "mtbf_s": 20, "repair_s": 5, "seed": 3, "horizon_s": 200}
    a, b = schedules.from_dict(raw, 4), schedules.from_dict(raw, 4)
    assert a.events == b.events and len(a.events) > 4
    assert all(e.returns_at_s == pytest.approx(e.at_s + 5) for e in a.events)
    assert a.system_mtbf_s() == 5.0  # 20 s per slot, 4 slots


@pytest.mark.parametrize("raw, message", [
    ([], "expected a JSON object"),
    ({"kind": "nope"}, "'kind' must be one of"),
    ({"kind": "lose-half", "first_at_s": 1}, "missing 'interval_s'"),
    ({"kind": "lose-half", "first_at_s": -1, "interval_s": 1}, "must be >= 0"),
    ({"kind": "lose-half", "first_at_s": "x", "interval_s": 1}, "must be a number"),
    ({"kind": "steady", "mtbf_s": 10, "repair_s": 1, "extra": 1}, "unknown key(s) ['extra']"),
    ({"kind": "steady", "mtbf_s": 10, "seed": 1.5}, "'seed' must be an integer"),
    ({"kind": "explicit", "events": []}, "non-empty list"),
    ({"kind": "explicit", "events": [{"at_s": 1, "slot": 9}]}, "'slot' must be an integer in 0..3"),
    ({"kind": "explicit", "events": [{"at_s": 1, "slot": 1}, {"at_s": 2, "slot": 1}]},
     "fails at 2s while already down"),
    ({"kind": "explicit", "events": [{"at_s": i, "slot": i} for i in range(4)]},
     "every slot is down"),
])
def test_bad_schedules_fail_in_one_line(raw, message):
    with pytest.raises(ScheduleError) as info:
        schedules.from_dict(raw, 4)
    assert message in str(info.value) and "\n" not in str(info.value)


def test_bad_files(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ScheduleError, match="not valid JSON"):
        schedules.load(bad, 4)
    with pytest.raises(ScheduleError, match="No such file"):
        schedules.load(tmp_path / "missing.json", 4)
    ok = tmp_path / "ok.json"
    ok.write_text(json.dumps({"kind": "explicit", "events": [{"at_s": 1, "slot": 0, "repair_s": 2}]}))
    assert schedules.load(ok, 2).events[0].returns_at_s == 3.0


def test_young_daly_and_checkpoint_policy():
    assert young_daly_interval_s(0.5, 100) == pytest.approx(10.0)  # sqrt(2 * 0.5 * 100)
    yd = CheckpointPolicy(system_mtbf_s=100)
    assert checkpoint_due(yd, 1, 0.0, float("nan"))[0]  # first one measures the cost
    assert not checkpoint_due(yd, 5, 9.9, 0.5)[0]
    due, reason = checkpoint_due(yd, 5, 10.1, 0.5)
    assert due and "Young-Daly" in reason
    assert checkpoint_due(CheckpointPolicy(every_steps=3), 6, 0, 0)[0]
    assert not checkpoint_due(CheckpointPolicy(every_steps=3), 7, 0, 0)[0]
    assert not checkpoint_due(CheckpointPolicy(), 7, 1e9, 0)[0]
