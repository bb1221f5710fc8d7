"""When the checkpoint-and-restart baseline writes a checkpoint: pure policy functions.

Young-Daly: with checkpoint write cost C and mean time between failures of the
whole job MTBF, the interval that minimises expected lost time (re-done work
plus checkpoint overhead) is tau = sqrt(2 * C * MTBF) (Young 1974; Daly 2006
adds higher-order terms that matter only when C is a sizeable part of MTBF).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class CheckpointPolicy:
    """How the baseline picks its checkpoint interval (one of three ways)."""

    every_steps: int | None = None
    """Fixed interval in steps (given); wins over the others."""
    every_s: float | None = None
    """Fixed interval in seconds (given)."""
    system_mtbf_s: float | None = None
    """Job-wide mean time between failures, for Young-Daly with the measured write cost."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def young_daly_interval_s(write_cost_s: float, system_mtbf_s: float) -> float:
    """tau = sqrt(2 C MTBF): the checkpoint interval minimising expected waste."""
    if write_cost_s < 0 or system_mtbf_s <= 0:
        raise ValueError(f"need C >= 0 and MTBF > 0, got C={write_cost_s}, MTBF={system_mtbf_s}")
    return math.sqrt(2.0 * write_cost_s * system_mtbf_s)


def checkpoint_due(policy: CheckpointPolicy, next_step: int, since_last_s: float,
                   write_cost_s: float) -> tuple[bool, str]:
    """Whether to checkpoint now (after a step, before `next_step`), and why.

    write_cost_s is NaN until the first checkpoint: with Young-Daly the first
    checkpoint is written at once to measure it (and to have a restart point).
    """
    if policy.every_steps is not None:
        due = next_step % policy.every_steps == 0
        return due, f"fixed interval of {policy.every_steps} steps"
    if policy.every_s is not None:
        return since_last_s >= policy.every_s, f"fixed interval of {policy.every_s:g}s"
    if policy.system_mtbf_s is None:
        return False, "no interval given and no failure rate known: never checkpoint"
    if math.isnan(write_cost_s):
        return True, "first checkpoint: measures the write cost for Young-Daly"
    tau = young_daly_interval_s(write_cost_s, policy.system_mtbf_s)
    return since_last_s >= tau, (f"Young-Daly: sqrt(2 x {write_cost_s * 1000:.1f} ms x "
                                 f"{policy.system_mtbf_s:g} s) = {tau:.2f} s")
