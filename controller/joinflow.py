"""Carrying out joins for the coordinator: start transfers, follow them, retry, admit.

The decisions (which donor, when a joiner enters, whether to retry) are pure
functions in joins.py; this module sends the commands and keeps the state of
each join. A joiner enters the generation that follows a commit: the commit
goes out without the next plan, and the new generation's plan covers the
joiners too (coordinator.py).
"""

from __future__ import annotations

import logging
import secrets
from collections import Counter
from collections.abc import Sequence
from typing import TYPE_CHECKING

from recover.controller.joins import (
    RETRY_DELAY_S,
    Join,
    JoinPhase,
    after_failure,
    choose_donor,
    entry,
)
from recover.proto import pb

if TYPE_CHECKING:
    from recover.controller.coordinator import Coordinator


class JoinFlow:
    def __init__(self, coordinator: Coordinator) -> None:
        self.c = coordinator
        self.joins: dict[int, Join] = {}
        self.addresses: dict[int, str] = {}
        """Each joiner's transfer address (from its `ready`)."""
        self.transfers: list[tuple[int, float]] = []
        """(bytes, seconds) of every snapshot transferred, for metrics and the summary."""
        self.joined = 0
        self.abandoned = 0

    def add(self, replica: int, address: str) -> None:
        """A replica that became ready while the job runs: bring it in."""
        self.addresses[replica] = address
        self.joins[replica] = Join(replica)
        self._start(self.joins[replica])

    def forget(self, replica: int) -> None:
        self.joins.pop(replica, None)

    @property
    def spares(self) -> list[int]:
        return sorted(j.joiner for j in self.joins.values() if j.phase is JoinPhase.CAUGHT_UP)

    def _start(self, join: Join) -> None:
        c = self.c
        donating = Counter(j.donor for j in self.joins.values()
                           if j.phase is not JoinPhase.WAITING_DONOR)
        load = {m: len(c.plan.get(m, ())) for m in c.members}
        choice = choose_donor(c.members, load, donating, join.failed_donors)
        if choice.donor is None:
            join.phase = JoinPhase.WAITING_DONOR
            return
        join.phase, join.donor = JoinPhase.TRANSFERRING, choice.donor
        join.token = secrets.token_hex(16)
        join.attempts += 1
        join.started_at = c.now()
        donor_agent = c.replicas[choice.donor].agent_id
        joiner_agent = c.replicas[join.joiner].agent_id
        c.send_to(donor_agent, pb.ControllerMessage(donate=pb.Donate(
            donor=choice.donor, joiner=join.joiner, address=self.addresses[join.joiner],
            token=join.token)))
        c.send_to(joiner_agent, pb.ControllerMessage(join=pb.Join(
            joiner=join.joiner, donor=choice.donor, token=join.token, attempt=join.attempts)))
        c.events.emit("join-started", f"attempt {join.attempts}: {choice.reason}",
                      step=c.step, replica=join.joiner)

    def progress(self, replica: int, msg: pb.JoinProgress) -> None:
        join = self.joins.get(replica)
        if join is None or msg.attempt != join.attempts:
            self.c.stale_reports += 1  # a report of an attempt that was already replaced
            return
        if join.snapshot_bytes == 0 and msg.snapshot_bytes:
            join.snapshot_bytes, join.snapshot_s = msg.snapshot_bytes, msg.snapshot_s
            self.transfers.append((msg.snapshot_bytes, msg.snapshot_s))
            rate = msg.snapshot_bytes / msg.snapshot_s / 1e6 if msg.snapshot_s > 0 else 0.0
            self.c.events.emit("state-transfer", f"{msg.snapshot_bytes} bytes from replica "
                               f"{join.donor} in {msg.snapshot_s:.3f}s ({rate:.0f} MB/s), "
                               f"state before step {msg.step}", step=self.c.step, replica=replica)
        join.step = msg.step
        if join.step >= self.c.step:
            join.phase = JoinPhase.CAUGHT_UP

    async def failed(self, replica: int, msg: pb.JoinFailed) -> None:
        c = self.c
        if replica in c.members:
            if msg.step >= c.step:
                # It holds every step before the one being computed (a spare that entered a
                # recovery mid-step, whose donor was the replica lost): nothing is missing.
                c.stale_reports += 1
                return
            # Admitted, but its stream broke before it had every step it needed: it cannot
            # enter; recover as from a crash (its agent restarts it).
            await c.worker_lost(replica, f"replica {replica} lost its donor while entering")
            return
        join = self.joins.get(replica)
        if join is None or msg.attempt != join.attempts:
            c.stale_reports += 1  # a report of an attempt that was already replaced
            return
        join.step = max(join.step, msg.step)  # what it holds is still good
        retry = after_failure(join, msg.reason)
        if not retry.retry:
            self.forget(replica)
            self.abandoned += 1
            c.events.emit("join-abandoned", retry.reason, replica=replica, level=logging.WARNING)
            c.send_to(c.replicas[replica].agent_id, pb.ControllerMessage(
                stop_replica=pb.StopReplica(replica=replica, reason=retry.reason)))
            return
        c.events.emit("join-failed", retry.reason, replica=replica, level=logging.WARNING)
        join.failed_donors.append(join.donor)
        join.phase = JoinPhase.WAITING_DONOR
        join.retry_at = c.now() + RETRY_DELAY_S

    def retry_waiting(self) -> None:
        """Joins that found no donor, or whose transfer failed a moment ago: try again."""
        now = self.c.now()
        for join in list(self.joins.values()):
            if join.phase is JoinPhase.WAITING_DONOR and join.retry_at <= now:
                self._start(join)

    def entering(self, enters_at: int, *, final: bool = False,
                 replacing: Sequence[int] | None = None) -> list[int]:
        """The joiners that become members from step `enters_at` on: after the commit of
        the step before it, or in the middle of that step in place of lost members, next to
        the members `replacing` names (the survivors): only those holding its state."""
        c = self.c
        chosen: list[int] = []
        members = len(c.members) if replacing is None else len(replacing)
        for join in sorted(self.joins.values(), key=lambda j: j.joiner):
            verdict = entry(join, enters_at, in_flight=1 if replacing is None else 0,
                            members=members + len(chosen), target=c.job.replicas, final=final)
            if verdict.enter:
                chosen.append(join.joiner)
                self.forget(join.joiner)
                self.joined += 1
                c.events.emit("spare-promoted" if join.spare else "replica-joined",
                              verdict.reason, step=enters_at, replica=join.joiner)
            elif verdict.spare:
                join.spare = True
        return chosen
