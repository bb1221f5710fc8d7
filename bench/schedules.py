"""Failure schedules for the benchmarks: JSON files turned into concrete failure events.

A schedule file is one JSON object with a "kind":

* ``lose-half``: ``{"kind": "lose-half", "first_at_s": 10, "interval_s": 10}`` -
  replicas fail one at a time until half of them are gone; none is replaced
  (the paper's setting). Slot ``replicas - 1`` fails first, then ``replicas - 2``...
* ``steady``: ``{"kind": "steady", "mtbf_s": 60, "repair_s": 20, "seed": 0,
  "horizon_s": 600}`` - every slot fails independently with exponential
  inter-arrival times of mean ``mtbf_s`` (per slot); a failed slot comes back
  ``repair_s`` later (``null``: never). Deterministic for a given seed.
* ``explicit``: ``{"kind": "explicit", "events": [{"at_s": 5, "slot": 1,
  "repair_s": null}, ...]}``.

Times are seconds after the system under test committed its first step, so
that both systems meet each failure at the same point of training time
rather than during their (different) start-up.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any


class ScheduleError(ValueError):
    """A schedule file that cannot be used; the message is one line saying why."""


@dataclass(frozen=True)
class FailureEvent:
    """One slot failing at one time."""

    at_s: float
    """Seconds after the first committed step."""
    slot: int
    """Which slot (replica index at start) fails."""
    returns_at_s: float | None = None
    """When the slot is usable again (repaired); None: never."""


@dataclass(frozen=True)
class Schedule:
    """A materialised schedule for a job of `replicas` slots."""

    kind: str
    """lose-half | steady | explicit."""
    replicas: int
    """Slots at start."""
    events: tuple[FailureEvent, ...]
    """Failures ordered by time; a slot never fails again while it is down."""
    mtbf_s: float | None = None
    """Per-slot mean time between failures, when the schedule states one (Young-Daly input)."""

    def system_mtbf_s(self) -> float | None:
        """Mean time between failures of the whole job: stated, or estimated from the events."""
        if self.mtbf_s is not None:
            return self.mtbf_s / self.replicas
        if len(self.events) >= 2:
            return (self.events[-1].at_s - self.events[0].at_s) / (len(self.events) - 1)
        return self.events[0].at_s if self.events else None

    def alive_slots(self, t: float) -> int:
        """Slots not failed at time t (repaired slots count again)."""
        down = sum(1 for e in self.events
                   if e.at_s <= t and (e.returns_at_s is None or e.returns_at_s > t))
        return self.replicas - down

    def alive_slot_seconds(self, start: float, end: float) -> float:
        """Integral of alive_slots over [start, end] (exact: it is piecewise constant)."""
        cuts = sorted({start, end, *(e.at_s for e in self.events),
                       *(e.returns_at_s for e in self.events if e.returns_at_s is not None)})
        cuts = [c for c in cuts if start <= c <= end]
        return sum(self.alive_slots(a) * (b - a) for a, b in zip(cuts, cuts[1:], strict=False))


def _number(raw: dict[str, Any], key: str, where: str, *, default: float | None = None,
            allow_none: bool = False, minimum: float = 0.0) -> float | None:
    if key not in raw:
        if default is None and not allow_none:
            raise ScheduleError(f"{where}: missing {key!r}")
        return default
    value = raw[key]
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ScheduleError(f"{where}: {key!r} must be a number, got {value!r}")
    if value < minimum:
        raise ScheduleError(f"{where}: {key!r} must be >= {minimum:g}, got {value!r}")
    return float(value)


def lose_half(replicas: int, first_at_s: float, interval_s: float) -> tuple[FailureEvent, ...]:
    """Half the slots (rounded down), one every interval_s, highest slot first; never back."""
    return tuple(FailureEvent(at_s=first_at_s + i * interval_s, slot=replicas - 1 - i)
                 for i in range(replicas // 2))


def steady(replicas: int, mtbf_s: float, repair_s: float | None, horizon_s: float,
           seed: int) -> tuple[FailureEvent, ...]:
    """Independent exponential failures per slot; a slot is down for repair_s after each.

    One private generator per slot (seeded from seed and slot) so adding a slot
    never changes the failures of the others.
    """
    events: list[FailureEvent] = []
    for slot in range(replicas):
        rng = random.Random(f"{seed}/{slot}")
        t = 0.0
        while True:
            t += rng.expovariate(1.0 / mtbf_s)
            if t >= horizon_s:
                break
            back = None if repair_s is None else t + repair_s
            events.append(FailureEvent(at_s=round(t, 3), slot=slot,
                                       returns_at_s=None if back is None else round(back, 3)))
            if back is None:
                break
            t = back
    # Never lose the last slot: a job with no slot left measures nothing.
    events.sort(key=lambda e: (e.at_s, e.slot))
    kept: list[FailureEvent] = []
    for event in events:
        probe = Schedule("steady", replicas, (*kept, event))
        if probe.alive_slots(event.at_s) >= 1:
            kept.append(event)
    return tuple(kept)


def from_dict(raw: Any, replicas: int, where: str = "schedule") -> Schedule:
    """Validate a parsed schedule object and materialise it for `replicas` slots."""
    if not isinstance(raw, dict):
        raise ScheduleError(f"{where}: expected a JSON object, got {type(raw).__name__}")
    kind = raw.get("kind")
    known = {"lose-half": {"kind", "first_at_s", "interval_s", "description"},
             "steady": {"kind", "mtbf_s", "repair_s", "seed", "horizon_s", "description"},
             "explicit": {"kind", "events", "description"}}
    if kind not in known:
        raise ScheduleError(f"{where}: 'kind' must be one of {', '.join(known)}, got {kind!r}")
    unknown = sorted(set(raw) - known[kind])
    if unknown:
        raise ScheduleError(f"{where}: unknown key(s) {unknown} for kind {kind!r}")
    if replicas < 2:
        raise ScheduleError(f"{where}: needs at least 2 replicas, got {replicas}")
    if kind == "lose-half":
        first = _number(raw, "first_at_s", where)
        interval = _number(raw, "interval_s", where, minimum=0.001)
        assert first is not None and interval is not None
        return Schedule(kind, replicas, lose_half(replicas, first, interval))
    if kind == "steady":
        mtbf = _number(raw, "mtbf_s", where, minimum=0.001)
        repair = _number(raw, "repair_s", where, allow_none=True)
        horizon = _number(raw, "horizon_s", where, default=3600.0, minimum=0.001)
        seed = raw.get("seed", 0)
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ScheduleError(f"{where}: 'seed' must be an integer, got {seed!r}")
        assert mtbf is not None and horizon is not None
        return Schedule(kind, replicas, steady(replicas, mtbf, repair, horizon, seed), mtbf_s=mtbf)
    items = raw.get("events")
    if not isinstance(items, list) or not items:
        raise ScheduleError(f"{where}: 'events' must be a non-empty list")
    events = []
    for i, item in enumerate(items):
        at = f"{where}: events[{i}]"
        if not isinstance(item, dict) or set(item) - {"at_s", "slot", "repair_s"}:
            raise ScheduleError(f"{at}: expected an object with at_s, slot[, repair_s]")
        slot = item.get("slot")
        if isinstance(slot, bool) or not isinstance(slot, int) or not 0 <= slot < replicas:
            raise ScheduleError(f"{at}: 'slot' must be an integer in 0..{replicas - 1}, got {slot!r}")
        at_s = _number(item, "at_s", at)
        repair = _number(item, "repair_s", at, allow_none=True)
        assert at_s is not None
        events.append(FailureEvent(at_s, slot, None if repair is None else at_s + repair))
    events.sort(key=lambda e: (e.at_s, e.slot))
    schedule = Schedule(kind, replicas, tuple(events))
    for e in events:
        down_before = [d for d in events if d is not e and d.slot == e.slot and d.at_s <= e.at_s
                       and (d.returns_at_s is None or d.returns_at_s > e.at_s)]
        if down_before:
            raise ScheduleError(f"{where}: slot {e.slot} fails at {e.at_s:g}s while already down")
        if schedule.alive_slots(e.at_s) < 1:
            raise ScheduleError(f"{where}: every slot is down at {e.at_s:g}s; keep at least one")
    return schedule


def load(path: str | Path, replicas: int) -> Schedule:
    """Read and validate a schedule file; ScheduleError (one line) on any problem."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as exc:
        raise ScheduleError(f"schedule {str(p)!r}: {exc.strerror}") from None
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ScheduleError(f"schedule {str(p)!r}: not valid JSON (line {exc.lineno}: "
                            f"{exc.msg})") from None
    return from_dict(raw, replicas, where=f"schedule {str(p)!r}")
