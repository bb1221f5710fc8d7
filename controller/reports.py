"""What a member's report may claim, and what a claim the others contradict costs.

A member reports "step t reduced in generation g" with the microbatch ids it summed and
the loss the reduction produced. An honest member reports exactly its plan's ids, and the
loss every member got from the same allreduce (the bytes are the same on every rank). So
a report that says otherwise is a broken or hostile member, and it costs that member
(dropped like a crash: the survivors recompute its share), never the job. Pure decisions
with their reasons, table-tested (tests/unit/test_reports.py).
"""

from __future__ import annotations

import struct
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass


def unplanned_ids(replica: int, step: int, planned: Sequence[int],
                  reported: Sequence[int]) -> str | None:
    """Why `reported` is not what `replica` was planned to sum in `step` (None: it is)."""
    if sorted(reported) == sorted(planned):
        return None
    return (f"replica {replica} reported microbatches {sorted(reported)} for step {step}, "
            f"not its plan's {sorted(planned)}")


@dataclass(frozen=True)
class LossVerdict:
    loss: float
    """The step's loss for the ledger."""
    outliers: tuple[int, ...]
    """Members whose loss a strict majority contradicts: to be dropped."""
    reason: str
    """Empty when every member agreed."""


def _bits(loss: float) -> bytes:
    return struct.pack("<d", loss)  # so that NaNs with the same bits agree with each other


def agree_on_loss(losses: Mapping[int, float]) -> LossVerdict:
    """The loss the members agree on. Every honest member reports the same bits (one
    allreduce), so a value a strict majority shares is the reduction's and the others are
    outliers. Without a strict majority nobody can be told apart: the lowest member's value
    is kept, as before, and the disagreement is reported."""
    members = sorted(losses)
    counts = Counter(_bits(losses[m]) for m in members)
    if len(counts) == 1:
        return LossVerdict(losses[members[0]], (), "")
    bits, votes = counts.most_common(1)[0]
    values = sorted({losses[m] for m in members}, key=str)
    if votes * 2 > len(members):
        agreed = struct.unpack("<d", bits)[0]
        outliers = tuple(m for m in members if _bits(losses[m]) != bits)
        return LossVerdict(agreed, outliers,
                           f"members reduced different losses {values}: {votes} of "
                           f"{len(members)} agree on {agreed}; replicas {list(outliers)} are "
                           "dropped")
    return LossVerdict(losses[members[0]], (),
                       f"members reduced different losses {values} and no majority agrees; "
                       f"the ledger keeps replica {members[0]}'s")
