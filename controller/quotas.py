"""Throughput-proportional quotas: how many of the M microbatches each replica computes.

Pure functions of (seconds per microbatch, M, and each replica's lead). A step ends when
its slowest member has computed its share, so the quotas minimise the step's *makespan*
max_r(l_r + q_r * t_r) over integer quotas summing to M, where l_r is the time replica r
starts its share after the commit (its lead: applying the commit, a callback, a
checkpoint; throughput.py): with one replica 2x slower than the others, uniform quotas
make every step wait for it, proportional ones give it about half as many; one that
evaluates for the time of two microbatches after every commit gets about two fewer.

The solver is the exchange-argument greedy: hand microbatches out one at a time, each to
the replica that would finish it earliest. Replica r's k-th microbatch ends at k * t_r,
increasing in k, so the greedy takes the M smallest of those finishing times, and no
integer split can have a smaller largest one: it is optimal (checked against brute
force in tests/unit/test_quotas.py). Ties go to the replica earlier in `order`, which is
what makes equal speeds give exactly `policy.uniform_plan` (the first M mod R take one
more). A water-filling bound pre-assigns all but O(R) microbatches, so a plan costs
O(R log R) whatever M.

Hysteresis (`should_replan`): estimates are noisy, and a plan that changes at every step
for a 1% gain is noise, not information (and it makes the quotas in `recover status`
flap). A new plan is adopted only when it is predicted to be more than `threshold`
shorter; see `should_replan` for what that guarantees.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Collection, Mapping, Sequence

from recover.controller.throughput import low_median

DEFAULT_THRESHOLD = 0.05
"""Replan only for a predicted step more than 5% shorter (tolerates ~5% estimate spread)."""

NOTABLE = 1.1
"""Reasons name a replica individually when it is 10% slower or faster than the median."""

LATE = 0.5
"""Reasons name a replica that starts its share half a typical microbatch or more after the
median replica (its lead, throughput.py)."""

NAMED_IN_REASON = 8
"""At most this many replicas named one by one in a reason (1,000 replicas: a summary)."""


class QuotaError(ValueError):
    """The inputs admit no quotas (no replica, M < 1, a non-positive time)."""


def _order(seconds_per_mb: Mapping[int, float], order: Sequence[int] | None) -> list[int]:
    if order is None:
        return sorted(seconds_per_mb)
    order = list(order)
    if len(set(order)) != len(order) or set(order) != set(seconds_per_mb):
        raise QuotaError(f"order {order} is not a permutation of replicas {sorted(seconds_per_mb)}")
    return order


def _check_times(seconds_per_mb: Mapping[int, float]) -> None:
    if not seconds_per_mb:
        raise QuotaError("no replica to plan for")
    bad = {r: t for r, t in seconds_per_mb.items() if not (math.isfinite(t) and t > 0)}
    if bad:
        raise QuotaError(f"seconds per microbatch must be finite and > 0: {bad}")


def finish_key(finish_s: float, grain_s: float) -> int:
    """A finishing time as a whole number of `grain_s`, for comparing and breaking ties.

    Finishing times reached by different sums (a spare's entry plus k of its times, a
    survivor's held plus k of its own) may differ in the last bit when they are equal
    in truth (7 * 0.3 + 0.3 != 8 * 0.3 in floating point); a tie must be a tie, or
    equal speeds would not give reassign_lost's deterministic answer.
    """
    return round(finish_s / grain_s)


def _grain(seconds_per_mb: Mapping[int, float]) -> float:
    return min(seconds_per_mb.values()) * 1e-9


def hand_out(count: int, seconds_per_mb: Mapping[int, float], order: Sequence[int],
             start: Mapping[int, int] | None = None,
             ready: Mapping[int, float] | None = None) -> dict[int, int]:
    """How many of `count` more microbatches each replica gets, so that the last finishes earliest.

    Replica r already holds `start[r]` (default 0) microbatches and can begin them at
    `ready[r]` seconds (default 0): its k-th new one ends at ready + (start + k) * t_r.
    Greedy on that finishing time (to `finish_key`'s grain), ties to the earlier in
    `order`; optimal for the makespan (module docstring). Used both to plan a step
    (`proportional_quotas`) and to hand out a lost replica's microbatches
    (`policy.ProportionalPolicy.reassign`).
    """
    start = start or {}
    ready = ready or {}
    t = {r: seconds_per_mb[r] for r in order}
    grain = _grain(t)

    def key(r: int, k: int) -> int:
        return finish_key(ready.get(r, 0.0) + (start.get(r, 0) + k) * t[r], grain)

    offset = {r: ready.get(r, 0.0) + start.get(r, 0) * t[r] for r in order}
    given = _bulk(count, offset, t, order)
    heap = [(key(r, given[r] + 1), position, r) for position, r in enumerate(order)]
    heapq.heapify(heap)
    for _ in range(count - sum(given.values())):
        _, position, r = heapq.heappop(heap)
        given[r] += 1
        heapq.heappush(heap, (key(r, given[r] + 1), position, r))
    return given


def hand_out_ids(ids: Sequence[int], seconds_per_mb: Mapping[int, float], order: Sequence[int],
                 start: Mapping[int, int] | None = None,
                 ready: Mapping[int, float] | None = None) -> dict[int, list[int]]:
    """`hand_out` for actual microbatch ids: who gets which, in `order`.

    The ids go out in the greedy's own sequence (earliest finishing first, ties in
    `order`), so with equal speeds and loads the result is the one `policy.reassign_lost`
    gives, id for id.
    """
    start = start or {}
    ready = ready or {}
    given = hand_out(len(ids), seconds_per_mb, order, start, ready)
    grain = _grain({r: seconds_per_mb[r] for r in order})
    picks = sorted((finish_key(ready.get(r, 0.0) + (start.get(r, 0) + k) * seconds_per_mb[r], grain),
                    position, r)
                   for position, r in enumerate(order) for k in range(1, given[r] + 1))
    out: dict[int, list[int]] = {r: [] for r in order}
    for microbatch, (_, _, r) in zip(ids, picks, strict=True):
        out[r].append(microbatch)
    return out


def _bulk(count: int, offset: Mapping[int, float], t: Mapping[int, float],
          order: Sequence[int]) -> dict[int, int]:
    """A safe head start for the greedy: microbatches it would certainly hand out.

    The water level L where sum_r max(0, (L - offset_r) / t_r) = count bounds the
    count-th smallest finishing time from below, so every microbatch finishing a whole
    t_r before L is one the greedy takes; what is left is at most ~2 per replica.
    """
    by_offset = sorted(order, key=lambda r: offset[r])
    inverse = weighted = 0.0
    level = math.inf
    for i, r in enumerate(by_offset):
        inverse += 1.0 / t[r]
        weighted += offset[r] / t[r]
        level = (count + weighted) / inverse
        if i + 1 == len(by_offset) or level <= offset[by_offset[i + 1]]:
            break
    return {r: max(0, math.ceil((level - offset[r]) / t[r]) - 2) for r in order}


def proportional_quotas(seconds_per_mb: Mapping[int, float], global_microbatches: int,
                        order: Sequence[int] | None = None, at_least: int = 1,
                        leads: Mapping[int, float] | None = None) -> dict[int, int]:
    """Integer quotas summing to M that minimise max_r(l_r + q_r * t_r), keyed in `order`
    (`leads`: each replica's l_r, default 0).

    `order` (default: by replica id) breaks ties, earlier first; pass the members' order
    to get exactly `uniform_plan` when the speeds are equal.

    Every replica keeps at least `at_least` (default 1) microbatches whenever M allows it
    (M >= at_least * R; else the floor is 0, as uniform plans give some members none).
    Why a floor, at a cost to the makespan only for a replica slower than the whole step
    (more than ~M/R times the typical time): a replica with no microbatch is never
    measured again, so one that was slow for a while (thermal throttling, a noisy
    neighbour) would stay at 0 for the rest of the job, its capacity lost for good; and
    it still takes part in every allreduce, so keeping it in the job is not free anyway.
    Pass at_least=0 for the unconstrained optimum.
    """
    _check_times(seconds_per_mb)
    members = _order(seconds_per_mb, order)
    if global_microbatches < 1:
        raise QuotaError(f"global microbatches must be >= 1, got {global_microbatches}")
    if at_least < 0:
        raise QuotaError(f"at_least must be >= 0, got {at_least}")
    floor = at_least if global_microbatches >= at_least * len(members) else 0
    extra = hand_out(global_microbatches - floor * len(members), seconds_per_mb, members,
                     start=dict.fromkeys(members, floor), ready=leads)
    return {r: floor + extra[r] for r in members}


def uniform_quotas(order: Sequence[int], global_microbatches: int) -> dict[int, int]:
    """The counts `uniform_plan` gives: M // R each, the first M mod R one more."""
    base, extra = divmod(global_microbatches, len(order))
    return {r: base + (1 if i < extra else 0) for i, r in enumerate(order)}


def makespan(quotas: Mapping[int, int], seconds_per_mb: Mapping[int, float],
             leads: Mapping[int, float] | None = None) -> float:
    """The predicted time from a commit to a step's computed: its slowest member's
    l_r + q_r * t_r (`leads`: l_r, default 0; 0 if empty)."""
    leads = leads or {}
    return max((leads.get(r, 0.0) + q * seconds_per_mb[r] for r, q in quotas.items()),
               default=0.0)


def quotas_of(assignment: Mapping[int, Sequence[int]]) -> dict[int, int]:
    """How many microbatches each replica holds in a plan."""
    return {r: len(ids) for r, ids in assignment.items()}


def contiguous_assignment(quotas: Mapping[int, int],
                          order: Sequence[int] | None = None) -> dict[int, tuple[int, ...]]:
    """Microbatch ids for quotas: contiguous runs from 0, replicas in `order` (default: the
    mapping's own order), the very shape `uniform_plan` produces (readable plans, and
    equal speeds give exactly today's uniform plan)."""
    members = list(quotas) if order is None else list(order)
    if sorted(members) != sorted(quotas) or len(set(members)) != len(members):
        raise QuotaError(f"order {members} is not a permutation of replicas {sorted(quotas)}")
    negative = {r: q for r, q in quotas.items() if q < 0}
    if negative:
        raise QuotaError(f"quotas must be >= 0: {negative}")
    assignment: dict[int, tuple[int, ...]] = {}
    first = 0
    for r in members:
        assignment[r] = tuple(range(first, first + quotas[r]))
        first += quotas[r]
    return assignment


def should_replan(current_quotas: Mapping[int, int], candidate_quotas: Mapping[int, int],
                  seconds_per_mb: Mapping[int, float],
                  threshold: float = DEFAULT_THRESHOLD,
                  leads: Mapping[int, float] | None = None) -> tuple[bool, str]:
    """Whether to leave the current quotas for the candidate, and why.

    Only when the candidate's predicted makespan is more than `threshold` shorter (or the
    members or the total changed: then the current quotas are no plan at all).

    What this guarantees: if the current quotas are optimal for the true speeds and every
    estimate is its true time times a factor in [lo, hi] with hi / lo <= 1 / (1 - threshold)
    (a spread of ~5.3% at 5%), no replan happens. Proof: with OPT the true optimal
    makespan, the current plan's estimated makespan is at most hi * OPT, and any plan's,
    the candidate's included, at least lo * OPT (leads within the same factors too: a
    makespan is a max of sums of them); so the predicted gain is at most
    1 - lo / hi <= threshold. A real 2x slowdown of one of 4 replicas predicts a step
    ~35% shorter and replans at once.
    """
    if threshold < 0:
        raise QuotaError(f"threshold must be >= 0, got {threshold}")
    if set(current_quotas) != set(candidate_quotas):
        gone = sorted(set(current_quotas) - set(candidate_quotas))
        new = sorted(set(candidate_quotas) - set(current_quotas))
        return True, f"members changed (left {gone}, entered {new}): plan afresh"
    if sum(current_quotas.values()) != sum(candidate_quotas.values()):
        return True, (f"the current plan covers {sum(current_quotas.values())} microbatches, "
                      f"not {sum(candidate_quotas.values())}: plan afresh")
    if dict(current_quotas) == dict(candidate_quotas):
        return False, "the current quotas are already the best"
    now = makespan(current_quotas, seconds_per_mb, leads)
    then = makespan(candidate_quotas, seconds_per_mb, leads)
    gain = (now - then) / now if now > 0 else 0.0
    told = (f"predicted step {_secs(now)} -> {_secs(then)}, {gain:.0%} shorter "
            f"(threshold {threshold:.0%})")
    if gain > threshold:
        return True, f"replan: {told}"
    return False, f"keep the current quotas: {told}"


def _secs(seconds: float) -> str:
    return f"{seconds:.3g}s"


def _counts(values: Sequence[int]) -> str:
    low, high = min(values), max(values)
    return f"{low}" if low == high else f"{low}-{high}"


def describe_quotas(quotas: Mapping[int, int], seconds_per_mb: Mapping[int, float],
                    measured: Collection[int] | None = None,
                    leads: Mapping[int, float] | None = None) -> str:
    """Why each replica got its quota, e.g. "replica 2 measured 2.1x slower than the
    median: 2 of 16 microbatches; replicas [0, 1, 3] near the median: 4-5 each".

    Replicas 10% or more off the median are named one by one (at most 8, slowest first,
    then a count), and so is one that starts its share late (`leads`, `LATE`);
    `measured` (default: all) tells which times are only assumed.
    """
    total = sum(quotas.values())
    measured_set = set(quotas) if measured is None else set(measured)
    typical = low_median(seconds_per_mb[r] for r in quotas)
    leads = leads or {}
    usual_lead = low_median(leads.get(r, 0.0) for r in quotas) or 0.0
    notes: list[tuple[float, str]] = []
    usual: list[int] = []
    for r, q in quotas.items():
        share = f"{q} of {total} microbatches"
        ratio = seconds_per_mb[r] / typical if typical else 1.0
        late = leads.get(r, 0.0) - usual_lead
        if typical and late >= LATE * typical:
            speed = f", {ratio:.1f}x the median's time per microbatch" \
                if ratio >= NOTABLE or ratio <= 1 / NOTABLE else ""
            notes.append((ratio + late / typical,
                          f"replica {r} starts its share {late * 1000:.3g} ms after the median "
                          f"(its time between steps){speed}: {share}"))
        elif r not in measured_set:
            notes.append((0.0, f"replica {r} not measured yet, assumed at the median: {share}"))
        elif ratio >= NOTABLE:
            notes.append((ratio, f"replica {r} measured {ratio:.1f}x slower than the median: {share}"))
        elif ratio <= 1 / NOTABLE:
            notes.append((ratio, f"replica {r} measured {1 / ratio:.1f}x faster than the median: "
                                 f"{share}"))
        else:
            usual.append(r)
    notes.sort(key=lambda note: -note[0])  # slowest first: what a reader looks for
    parts = [text for _, text in notes[:NAMED_IN_REASON]]
    if len(notes) > NAMED_IN_REASON:
        parts.append(f"{len(notes) - NAMED_IN_REASON} more replicas off the median")
    if usual:
        who = f"replicas {usual}" if len(usual) <= NAMED_IN_REASON else f"{len(usual)} replicas"
        each = _counts([quotas[r] for r in usual])
        parts.append(f"{who} near the median: {each} each" if len(usual) > 1
                     else f"replica {usual[0]} near the median: {each} of {total} microbatches")
    return "; ".join(parts)
