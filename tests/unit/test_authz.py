"""Authorization by session (controller/authz.py): the decision and its reason, table-style."""

from __future__ import annotations

import pytest

from recover.common.security import ALL_ROLES, ANONYMOUS, Identity, Role
from recover.controller.authz import (
    Reason,
    may_call,
    may_name_transfer,
    may_record_checkpoint,
    may_register,
    may_report,
    peer_host,
)
from recover.proto import pb


@pytest.mark.parametrize("agent_id, live, subject, bound, allowed, code, reason", [
    ("host1", {"host0"}, "", None, True, None, "allowed"),
    ("host0", {"host0", "host1"}, "", None, False, Reason.IMPOSTOR, "'host0' has a live session"),
    ("host0", set(), "", "", True, None, "allowed"),  # its session ended: a rejoin
    ("host0", set(), "host0", "host0", True, None, "allowed"),  # rejoin with its certificate
    ("host0", set(), "mallory", "host0", False, Reason.IMPOSTOR,
     "'host0' belongs to host0, not mallory"),
    ("host0", set(), "", "host0", False, Reason.IMPOSTOR, "not an anonymous caller"),
    ("host2", set(), "host0", None, True, None, "allowed"),  # one identity, several agent ids
])
def test_may_register(agent_id, live, subject, bound, allowed, code, reason):
    verdict = may_register(agent_id, live, subject, bound)
    assert (verdict.allowed, verdict.code) == (allowed, code)
    assert reason in verdict.reason


def who(*roles: Role) -> Identity:
    return Identity("alice", frozenset(roles), "certificate")


@pytest.mark.parametrize("method, identity, allowed, reason", [
    ("Session", who(Role.AGENT), True, "allowed"),
    ("Session", who(Role.OPERATOR), False, "alice (operator) may not call Session: it needs agent"),
    # Only a relay may speak for other agents (it names their identities to the leader).
    ("Relay", who(Role.RELAY), True, "allowed"),
    ("Relay", who(Role.AGENT), False, "alice (agent) may not call Relay: it needs relay"),
    ("Relay", who(Role.CONTROLLER), False, "needs relay"),
    ("Status", who(Role.READER), True, "allowed"),
    ("Status", who(Role.AGENT), True, "allowed"),
    ("Events", who(Role.AGENT), False, "needs controller or operator or reader"),
    ("Report", who(Role.CONTROLLER), True, "allowed"),
    ("Stop", who(Role.READER), False, "alice (reader) may not call Stop: it needs operator"),
    ("Stop", who(Role.OPERATOR), True, "allowed"),
    ("Drain", who(Role.READER, Role.AGENT), False, "(agent, reader)"),
    ("SetSpares", ANONYMOUS, True, "allowed"),  # plaintext: authorization by session only
    ("Unknown", Identity("x", ALL_ROLES, "token"), False, "needs nobody"),
    ("Status", who(), False, "alice (no role)"),
])
def test_may_call(method, identity, allowed, reason):
    verdict = may_call(method, identity)
    assert verdict.allowed is allowed
    assert reason in verdict.reason
    if not allowed:
        assert verdict.code is Reason.FORBIDDEN


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


CKPT = "/shared/ckpt"


@pytest.mark.parametrize("written, folder, committed, allowed, reason", [
    (pb.CheckpointWritten(step=10, path=f"{CKPT}/ckpt-0000000010.rcv"), CKPT, 12, True,
     "allowed"),
    (pb.CheckpointWritten(step=12, path=f"{CKPT}/x/../ckpt-0000000012.rcv"), CKPT + "/", 12,
     True, "allowed"),  # the same file, spelled differently
    (pb.CheckpointWritten(step=10, path=f"{CKPT}/ckpt-0000000010.rcv"), "", 12, False,
     "a checkpoint of step 10 was reported, but this job writes none"),
    (pb.CheckpointWritten(step=13, path=f"{CKPT}/ckpt-0000000013.rcv"), CKPT, 12, False,
     "a checkpoint of step 13 was reported, but 12 steps are committed"),
    (pb.CheckpointWritten(step=0, path=f"{CKPT}/ckpt-0000000000.rcv"), CKPT, 12, False,
     "but 12 steps are committed"),
    (pb.CheckpointWritten(step=10, path="/tmp/planted/ckpt-0000000010.rcv"), CKPT, 12, False,
     "reported at '/tmp/planted/ckpt-0000000010.rcv', not at '/shared/ckpt/ckpt-0000000010.rcv'"),
    (pb.CheckpointWritten(step=10, path=f"{CKPT}/ckpt-0000000009.rcv"), CKPT, 12, False,
     "not at '/shared/ckpt/ckpt-0000000010.rcv'"),
    (pb.CheckpointWritten(step=10, error="disk full"), CKPT, 12, True, "allowed"),
])
def test_may_record_checkpoint(written, folder, committed, allowed, reason):
    verdict = may_record_checkpoint(written, folder, committed)
    assert (verdict.allowed, verdict.code) == (allowed, None if allowed else Reason.IMPLAUSIBLE)
    assert reason in verdict.reason


@pytest.mark.parametrize(("peer", "host"), [
    ("ipv4:10.0.0.5:51234", "10.0.0.5"),
    ("ipv6:[::1]:5000", "::1"),
    ("ipv6:[fd00::7]:6000", "fd00::7"),
    ("unix:/tmp/agent.sock", None),
    ("", None),
])
def test_the_peer_host_of_a_session(peer: str, host: str | None) -> None:
    assert peer_host(peer) == host


TRANSFER_ROWS = [  # addresses a newcomer names, its agent's session peer, allowed, reason
    ("10.0.0.5:7000", "10.0.0.5", True, ""),
    ("10.0.0.5:7000,10.0.0.5:7001", "10.0.0.5", True, ""),  # a sharded replica: one per rank
    ("127.0.0.1:7000", "::1", True, ""),  # both this machine
    ("10.0.0.9:7000", "10.0.0.5", False, "'10.0.0.9:7000' is not on the host of its agent's "
                                         "session (10.0.0.5)"),
    ("10.0.0.5:7000,10.0.0.9:7001", "10.0.0.5", False, "'10.0.0.9:7001' is not on the host"),
    ("0.0.0.0:7", "127.0.0.1", False, "'0.0.0.0:7' is not on the host"),
    ("203.0.113.7:7000", None, True, ""),  # no network peer (a Unix socket): nothing to check
    ("", "10.0.0.5", True, ""),  # no address: no transfer
]


@pytest.mark.parametrize(("addresses", "peer", "allowed", "reason"), TRANSFER_ROWS)
def test_a_newcomers_state_goes_only_to_its_agents_host(addresses, peer, allowed, reason) -> None:
    verdict = may_name_transfer(addresses, peer, lambda h: h.startswith("127.") or h == "::1")
    assert verdict.allowed is allowed
    assert reason in verdict.reason
    if not allowed:
        assert verdict.code is Reason.FOREIGN_ADDRESS
