"""Who may say what to the controller: pure decisions with their reasons, table-tested.

Authorization is by session first: an agent's identity is bound when it
registers, and from then on it speaks only for the replicas the controller
assigned to it. So even on a loopback run without TLS, a stranger that
registers cannot report for (or kill, or commit) another agent's replicas,
and a registration that claims a live agent's id is refused before it can
touch that agent's session. With TLS or tokens (security.py) the identity is
also proven, and roles limit the user-facing RPCs.

Every refusal is counted by its `reason` (the metric
`recover_rejected_total{reason}`) and logged as a `rejected` event.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from enum import StrEnum

from recover.common.ckptfile import file_name
from recover.common.security import Identity, Role
from recover.proto import pb


class Reason(StrEnum):
    """Why a message or call was refused (the metric's label)."""

    IMPOSTOR = "impostor"
    """A registration claiming the id of an agent that has a live session."""
    FOREIGN_REPLICA = "foreign-replica"
    """A report about a replica this session's agent does not host."""
    UNAUTHENTICATED = "unauthenticated"
    """No valid credentials (certificate or token) where they are required."""
    FORBIDDEN = "forbidden"
    """Valid credentials, but the role may not do this."""
    MALFORMED = "malformed"
    """Bytes that are not the message they claim to be."""
    FOREIGN_ADDRESS = "foreign-address"
    """A newcomer naming, for its state transfer, an address not on its agent's host."""
    IMPLAUSIBLE = "implausible"
    """A well-formed report of something the job cannot have done (a checkpoint it does not
    write, of a step it has not committed, in another folder)."""


@dataclass(frozen=True)
class Verdict:
    allowed: bool
    reason: str
    """Human-readable: why (for the event and the refused client)."""
    code: Reason | None = None


ALLOWED = Verdict(True, "allowed")


def may_register(agent_id: str, live_sessions: Collection[str], subject: str = "",
                 bound_subject: str | None = None) -> Verdict:
    """A registration may not take over the id of an agent whose session is live: the live
    agent keeps its session untouched (a stranger must not be able to knock it out). An
    agent id is bound to the identity that registered it first (`bound_subject`): only
    that identity may rejoin as it."""
    if agent_id in live_sessions:
        return Verdict(False, f"agent id {agent_id!r} has a live session; refusing a second one",
                       Reason.IMPOSTOR)
    if bound_subject is not None and bound_subject != subject:
        owner = bound_subject or "an anonymous agent"
        return Verdict(False, f"agent id {agent_id!r} belongs to {owner}, not "
                              f"{subject or 'an anonymous caller'}", Reason.IMPOSTOR)
    return ALLOWED


RPC_ROLES: dict[str, frozenset[Role]] = {
    "Session": frozenset({Role.AGENT}),
    "Relay": frozenset({Role.RELAY}),
    "Status": frozenset({Role.READER, Role.OPERATOR, Role.CONTROLLER, Role.AGENT}),
    "Events": frozenset({Role.READER, Role.OPERATOR, Role.CONTROLLER}),
    "Report": frozenset({Role.READER, Role.OPERATOR, Role.CONTROLLER}),
    "Stop": frozenset({Role.OPERATOR}),
    "Drain": frozenset({Role.OPERATOR}),
    "SetSpares": frozenset({Role.OPERATOR}),
}
"""The roles that may call each RPC (an agent may ask status: `recover status` on a host)."""


def may_call(method: str, identity: Identity) -> Verdict:
    allowed = RPC_ROLES.get(method, frozenset())
    if identity.roles & allowed:
        return ALLOWED
    held = ", ".join(sorted(identity.roles)) or "no role"
    need = " or ".join(sorted(allowed)) or "nobody"
    return Verdict(False, f"{identity.subject} ({held}) may not call {method}: it needs {need}",
                   Reason.FORBIDDEN)


REPLICA_MESSAGES = ("worker_exited", "ready", "resumed", "reduced", "applied", "join_progress",
                    "join_failed", "checkpoint_written", "progress", "released")
"""Messages about one replica: only its own agent may send them."""


def may_report(agent_id: str, kind: str, replica: int, hosted: Collection[int]) -> Verdict:
    """May this session's agent send a `kind` message about `replica`?"""
    if kind in REPLICA_MESSAGES and replica not in hosted:
        return Verdict(False, f"agent {agent_id!r} reported {kind} for replica {replica}, which "
                              "it does not host", Reason.FOREIGN_REPLICA)
    return ALLOWED


def peer_host(peer: str) -> str | None:
    """The host of a gRPC peer string (`ipv4:10.0.0.5:5123`, `ipv6:[::1]:5123`); None for a
    peer with no network address (a Unix socket)."""
    kind, _, rest = peer.partition(":")
    if kind not in ("ipv4", "ipv6"):
        return None
    host = rest.rpartition(":")[0]
    return host.strip("[]") or None


def may_name_transfer(addresses: str, peer: str | None,
                      is_loopback: Callable[[str], bool],
                      rank_peers: Sequence[str | None] = ()) -> Verdict:
    """May a newcomer have its state sent to `addresses` (one per rank, comma-separated)? Only
    to its own agent's host, the one the agent's session comes from: else a rogue could have
    a donor stream the whole model to wherever it names. A replica spanning agents names
    each rank's address on the host of the agent holding that rank (`rank_peers`, by rank)."""
    for rank, address in enumerate(addresses.split(",")):
        expected = rank_peers[rank] if rank < len(rank_peers) else peer
        if not address or expected is None:
            continue
        host = address.rpartition(":")[0].strip("[]")
        same = host == expected or (is_loopback(host) and is_loopback(expected))
        if not same:
            return Verdict(False, f"transfer address {address!r} is not on the host of its "
                                  f"agent's session ({expected})", Reason.FOREIGN_ADDRESS)
    return ALLOWED


def may_record_checkpoint(written: pb.CheckpointWritten, folder: str,
                          steps_committed: int) -> Verdict:
    """Is a replica's report of a checkpoint something this job can have written? Only then
    does it become the job's `last_checkpoint` (summary.json, metrics): checkpoints are
    configured (`folder`), the step is a committed one, and the file is that step's file in
    the job's folder (a report naming a planted file elsewhere is refused)."""
    if not folder:
        return Verdict(False, f"a checkpoint of step {written.step} was reported, but this job "
                              "writes none", Reason.IMPLAUSIBLE)
    if not 0 < written.step <= steps_committed:
        return Verdict(False, f"a checkpoint of step {written.step} was reported, but "
                              f"{steps_committed} steps are committed", Reason.IMPLAUSIBLE)
    if written.error:
        return ALLOWED  # a failure names no file
    expected = os.path.join(os.path.abspath(folder), file_name(written.step))
    if os.path.abspath(written.path) != expected:
        return Verdict(False, f"a checkpoint of step {written.step} was reported at "
                              f"{written.path!r}, not at {expected!r}", Reason.IMPLAUSIBLE)
    return ALLOWED
