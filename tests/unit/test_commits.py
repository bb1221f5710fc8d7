"""trainer/commits.py: what a worker does with a commit, on both the decision and its reason."""

from __future__ import annotations

import pytest

from recover.trainer.commits import CommitAction, judge_commit


@pytest.mark.parametrize(("commit_step", "commit_gen", "step", "gen", "reduced", "action", "why"), [
    (5, 3, 5, 3, True, CommitAction.APPLY, "step 5 reduced in generation 3"),
    # A new leader re-sends the last commit; this worker applied it already.
    (4, 3, 5, 3, False, CommitAction.IGNORE, "step 4 is already applied (this worker is at step 5)"),
    (4, 2, 5, 4, True, CommitAction.IGNORE, "already applied"),
    (6, 3, 5, 3, True, CommitAction.REFUSE, "ahead of this worker (at step 5)"),
    (5, 2, 5, 3, True, CommitAction.REFUSE, "in generation 2, but this worker reduced in generation 3"),
    (5, 3, 5, 3, False, CommitAction.REFUSE, "before this worker reduced it"),
])
def test_judge_commit(commit_step: int, commit_gen: int, step: int, gen: int, reduced: bool,
                      action: CommitAction, why: str) -> None:
    verdict = judge_commit(commit_step, commit_gen, step, gen, reduced)
    assert verdict.action is action
    assert why in verdict.reason
