"""What a worker does with a commit it receives: a pure, table-tested decision.

A new leader re-sends the last committed step's commit, because the old one may
have died before every agent passed it on. Agents forward it only to workers
whose `applied` report they have not seen, but a worker may have applied the
step while its report was still on the way (seen in a failover benchmark: the
worker was already one step further and stopped). So a worker treats a commit
of a step it has already applied as the duplicate it is.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class CommitAction(StrEnum):
    """APPLY: take the optimizer step. IGNORE: an already applied step, sent again.
    REFUSE: the commit contradicts this worker's state (a protocol error: stop)."""

    APPLY = "apply"
    IGNORE = "ignore"
    REFUSE = "refuse"


@dataclass(frozen=True)
class CommitVerdict:
    action: CommitAction
    reason: str


def judge_commit(commit_step: int, commit_generation: int, step: int, generation: int,
                 reduced: bool) -> CommitVerdict:
    """`step`, `generation`: where this worker is; `reduced`: it holds a reduced
    gradient for `step` awaiting this commit."""
    if commit_step < step:
        return CommitVerdict(CommitAction.IGNORE, f"step {commit_step} is already applied "
                                                  f"(this worker is at step {step})")
    if commit_step > step:
        return CommitVerdict(CommitAction.REFUSE, f"commit of step {commit_step} is ahead of "
                                                  f"this worker (at step {step})")
    if commit_generation != generation:
        return CommitVerdict(CommitAction.REFUSE, f"commit of step {step} in generation "
                                                  f"{commit_generation}, but this worker "
                                                  f"reduced in generation {generation}")
    if not reduced:
        return CommitVerdict(CommitAction.REFUSE, f"commit of step {step} before this worker "
                                                  "reduced it")
    return CommitVerdict(CommitAction.APPLY, f"step {step} reduced in generation {generation}")
