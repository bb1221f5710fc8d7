"""Work-stealing inside a step: who takes which unstarted microbatches from whom.

Pure decisions with reasons, tested table-style (tests/unit/test_stealing.py); the
protocol that carries them out is in stealflow.py, and in the README's design section.

A plan with work-stealing on is *open*: its members report their progress when it is news
(common/stealnews.py) and reduce only once the controller *closes* their share. When a member has
done its whole share (it is idle) while another still holds microbatches it has not
started, the controller asks that one (the giver) to release some; the giver answers with
exactly those it had not started, and only then are they handed to the idle member (the
taker). A started microbatch stays with whoever started it, and no microbatch is ever held
by two members, so each of the step's M is computed exactly once into the sum.

What the controller knows of a member is what it last reported: how many microbatches it
has done, when, and how long its last one took. Members report only news (common/stealnews.py:
on their last microbatch, idle, or off the assumed pace), so a silent one is assumed on
schedule. The decisions below are predictions, and need not be right to be safe: the giver,
not the prediction, decides what is released.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace

from recover.common.stealnews import assumed_done

DEFAULT_LATENCY_S = 0.005
"""A Release's round trip through the agents (controller -> giver -> controller -> taker)."""
MARGIN = 0.25
"""A microbatch moves only if that ends the giver's part sooner by at least this fraction of
one of its microbatches: a steal between replicas of about the same speed would gain
nothing and cost a round trip (equal but noisy replicas keep their shares)."""


@dataclass(frozen=True)
class Member:
    """One member of the step in flight, as the controller last heard of it."""

    replica: int
    share: tuple[int, ...]
    """Its microbatches in the plan now, in the order it computes them."""
    done: int
    """How many of them it reported done (a prefix of `share`)."""
    seconds_per_mb: float
    """Its current speed: its last microbatch's time, else its measured speed."""
    since: float
    """When its last report came (or the step began for it): its current microbatch began
    then."""
    closed: bool = False
    """Told that no more will come: it reduces once its share is done."""
    giving: bool = False
    """A Release to it is unanswered: nobody else may ask it until it answers."""
    taking: bool = False
    """Waiting for the answer to a Release made for it."""
    quiet: bool = False
    """It reports only news (common/stealnews.py): while silent it is assumed on schedule,
    whole microbatches at its pace since it was last heard of, never past the start of its
    last. False: it reports every microbatch, and a current one taking longer than its pace
    means a slower pace (the model of the first version, tests/unit/stealing_reference.py)."""
    idle: bool = field(init=False, repr=False, compare=False)
    """It has done its whole share. Set once, with `left`: a decision reads them for every
    member, several times (at 1,024 members, as properties they were a fifth of its time)."""
    left: int = field(init=False, repr=False, compare=False)
    """How many of its microbatches it has not finished (the one in progress included)."""

    def __post_init__(self) -> None:
        left = len(self.share) - self.done
        object.__setattr__(self, "left", max(left, 0))
        object.__setattr__(self, "idle", left <= 0)

    def pace(self, now: float) -> float:
        """Its seconds per microbatch from here on: its last speed, or longer if its current
        microbatch has already taken longer (a replica slowing down mid-step, or one not
        measured yet)."""
        return _seen(self, now).pace

    def boundary(self, now: float) -> float:
        """When its current microbatch ends: where it next reads a command."""
        return _seen(self, now).boundary

    def finish(self, now: float) -> float:
        """When it will have done its share, at its current pace."""
        return _seen(self, now).finish

    @property
    def unstarted(self) -> tuple[int, ...]:
        """Microbatches it has surely not started: all but the one in progress."""
        return self.share[self.done + 1:]


def assumed(member: Member, now: float) -> Member:
    """A quiet member as the controller assumes it is at `now` (what its silence says), as a
    member that reports every microbatch: the predictions of both are the same."""
    if not member.quiet:
        return member
    done = assumed_done(left=member.left, elapsed_s=now - member.since,
                        pace_s=member.seconds_per_mb)
    return replace(member, done=member.done + done,
                   since=member.since + done * member.seconds_per_mb, quiet=False)


@dataclass(frozen=True)
class Steal:
    """Ask `giver` to release the microbatches of `takes`; each is then its taker's."""

    giver: int
    takes: Mapping[int, tuple[int, ...]]
    """Taker -> the giver's unstarted microbatches it is to compute (once the giver answered:
    those it released)."""
    reason: str
    number: int = 0
    """The controller's number for it once asked (a Release and its answer carry it)."""

    @property
    def microbatch_ids(self) -> tuple[int, ...]:
        return tuple(mb for ids in self.takes.values() for mb in ids)


@dataclass(frozen=True)
class Decisions:
    """What the members' latest reports call for."""

    steals: tuple[Steal, ...] = ()
    close: Mapping[int, str] = field(default_factory=dict)
    """Members to close now (they reduce once done), with the reason."""


