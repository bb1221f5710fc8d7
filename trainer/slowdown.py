"""Slowed replicas (`--slowdown`): heterogeneity that can be reproduced on one machine.

A spec reads `replica=R,factor=F[,from_step=S][,until_step=T]`: in steps [S, T) (default
from step 0 to the end of the job) every microbatch of replica R takes F times as long as
it otherwise would. The worker measures each microbatch's compute (its real forward and
backward plus the emulated `--compute-ms`) and then sleeps (F - 1) times that, so a slowed
replica behaves like a slower accelerator whatever the workload, and the sleep counts in
the compute time it reports (what the controller measures replica speed from).

The slowdown follows the **replica id**, the id the controller plans and measures by: a
worker restarted after a failure is a new replica with a new id, so it is not slowed unless
a spec names that id too (ids of replicas started later are accepted for that reason).
Slots are not used: a slot number is only unique within its agent, and a restarted replica
is exactly what the controller must measure afresh.

Torch-free, like faults.py: the command-line tools import the specs.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

from recover.proto import pb

MAX_FACTOR = 100.0
KEYS = ("replica", "factor", "from_step", "until_step")


class SlowdownSpecError(ValueError):
    """A --slowdown spec that cannot be understood; the message is one line."""


def parse_slowdown_spec(text: str) -> pb.SlowdownSpec:
    """Parse `replica=R,factor=F[,from_step=S][,until_step=T]`."""
    def bad(why: str) -> SlowdownSpecError:
        return SlowdownSpecError(f"malformed --slowdown {text!r}: {why}")

    fields: dict[str, str] = {}
    for part in text.split(","):
        key, sep, value = part.strip().partition("=")
        if not sep or not key or not value:
            raise bad("expected key=value pairs such as replica=1,factor=2,from_step=10")
        if key in fields:
            raise bad(f"{key!r} given twice")
        fields[key] = value
    unknown = set(fields) - set(KEYS)
    if unknown:
        raise bad(f"unknown key(s) {sorted(unknown)}")
    missing = {"replica", "factor"} - set(fields)
    if missing:
        raise bad(f"missing {sorted(missing)}")
    try:
        replica = int(fields["replica"])
        from_step = int(fields.get("from_step", "0"))
        until_step = int(fields.get("until_step", "0"))
    except ValueError:
        raise bad("replica, from_step and until_step must be integers") from None
    try:
        factor = float(fields["factor"])
    except ValueError:
        raise bad("factor must be a number") from None
    if replica < 0 or from_step < 0 or until_step < 0:
        raise bad("replica, from_step and until_step must not be negative")
    if not 1.0 <= factor < MAX_FACTOR:  # also refuses nan and inf
        raise bad(f"factor must be at least 1 and below {MAX_FACTOR:g}, got {fields['factor']}")
    if "until_step" in fields and until_step <= from_step:
        raise bad(f"until_step ({until_step}) must be above from_step ({from_step})")
    return pb.SlowdownSpec(replica=replica, factor=factor, from_step=from_step,
                           until_step=until_step)


def format_slowdown_spec(spec: pb.SlowdownSpec) -> str:
    """The text `parse_slowdown_spec` reads back as `spec` (every digit of the factor)."""
    text = f"replica={spec.replica},factor={spec.factor!r}"
    if spec.from_step:
        text += f",from_step={spec.from_step}"
    return text + (f",until_step={spec.until_step}" if spec.until_step else "")


def _end(spec: pb.SlowdownSpec) -> float:
    return spec.until_step if spec.until_step else math.inf


def overlap(specs: Sequence[pb.SlowdownSpec]) -> tuple[int, int] | None:
    """The positions of the first two specs that slow the same replica in a common step
    (a replica has one factor per step), or None."""
    for j, later in enumerate(specs):
        for i, earlier in enumerate(specs[:j]):
            if (earlier.replica == later.replica and earlier.from_step < _end(later)
                    and later.from_step < _end(earlier)):
                return i, j
    return None


class SlowdownSchedule:
    """One replica's slowdowns: the factor of its microbatches in each step."""

    def __init__(self, specs: Iterable[pb.SlowdownSpec], replica: int) -> None:
        self._specs = [s for s in specs if s.replica == replica and s.factor > 1.0]

    def __bool__(self) -> bool:
        """Whether any step of this replica is slowed."""
        return bool(self._specs)

    def factor_at(self, step: int) -> float:
        """How many times as long each microbatch of `step` takes (1.0: not slowed)."""
        for spec in self._specs:
            if spec.from_step <= step < _end(spec):
                return spec.factor
        return 1.0
