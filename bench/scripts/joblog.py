"""Shared by the issue-13 and -14 benchmarks: run a whole `recover run` job, read back its events and steps.

Not a benchmark itself. `rejoin.py`, `checkpoint_overhead.py` and `tls_overhead.py` import it as
a sibling module. Everything comes from what a finished job leaves behind:
`OUT/summary.json` and the controller's logfmt log (`OUT/logs/controller.log`),
so the scripts measure whatever revision is checked out without hooks.
"""

from __future__ import annotations

import json
import re
import statistics
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

FIELD = re.compile(r'(\w+)=("(?:[^"\\]|\\.)*"|\S+)')
"""One logfmt field; quoted values are JSON strings (common/logs.py `_quote`)."""


@dataclass(frozen=True)
class Event:
    ts: float
    kind: str
    """The event kind, e.g. `replica-ready` (the text before the first colon of `msg`)."""
    message: str
    replica: int | None
    step: int | None


def run_job(out: Path, args: list[str], timeout_s: float = 600) -> dict[str, Any]:
    """Run one `recover run` job to completion and return its summary (raises on failure)."""
    cmd = [sys.executable, "-m", "recover.cli.main", "run", "--quiet", "--out", str(out), *args]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    if result.returncode != 0:
        raise RuntimeError(f"job failed (rc {result.returncode}): {' '.join(args)}\n"
                           f"{result.stderr[-2000:]}{result.stdout[-1000:]}")
    summary: dict[str, Any] = json.loads((out / "summary.json").read_text())
    return summary


def events(out: Path) -> list[Event]:
    """The controller's events, in log order (only lines whose msg is `kind: message`)."""
    found = []
    for line in (out / "logs" / "controller.log").read_text().splitlines():
        fields = {k: json.loads(v) if v.startswith('"') else v for k, v in FIELD.findall(line)}
        msg = fields.get("msg", "")
        kind, sep, message = msg.partition(": ")
        if not sep or " " in kind or "ts" not in fields:
            continue
        found.append(Event(float(fields["ts"]), kind, message,
                           int(fields["replica"]) if "replica" in fields else None,
                           int(fields["step"]) if "step" in fields else None))
    return found


def first(evs: list[Event], kind: str, *, replica: int | None = None,
          after: float = float("-inf")) -> Event | None:
    """The first event of `kind` (for `replica`, when given) at or after time `after`."""
    for e in evs:
        if e.kind == kind and e.ts >= after and (replica is None or e.replica == replica):
            return e
    return None


def step_times(summary: dict[str, Any]) -> list[float]:
    """Seconds from the previous step's commit to each step's commit (step 0: from the start)."""
    at = summary["committed_at_s_per_step"]
    return [at[0]] + [at[t] - at[t - 1] for t in range(1, len(at))]


def median_or_none(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def enters_at(event: Event) -> int:
    """The entry step named by a `replica-joined` / `spare-promoted` event."""
    found = re.search(r"enters at step (\d+)", event.message)
    return int(found[1]) if found else -1


def spread(values: list[float], digits: int = 4) -> dict[str, Any]:
    """Median, range and count of a list (what the tables report on a noisy machine)."""
    if not values:
        return {"n": 0, "median": None, "min": None, "max": None}
    return {"n": len(values), "median": round(statistics.median(values), digits),
            "min": round(min(values), digits), "max": round(max(values), digits)}