@dataclass(frozen=True)
class _Seen:
    """A member's predictions at the decision's `now`, computed once per decision."""

    member: Member
    finish: float
    pace: float
    boundary: float
    done: int
    """How many of its share it has done, reported or assumed (a quiet member)."""

    @property
    def unstarted(self) -> tuple[int, ...]:
        return self.member.share[self.done + 1:]

    @property
    def replica(self) -> int:
        return self.member.replica


def _seen(member: Member, now: float) -> _Seen:
    """A member's pace, boundary and finish at `now` (the one place they are computed), in
    one pass: a decision makes one for every member."""
    if member.idle:
        return _Seen(member, now, member.seconds_per_mb, now, member.done)
    since, per_mb, left = member.since, member.seconds_per_mb, member.left
    # Inlined `assumed` (no copy of the member: a decision makes one _Seen per member).
    silent = assumed_done(left=left, elapsed_s=now - since, pace_s=per_mb) if member.quiet else 0
    since, left = since + silent * per_mb, left - silent
    pace = max(per_mb, now - since)
    boundary = max(since + per_mb, now)
    return _Seen(member, boundary + (left - 1) * pace, pace, boundary, member.done + silent)


def _by_finish(seen: _Seen) -> tuple[float, int]:
    return seen.finish, seen.replica


def split_unstarted(giver: Member, takers: Sequence[Member], now: float,
                    latency_s: float = DEFAULT_LATENCY_S) -> dict[int, tuple[int, ...]]:
    """Which of the giver's unstarted microbatches each taker should compute (list
    scheduling from the giver's end): one moves while the taker that would finish it
    earliest finishes at least MARGIN of a giver's microbatch before the giver would with
    it. A taker starts on them once the giver, at its next microbatch boundary, has released
    them and the news has reached it."""
    return _split(_seen(giver, now), sorted((_seen(t, now) for t in takers), key=_by_finish),
                  latency_s)


def _split(giver: _Seen, takers: Iterable[_Seen], latency_s: float,
           idle_by_pace: Sequence[_Seen] = ()) -> dict[int, tuple[int, ...]]:
    """split_unstarted of predictions: `takers` in order of (finish, replica), and idle
    takers either there or, in order of (pace, replica), in `idle_by_pace`."""
    unstarted = giver.unstarted
    giver_end, giver_pace = giver.finish, giver.pace
    start = giver.boundary + latency_s
    candidates = _first_to_end(takers, idle_by_pace, start, len(unstarted))
    free = {t.replica: max(t.finish, start) for t in candidates}
    speed = {t.replica: t.pace for t in candidates}
    takes: dict[int, list[int]] = {}
    for mb in reversed(unstarted):
        if not free:
            break
        best = min(free, key=lambda r: (free[r] + speed[r], r))
        if free[best] + speed[best] > giver_end - MARGIN * giver_pace:
            break  # the taker would end it hardly sooner than the giver (or later)
        free[best] += speed[best]
        giver_end -= giver_pace
        takes.setdefault(best, []).insert(0, mb)
    return {r: tuple(ids) for r, ids in takes.items()}


def _first_to_end(takers: Iterable[_Seen], idle_by_pace: Sequence[_Seen], start: float,
                  count: int) -> list[_Seen]:
    """The `count` takers that would end a first microbatch of the giver's earliest, by
    (end, replica). Only they can be given any of its `count` microbatches: each pick takes
    the earliest end and delays only the taker picked, so before the last pick one of them
    is still untouched and ends before every other taker. An idle taker ends at `start` +
    its pace (the first `count` of `idle_by_pace`); another's end is at least its finish, so
    the scan, in order of finish, stops at the first that finishes after the `count`-th end
    found."""
    if count == 0:
        return []
    worst_first: list[tuple[float, int, _Seen]] = []  # a max-heap of (end, replica)

    def offer(taker: _Seen) -> None:
        entry = (-(max(taker.finish, start) + taker.pace), -taker.replica, taker)
        if len(worst_first) < count:
            heapq.heappush(worst_first, entry)
        elif entry[:2] > worst_first[0][:2]:
            heapq.heapreplace(worst_first, entry)

    for taker in idle_by_pace[:count]:
        offer(taker)
    for taker in takers:
        if len(worst_first) == count and taker.finish > -worst_first[0][0]:
            break
        offer(taker)
    return [entry[2] for entry in worst_first]


