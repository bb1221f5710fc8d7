"""Which controller commands an agent acts on: pure decisions with reasons, table-tested.

A command is refused when it comes from a lower leadership term than the
highest this agent has seen (a deposed leader that woke up), or when it
would take the agent back to an older membership view.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from recover.proto import pb

GENERATIONAL = ("generation", "commit", "share", "release")
"""Commands of one generation (fenced against an older one)."""
ADDRESSED: dict[str, Callable[[pb.ControllerMessage], int]] = {
    "donate": lambda m: m.donate.donor, "join": lambda m: m.join.joiner,
    "share": lambda m: m.share.replica, "release": lambda m: m.release.replica}
"""Commands for one replica's worker, and which replica (on every agent holding its ranks)."""


@dataclass(frozen=True)
class Verdict:
    accept: bool
    reason: str


def judge(kind: str, term: int, generation: int, highest_term: int,
          agent_generation: int) -> Verdict:
    """Should the agent act on a `kind` command of (`term`, `generation`)?

    `kind`: generation | commit | shutdown | registered | share | release (the last two,
    work-stealing's, change the step in flight of one generation: fenced like a commit).
    """
    if term < highest_term:
        return Verdict(False, f"{kind} from term {term}, older than term {highest_term} "
                              "(a deposed leader)")
    if kind == "generation" and generation <= agent_generation:
        return Verdict(False, f"generation {generation} is not newer than {agent_generation}")
    if kind in ("commit", "share", "release") and generation != agent_generation:
        return Verdict(False, f"{kind} of generation {generation}, this agent is in "
                              f"generation {agent_generation}")
    return Verdict(True, f"{kind} of term {term}")


def wants_commit(step: int, applied_step: int) -> Verdict:
    """Does a worker whose last applied step is `applied_step` need the commit of `step`?

    A new leader re-sends the last committed step's commit, because the old one
    may have died before every agent got it; a worker that applied it already
    is past that step and must not see it again.
    """
    if step <= applied_step:
        return Verdict(False, f"step {step} already applied (last applied {applied_step})")
    return Verdict(True, f"step {step} not applied yet (last applied {applied_step})")


def leader_hint(details: str) -> str | None:
    """The leader address a standby named in its refusal ('... leader: HOST:PORT (term N)')."""
    marker = "leader: "
    if marker not in details:
        return None
    address = details.split(marker, 1)[1].split()[0]
    return address if ":" in address else None
