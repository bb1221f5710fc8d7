"""Joins: which member donates its state to a joining replica, and when the joiner enters.

Pure decisions with their reasons, table-tested; the coordinator carries them
out (coordinator.py, `Joins`). A join goes through these phases:

    WAITING_DONOR -> TRANSFERRING   a donor was chosen: Donate/Join were sent
    TRANSFERRING  -> CAUGHT_UP      the joiner loaded the snapshot and applied every step
                                    committed since but the one being committed now
    CAUGHT_UP     -> (member)       admitted into the generation that follows a commit (or,
                                    when every member is lost, into the one that replaces
                                    them, if it holds the state of that very step)
    TRANSFERRING  -> WAITING_DONOR  the donor or the transfer failed: try another donor
    any           -> (gone)         the joiner died, or too many attempts failed

A caught-up joiner that the job does not need yet (the job already has its
target number of members) is a hot spare: it keeps applying every committed
step and is admitted the moment a member is lost.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum

MAX_ATTEMPTS = 5
"""Transfers tried for one joiner before its join is abandoned (an event says so)."""
RETRY_DELAY_S = 0.5
"""Pause before a failed transfer is tried again: the failure is often a donor that just
died, and the controller should learn of that before it picks the next donor."""


class JoinPhase(StrEnum):
    WAITING_DONOR = "waiting-donor"
    TRANSFERRING = "transferring"
    CAUGHT_UP = "caught-up"


@dataclass(frozen=True)
class Join:
    """One replica's way into the running job."""

    joiner: int
    phase: JoinPhase = JoinPhase.WAITING_DONOR
    donor: int = -1
    token: str = ""
    attempts: int = 0
    failed_donors: tuple[int, ...] = ()
    step: int = -1
    """The next step the joiner needs (it applied every step before it); -1: no state yet.
    Kept across attempts: a joiner's state stays good when a transfer breaks."""
    retry_at: float = 0.0
    """When a join waiting for a donor is tried again."""
    started_at: float = 0.0
    """When the current attempt started (the first snapshot byte is what is timed)."""
    snapshot_bytes: int = 0
    snapshot_s: float = 0.0
    spare: bool = False
    """It was caught up and kept waiting because the job had its members: a hot spare."""


@dataclass(frozen=True)
class DonorChoice:
    donor: int | None
    reason: str


def choose_donor(members: Sequence[int], load: Mapping[int, int], donating: Mapping[int, int],
                 avoid: Collection[int]) -> DonorChoice:
    """The member that will feel a donation least: fewest joins it already feeds, then the
    smallest share of M, then the lowest id; never one that failed this joiner before
    (unless it is the only member left)."""
    candidates = [m for m in members if m not in avoid] or list(members)
    if not candidates:
        return DonorChoice(None, "no live member to donate state")
    donor = min(candidates, key=lambda m: (donating.get(m, 0), load.get(m, 0), m))
    return DonorChoice(donor, f"replica {donor} donates (feeds {donating.get(donor, 0)} other "
                              f"joins, computes {load.get(donor, 0)} microbatches)")


@dataclass(frozen=True)
class Entry:
    enter: bool
    reason: str
    spare: bool = False
    """Ready to enter, kept out only because the job has its members: a hot spare."""


def entry(join: Join, enters_at: int, *, in_flight: int, members: int, target: int,
          final: bool) -> Entry:
    """May the joiner become a member from step `enters_at` on? It must have applied every
    step before it but the last `in_flight` (1 at a commit: the committed step's gradient
    reaches it right after; 0 when no donor is left to send anything), and the job must
    want another member."""
    if final:
        return Entry(False, "the job ends with this step")
    if join.step < 0:
        return Entry(False, f"replica {join.joiner} has no state yet")
    if in_flight and join.phase is JoinPhase.WAITING_DONOR:
        return Entry(False, f"replica {join.joiner} has no donor to send it step "
                            f"{enters_at - in_flight}")
    behind = enters_at - in_flight - join.step
    if behind > 0:
        return Entry(False, f"replica {join.joiner} is at step {join.step}, {behind} steps behind")
    if members >= target:
        return Entry(False, f"replica {join.joiner} is a hot spare: the job has its {target} "
                            "members", spare=True)
    return Entry(True, f"replica {join.joiner} caught up: it enters at step {enters_at}")


@dataclass(frozen=True)
class Retry:
    retry: bool
    reason: str


def after_failure(join: Join, why: str) -> Retry:
    if join.attempts >= MAX_ATTEMPTS:
        return Retry(False, f"join of replica {join.joiner} abandoned after {join.attempts} "
                            f"attempts (last: {why})")
    return Retry(True, f"join of replica {join.joiner} failed ({why}); attempt "
                       f"{join.attempts + 1} of {MAX_ATTEMPTS} follows")


@dataclass(frozen=True)
class SnapshotCheck:
    trusted: bool
    reason: str


def check_snapshot(reported: str, committed: Collection[str], step: int, donor: int
                   ) -> SnapshotCheck:
    """Does the state a joiner loaded from `donor`'s snapshot (`reported`, its digest) hold
    the parameters the job committed before `step` (`committed`: the members' digests of
    step - 1)? A donor whose snapshot differs (a bug, a bad host, an attacker) must not seed
    a member. Unverifiable, so accepted: no digest reported (an older worker), or none
    committed yet (the state before step 0, or members' digests still in flight)."""
    if not reported or not committed:
        return SnapshotCheck(True, "not verifiable: no digest to compare")
    if reported in committed:
        return SnapshotCheck(True, f"the snapshot holds the parameters committed at step {step - 1}")
    return SnapshotCheck(False, f"the snapshot from replica {donor} holds other parameters than "
                                f"those committed at step {step - 1} ({reported[:12]} against "
                                f"{', '.join(sorted(d[:12] for d in committed))})")
