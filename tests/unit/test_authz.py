"""Authorization by session (controller/authz.py): the decision and its reason, table-style."""

from __future__ import annotations

import pytest

from recover.controller.authz import Reason, may_register, may_report


@pytest.mark.parametrize("agent_id, live, allowed, code, reason", [
    ("host1", {"host0"}, True, None, "allowed"),
    ("host0", {"host0", "host1"}, False, Reason.IMPOSTOR, "'host0' has a live session"),
    ("host0", set(), True, None, "allowed"),  # the same id after its session ended: a rejoin
])
def test_may_register(agent_id, live, allowed, code, reason):
    verdict = may_register(agent_id, live)
    assert (verdict.allowed, verdict.code) == (allowed, code)
    assert reason in verdict.reason


@pytest.mark.parametrize("kind, replica, hosted, allowed, reason", [
    ("reduced", 2, [2, 3], True, "allowed"),
    ("reduced", 0, [2, 3], False, "reported reduced for replica 0, which it does not host"),
    ("worker_exited", 1, [2, 3], False, "worker_exited for replica 1"),
    ("applied", 1, [], False, "applied for replica 1"),
    ("ready", 3, [2, 3], True, "allowed"),
    ("join_progress", 9, [2], False, "join_progress for replica 9"),
    ("checkpoint_written", 0, [2], False, "checkpoint_written"),
    ("heartbeat", -1, [], True, "allowed"),
    ("replica_request", -1, [2], True, "allowed"),
])
def test_may_report(kind, replica, hosted, allowed, reason):
    verdict = may_report("rogue", kind, replica, hosted)
    assert verdict.allowed is allowed
    assert reason in verdict.reason
    if not allowed:
        assert verdict.code is Reason.FOREIGN_REPLICA