class _Takers:
    """The members not busy, as takers: idle ones by (pace, replica), the others by
    (finish, replica), each taken out once it gives or takes in a steal."""

    def __init__(self, free: Iterable[_Seen], now: float) -> None:
        self.now = now
        free = list(free)
        self.idle = sorted((s for s in free if s.member.idle), key=_by_pace)
        self.working = sorted((s for s in free if not s.member.idle), key=_by_finish)
        self.last_one = [s for s in self.working if s.member.left <= 1]
        """Members on their last microbatch, by finish: about to be idle."""
        self.fastest = min((s.pace for s in free), default=float("inf"))
        """No taker's pace is below this (takers only ever leave)."""

    def near_end_before(self, finish: float) -> bool:
        """Is anyone idle or on its last microbatch that finishes before `finish`?"""
        return bool(self.idle and self.now < finish
                    or self.last_one and self.last_one[0].finish < finish)

    def split(self, giver: _Seen, latency_s: float) -> dict[int, tuple[int, ...]]:
        """_split over the takers that finish before the giver. Skipped (same answer) when
        no taker could end even the giver's last microbatch soon enough: none starts it
        before the earliest finish among them nor before the giver releases it, nor takes
        less than the fastest pace among them; most givers near a step's end are such."""
        start = giver.boundary + latency_s
        idle = self.idle and self.now < giver.finish
        earliest = self.now if idle else self.working[0].finish if self.working else None
        if earliest is None or (max(earliest, start) + self.fastest
                                > giver.finish - MARGIN * giver.pace):
            return {}
        before = bisect.bisect_left(self.working, giver.finish, key=lambda s: s.finish)
        return _split(giver, itertools.islice(self.working, before), latency_s,
                      self.idle if self.now < giver.finish else ())

    def remove(self, seen: _Seen) -> None:
        for members, order in ((self.idle, _by_pace), (self.working, _by_finish),
                               (self.last_one, _by_finish)):
            at = bisect.bisect_left(members, order(seen), key=order)
            if at < len(members) and members[at] is seen:
                del members[at]


def _by_pace(seen: _Seen) -> tuple[float, int]:
    return seen.pace, seen.replica


def decide(members: Mapping[int, Member], now: float,
           latency_s: float = DEFAULT_LATENCY_S) -> Decisions:
    """Steals and closes: once a member is idle or on its last microbatch, the members
    predicted to finish last give their unstarted microbatches to those that would finish
    them sooner (idle members, or members about to be), and an idle member nothing is left
    for is closed; an idle member that could get something once a pending Release is
    answered waits for it. Once no member holds an unstarted microbatch, every member is
    closed, busy or not. About O(members log members) in a step's usual end (1,024
    members: a quadratic first version took 0.9 s a call); the controller decides on news
    only, once per pass of its loop (stealflow.StealBook.progress, Coordinator._steer)."""
    idle = [m for m in members.values() if m.idle and not m.closed and not m.taking]
    settled = [m for m in members.values() if not (m.closed or m.giving or m.taking)]
    if not any(m.giving or m.taking for m in members.values()) and \
            not any(m.left > 1 for m in settled):
        # Nobody holds a microbatch it has not started, and only those ever move: no steal
        # can come in this step, so every member may reduce as soon as it is done (the last
        # to finish then needs no round trip to learn it).
        return Decisions(close={m.replica: f"replica {m.replica}: no member holds a "
                                           "microbatch it has not started" for m in settled})
    # A member on its last microbatch is about to be idle: deciding then, not once it is,
    # lets the Release reach a giver before it starts another microbatch.
    ready = [m for m in members.values() if not (m.closed or m.taking) and m.left <= 1]
    if not ready:
        return Decisions()
    busy = {m.replica for m in members.values() if m.giving or m.taking or m.closed}
    seen = {r: _seen(m, now) for r, m in members.items() if r not in busy}
    takers = _Takers(seen.values(), now)
    steals: list[Steal] = []
    givers = sorted((s for s in seen.values() if s.member.left > 1),
                    key=lambda s: (-s.finish, s.replica))
    for giver in givers:
        if giver.replica in busy:
            continue  # it takes in a steal decided above
        if not takers.near_end_before(giver.finish):
            continue  # nobody near the end of its share yet: nobody to take
        takes = takers.split(giver, latency_s)
        if not takes:
            continue
        after = max(giver.finish - sum(map(len, takes.values())) * giver.pace,
                    *(max(seen[t].finish, giver.boundary + latency_s)
                      + len(ids) * seen[t].pace for t, ids in takes.items()))
        steals.append(Steal(giver.replica, takes, (
            f"replica {giver.replica} ({_ms(giver.pace)}/microbatch) gives "
            + ", ".join(f"{list(ids)} to replica {t}" for t, ids in sorted(takes.items()))
            + f": its part of the step ends in {_ms(after - now)} instead of "
            f"{_ms(giver.finish - now)}")))
        for replica in (giver.replica, *takes):
            busy.add(replica)
            takers.remove(seen[replica])
    pending = any(m.giving for m in members.values())
    close = {m.replica: f"replica {m.replica} idle: nothing left worth taking"
             for m in idle if m.replica not in busy and not pending}
    return Decisions(tuple(steals), close)


def last_open(members: Mapping[int, Member]) -> int | None:
    """The one member still open when every other is closed: nobody is left to take from
    it, so it may be closed before it finishes (it then reduces without asking)."""
    still_open = [m for m in members.values() if not m.closed]
    if len(still_open) != 1:
        return None
    last = still_open[0]
    return None if last.giving or last.taking else last.replica


def after_release(share: Sequence[int], released: Sequence[int]) -> tuple[int, ...]:
    """The giver's share once `released` left it (order kept)."""
    gone = set(released)
    return tuple(mb for mb in share if mb not in gone)


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.0f} ms"
