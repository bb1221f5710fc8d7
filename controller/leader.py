"""Leader election among controllers of one job, and writes fenced by leadership.

Two or more controllers share one store. The leader holds a key
(`/recover/<job>/leader`, a `LeaderRecord`) attached to a lease of `ttl_s`
seconds that it keeps alive; the others watch the key and campaign when it
is gone: the lease expired (the leader crashed or was cut off) or was revoked
(clean shutdown). The watch wakes a standby within a store round trip; a slow
re-read (`recheck_s`) is the safety net for a watch that is stuck without
knowing it (an etcd member cut off from its cluster sends nothing).
Campaigning is one transaction: "the leader key is absent and the term
counter still reads t" -> put the leader key (on my lease) and term t+1. So
terms increase monotonically and two controllers never win the same term.

A leader must not act once it may have lost the lease, even if nobody told
it (it was stopped, or cut off from etcd): `holds()` trusts a local clock
that runs out `ttl_s - margin_s` after the last keep-alive was *sent*, and
every store write goes through `LeaderStore`, a transaction that compares the
leader key with this leader's own record, so a deposed leader's writes fail.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from dataclasses import dataclass
from enum import StrEnum

from recover.controller.records import JobKeys
from recover.controller.store import Compare, KeyChange, Store, StoreError, Write
from recover.proto import pb

log = logging.getLogger("recover.controller")


class Role(StrEnum):
    """A controller's part in the election.

    STANDBY -> LEADER     the leader key was absent and our campaign transaction won
    STANDBY -> STANDBY    another controller won the campaign (or still leads)
    LEADER  -> DEPOSED    a keep-alive failed or the local lease clock ran out
    LEADER  -> RESIGNED   clean shutdown: the lease is revoked, standbys take over at once
    DEPOSED -> STANDBY    the controller dropped its job state and campaigns again
    """

    STANDBY = "standby"
    LEADER = "leader"
    DEPOSED = "deposed"
    RESIGNED = "resigned"


class LostLeadership(Exception):
    """A write was refused because this controller no longer leads (fenced)."""


@dataclass(frozen=True)
class ElectionConfig:
    ttl_s: int = 2
    """Lease TTL: how long a crashed leader blocks a takeover (etcd's minimum is ~1.5 s)."""
    refresh_s: float = 0.5
    """Keep-alive period of the leader's lease (several per TTL)."""
    recheck_s: float = 1.0
    """How often a standby re-reads the leader key although its watch reported nothing."""
    margin_s: float = 0.3
    """The leader stops acting this long before its lease could expire (clock-rate slack)."""


@dataclass(frozen=True)
class LeaseVerdict:
    leading: bool
    reason: str


def lease_verdict(now: float, valid_until: float, refreshed: bool | None) -> LeaseVerdict:
    """Does a leader still lead? `refreshed`: the last keep-alive's answer (None: no answer)."""
    if refreshed is False:
        return LeaseVerdict(False, "the store says our lease is gone (expired or revoked)")
    if now >= valid_until:
        return LeaseVerdict(False, f"no keep-alive confirmed for too long (lease clock ran out "
                                   f"{now - valid_until:.2f}s ago)")
    if refreshed is None:
        return LeaseVerdict(True, f"keep-alive unanswered; lease still valid for "
                                  f"{valid_until - now:.2f}s")
    return LeaseVerdict(True, "lease refreshed")


class LeaderElection:
    def __init__(self, store: Store, job_id: str, address: str, controller_id: str,
                 config: ElectionConfig | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.store = store
        self.address = address
        self.controller_id = controller_id
        self.config = config or ElectionConfig()
        self._clock = clock
        keys = JobKeys(job_id)
        self.leader_key = keys.leader
        self.term_key = keys.term
        self.role = Role.STANDBY
        self.term = 0
        self.lease = 0
        self.record = b""
        """Our serialized LeaderRecord while leading: what fenced writes compare with."""
        self._valid_until = 0.0
        self.refused_writes = 0
        """Writes refused because this controller no longer led (fenced), over its lifetime."""
        self._changed = asyncio.Event()
        """Set by the leader-key watch on every change: wakes a campaigning standby."""
        self._watcher: asyncio.Task[None] | None = None
        self._closing = False
        self._planted: bytes | None = None
        """The leader key's value at the last read when it had no lease (see `leader`)."""
        self._warned_planted: bytes | None = None

    async def leader(self) -> pb.LeaderRecord | None:
        """The current leader as the store has it (None: no leader right now).

        A leader key without a lease is no leader: an election only ever writes it on a
        lease (so it goes with its holder), and one without was planted, by hand or by
        whoever could write the store. It is ignored (never handed to agents as a leader
        hint) and a campaign overwrites it."""
        found = await self.store.get_leased(self.leader_key)
        self._planted = None
        if found is None:
            return None
        raw, lease = found
        if not lease:
            self._planted = raw
            if raw != self._warned_planted:
                self._warned_planted = raw
                log.warning("ignoring a leader key without a lease (not written by an "
                            "election): %r", raw[:80])
            return None
        return pb.LeaderRecord.FromString(raw)

    def holds(self) -> bool:
        """True while this controller may act as leader (local lease clock; no I/O)."""
        return self.role is Role.LEADER and self._clock() < self._valid_until

    async def campaign(self) -> int:
        """Wait as a standby until this controller wins a term; return the term."""
        if self._watcher is None:
            # One watch for the controller's life, not one per campaign: a watch task
            # cancelled while aetcd was still creating the watch did not end for
            # seconds under load (measured: 6 of 250 campaigns on a loaded machine).
            self._watcher = asyncio.create_task(self._watch_leader_key())
        changed = self._changed
        announced = None
        while True:
            changed.clear()  # before the read: a change after it wakes the wait below
            current = await self._read_or_none()
            if current is None:
                try:
                    term = await self._try_to_win()
                except StoreError as exc:
                    log.warning("campaign failed: %s", exc)
                    term = 0
                if term:
                    return term
            elif current is not False and current.controller_id != announced:
                announced = current.controller_id
                log.info("standing by: %s leads term %d at %s", current.controller_id,
                         current.term, current.address)
            try:
                await asyncio.wait_for(changed.wait(), self.config.recheck_s)
            except TimeoutError:
                pass

    async def _watch_leader_key(self) -> None:
        """Set `changed` on every change of the leader key (and once when the watch starts)."""
        # The flag, not only cancel(): Python 3.11's wait_for can swallow a cancel.
        while not self._closing:
            try:
                async for _ in self.store.watch(self.leader_key):
                    if self._closing:
                        return
                    self._changed.set()
            except Exception as exc:  # noqa: BLE001 - a wake-up aid: the re-read timer stands in
                log.warning("cannot watch the leader key (%s: %s); re-reading it every %.1fs",
                            type(exc).__name__, exc, self.config.recheck_s)
            await asyncio.sleep(self.config.recheck_s)

    async def close(self) -> None:
        """Stop watching the leader key (bounded: see campaign)."""
        self._closing = True
        watcher, self._watcher = self._watcher, None
        if watcher is not None:
            watcher.cancel()
            await asyncio.wait({watcher}, timeout=1.0)

    async def _read_or_none(self) -> pb.LeaderRecord | None | bool:
        try:
            return await self.leader()
        except StoreError as exc:
            log.warning("standby cannot read the leader key: %s", exc)
            return False  # unknown: do not campaign blind

    async def _try_to_win(self) -> int:
        raw_term = await self.store.get(self.term_key)
        previous = int(raw_term.decode()) if raw_term else 0
        started = self._clock()
        lease = await self.store.grant_lease(self.config.ttl_s)
        term = previous + 1
        record = pb.LeaderRecord(term=term, address=self.address,
                                 controller_id=self.controller_id, elected_at=time.time())
        value = record.SerializeToString()
        won = await self.store.transaction(
            [(self.leader_key, self._planted), (self.term_key, raw_term)],
            [Write(self.leader_key, value, lease), Write(self.term_key, str(term).encode())])
        if not won and await self.store.get(self.leader_key) == value:
            won = True  # a retried transaction found its own earlier success
        if not won:
            await self.store.revoke_lease(lease)
            return 0
        self.role, self.term, self.lease, self.record = Role.LEADER, term, lease, value
        self._valid_until = started + self.config.ttl_s - self.config.margin_s
        log.info("elected leader of term %d at %s", term, self.address, extra={"term": term})
        return term

    async def keep_leading(self) -> str:
        """Keep the lease alive while leading; return why leadership was lost."""
        cfg = self.config
        while self.role is Role.LEADER:
            sent = self._clock()
            refreshed: bool | None
            try:
                refreshed = await asyncio.wait_for(self.store.refresh_lease(self.lease),
                                                   max(self._valid_until - sent, 0.01))
            except (StoreError, TimeoutError):
                refreshed = None
            if refreshed:
                self._valid_until = sent + cfg.ttl_s - cfg.margin_s
            verdict = lease_verdict(self._clock(), self._valid_until, refreshed)
            if not verdict.leading:
                self.role = Role.DEPOSED
                log.warning("lost leadership of term %d: %s", self.term, verdict.reason,
                            extra={"term": self.term})
                return verdict.reason
            await asyncio.sleep(cfg.refresh_s)
        return f"role is {self.role}"

    async def resign(self) -> None:
        """Clean shutdown: revoke the lease so a standby takes over without waiting for the TTL."""
        if self.role is Role.LEADER:
            self.role = Role.RESIGNED
            await self.store.revoke_lease(self.lease)
            log.info("resigned leadership of term %d", self.term, extra={"term": self.term})

    def stand_by(self) -> None:
        """After losing leadership: forget the term and campaign as a standby again."""
        self.role, self.lease, self.record, self._valid_until = Role.STANDBY, 0, b"", 0.0


MAX_TXN_WRITES = 100
"""Writes per transaction (etcd refuses more than --max-txn-ops, 128 by default, in one)."""


class LeaderStore(Store):
    """The store as a leader may write it: every write is fenced by the leader key.

    Reads pass through. A write is a transaction comparing the leader key with
    our own record; if another controller has taken over (or our lease is gone)
    nothing is written and `LostLeadership` is raised.
    """

    def __init__(self, election: LeaderElection) -> None:
        self._election = election
        self._inner = election.store

    def _guard(self) -> list[Compare]:
        return [(self._election.leader_key, self._election.record)]

    async def _write(self, writes: Sequence[Write]) -> None:
        if not self._election.holds() or not await self._inner.transaction(self._guard(), writes):
            self._election.refused_writes += 1
            raise LostLeadership(f"term {self._election.term} is over: write refused")

    async def get(self, key: str) -> bytes | None:
        return await self._inner.get(key)

    async def get_leased(self, key: str) -> tuple[bytes, int] | None:
        return await self._inner.get_leased(key)

    async def get_prefix(self, prefix: str) -> list[tuple[str, bytes]]:
        return await self._inner.get_prefix(prefix)

    def watch(self, key: str) -> AsyncIterator[KeyChange]:
        return self._inner.watch(key)

    async def put(self, key: str, value: bytes) -> None:
        await self._write([Write(key, value)])

    async def put_many(self, items: Iterable[tuple[str, bytes]]) -> None:
        """In order, in fenced transactions of at most MAX_TXN_WRITES (etcd's limit on the
        operations of one transaction is 128 by default): the last item is written last."""
        writes = [Write(k, v) for k, v in items]
        for start in range(0, len(writes), MAX_TXN_WRITES):
            await self._write(writes[start:start + MAX_TXN_WRITES])

    async def delete(self, key: str) -> None:
        raise NotImplementedError("a leader never deletes job state")

    async def compare_and_put(self, key: str, expected: bytes | None, value: bytes) -> bool:
        if not self._election.holds():
            raise LostLeadership(f"term {self._election.term} is over: write refused")
        return await self._inner.transaction([*self._guard(), (key, expected)], [Write(key, value)])

    async def transaction(self, compares: Sequence[Compare], writes: Sequence[Write]) -> bool:
        if not self._election.holds():
            raise LostLeadership(f"term {self._election.term} is over: write refused")
        return await self._inner.transaction([*self._guard(), *compares], writes)

    async def grant_lease(self, ttl_s: int) -> int:
        return await self._inner.grant_lease(ttl_s)

    async def refresh_lease(self, lease: int) -> bool:
        return await self._inner.refresh_lease(lease)

    async def revoke_lease(self, lease: int) -> None:
        await self._inner.revoke_lease(lease)
