"""The work-stealing decisions as first written (quadratic in the members), kept as the
reference that controller/stealing.py's faster `decide` must agree with exactly
(test_stealing.py's property test)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from recover.controller.stealing import DEFAULT_LATENCY_S, MARGIN, Decisions, Member, Steal, _ms


def reference_split_unstarted(giver: Member, takers: Sequence[Member], now: float,
                    latency_s: float = DEFAULT_LATENCY_S) -> dict[int, tuple[int, ...]]:
    """Which of the giver's unstarted microbatches each taker should compute (list
    scheduling from the giver's end): one moves while the taker that would finish it
    earliest finishes at least MARGIN of a giver's microbatch before the giver would with
    it. A taker starts on them once the giver, at its next microbatch boundary, has released
    them and the news has reached it."""
    giver_end, giver_pace = giver.finish(now), giver.pace(now)
    start = giver.boundary(now) + latency_s
    free = {t.replica: max(t.finish(now), start) for t in takers}
    speed = {t.replica: t.pace(now) for t in takers}
    takes: dict[int, list[int]] = {}
    for mb in reversed(giver.unstarted):
        if not free:
            break
        best = min(free, key=lambda r: (free[r] + speed[r], r))
        if free[best] + speed[best] > giver_end - MARGIN * giver_pace:
            break  # the taker would end it hardly sooner than the giver (or later)
        free[best] += speed[best]
        giver_end -= giver_pace
        takes.setdefault(best, []).insert(0, mb)
    return {r: tuple(ids) for r, ids in takes.items()}


def reference_decide(members: Mapping[int, Member], now: float,
           latency_s: float = DEFAULT_LATENCY_S) -> Decisions:
    """Steals and closes: once a member is idle or on its last microbatch, the members
    predicted to finish last give their unstarted microbatches to those that would finish
    them sooner (idle members, or members about to be), and an idle member nothing is left
    for is closed; an idle member that could get something once a pending Release is
    answered waits for it. Once no member holds an unstarted microbatch, every member is
    closed, busy or not."""
    idle = [m for m in members.values() if m.idle and not m.closed and not m.taking]
    settled = [m for m in members.values() if not (m.closed or m.giving or m.taking)]
    if not any(m.giving or m.taking for m in members.values()) and \
            not any(m.unstarted for m in settled):
        # Nobody holds a microbatch it has not started, and only those ever move: no steal
        # can come in this step, so every member may reduce as soon as it is done (the last
        # to finish then needs no round trip to learn it).
        return Decisions(close={m.replica: f"replica {m.replica}: no member holds a "
                                           "microbatch it has not started" for m in settled})
    # A member on its last microbatch is about to be idle: deciding then, not once it is,
    # lets the Release reach a giver before it starts another microbatch.
    ready = [m for m in members.values() if not (m.closed or m.taking) and not m.unstarted]
    if not ready:
        return Decisions()
    busy = {m.replica for m in members.values() if m.giving or m.taking or m.closed}
    steals: list[Steal] = []
    givers = sorted((m for m in members.values() if m.unstarted and m.replica not in busy),
                    key=lambda m: (-m.finish(now), m.replica))
    for giver in givers:
        if giver.replica in busy:
            continue  # it takes in a steal decided above
        takers = [m for m in members.values() if m.replica != giver.replica
                  and m.replica not in busy and m.finish(now) < giver.finish(now)]
        if not any(not t.unstarted for t in takers):
            continue  # nobody near the end of its share yet: nobody to take
        takes = reference_split_unstarted(giver, takers, now, latency_s)
        if not takes:
            continue
        after = max(giver.finish(now) - sum(map(len, takes.values())) * giver.pace(now),
                    *(max(members[t].finish(now), giver.boundary(now) + latency_s)
                      + len(ids) * members[t].pace(now) for t, ids in takes.items()))
        steals.append(Steal(giver.replica, takes, (
            f"replica {giver.replica} ({_ms(giver.pace(now))}/microbatch) gives "
            + ", ".join(f"{list(ids)} to replica {t}" for t, ids in sorted(takes.items()))
            + f": its part of the step ends in {_ms(after - now)} instead of "
            f"{_ms(giver.finish(now) - now)}")))
        busy |= {giver.replica, *takes}
    pending = any(m.giving for m in members.values())
    close = {m.replica: f"replica {m.replica} idle: nothing left worth taking"
             for m in idle if m.replica not in busy and not pending}
    return Decisions(tuple(steals), close)
