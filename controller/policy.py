"""Workload policy: who computes which of the M global microbatches.

Pure functions of the membership and the current plan; each returns the plan
and a human-readable reason, so decisions can be logged, shown in events and
tested table-style. M never changes: a plan always covers microbatches
0..M-1 exactly once, whatever the number of live replicas.
"""

from __future__ import annotations

import heapq
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from recover.controller.quotas import (
    DEFAULT_THRESHOLD,
    QuotaError,
    contiguous_assignment,
    describe_quotas,
    hand_out_ids,
    makespan,
    proportional_quotas,
    quotas_of,
    should_replan,
)
from recover.controller.throughput import Speeds

Assignment = dict[int, tuple[int, ...]]
"""replica id -> the microbatch ids it computes in the step."""


@dataclass(frozen=True)
class PlanDecision:
    assignment: Assignment
    """Microbatch ids per live replica, every id in 0..M-1 exactly once."""
    reason: str
    """Why the plan looks the way it does, for events and logs."""


class PolicyError(ValueError):
    """The inputs admit no valid plan (e.g. no live replica)."""


def uniform_plan(members: Sequence[int], global_microbatches: int) -> PlanDecision:
    """Split M into contiguous, near-equal runs in member order.

    Contiguous runs keep a replica's microbatches adjacent, which makes plans
    easy to read; the first M mod R members take one extra.
    """
    if not members:
        raise PolicyError("no live replica to plan for")
    if global_microbatches < 1:
        raise PolicyError(f"global microbatches must be >= 1, got {global_microbatches}")
    if len(set(members)) != len(members):
        raise PolicyError(f"duplicate members in {list(members)}")
    base, extra = divmod(global_microbatches, len(members))
    assignment: Assignment = {}
    start = 0
    for position, replica in enumerate(members):
        count = base + (1 if position < extra else 0)
        assignment[replica] = tuple(range(start, start + count))
        start += count
    reason = (
        f"uniform: {global_microbatches} microbatches over {len(members)} replicas "
        f"({base}{'-' + str(base + 1) if extra else ''} each)"
    )
    return PlanDecision(assignment, reason)


def reassign_lost(
    current: Mapping[int, Sequence[int]],
    lost: Sequence[int],
    survivors: Sequence[int],
    spares: Sequence[int] = (),
) -> PlanDecision:
    """Keep every survivor's microbatches and hand the lost replicas' ones out.

    Survivors keep what they had (they may already have accumulated it); each
    lost microbatch goes to the survivor with the smallest load so far, which
    under uniform throughput is the one that will finish earliest. Ties go to
    the earlier member, so the decision is deterministic.

    `spares` enter in the lost replicas' place (they hold this step's state).
    How far the survivors got with their own microbatches is unknown here, so
    the lost ones are spread evenly over spares and survivors, spares first,
    rather than all given to the idle spares: handing a spare the whole lost
    share made the failed step 1.82x a normal one in the rejoin benchmark (the
    spare starts from scratch mid-step), spreading it 1.34x, no longer than
    recomputing on the survivors alone (1.41x; BENCHMARKS.md section 8).
    """
    if not survivors and not spares:
        raise PolicyError(f"replicas {sorted(lost)} lost and no survivor left")
    unknown = [r for r in survivors if r not in current]
    if unknown:
        raise PolicyError(f"survivors {unknown} have no assignment in the current plan")
    members = [*survivors, *spares]
    if len(set(members)) != len(members):
        raise PolicyError(f"survivors {list(survivors)} and spares {list(spares)} must be "
                          "distinct replicas")
    orphaned = sorted(mb for r in lost for mb in current.get(r, ()))
    gains: dict[int, list[int]] = {}
    spare_set = set(spares)
    # Who takes the next orphan: the smallest (what it was given now, not a spare, its
    # place) with spares, else (its load, its place); its place makes every key distinct,
    # so the heap's first is the one `min` over the members would pick. Tuples of ints, not
    # a list per member: at 12,500 members, 25,000 short-lived lists per loss made Python's
    # collector walk the leader's whole heap during most losses (BENCHMARKS.md 5).
    heap = [(0, r not in spare_set, i, r) if spare_set else (len(current[r]), i, 0, r)
            for i, r in enumerate(members)] if orphaned else []
    heapq.heapify(heap)
    for microbatch in orphaned:
        first, second, third, target = heap[0]
        gains.setdefault(target, []).append(microbatch)
        heapq.heapreplace(heap, (first + 1, second, third, target))
    assignment = {}
    for r in members:
        kept = () if r in spare_set else tuple(current[r])
        assignment[r] = (*kept, *gains[r]) if r in gains else kept
    entered = f"; spares {list(spares)} take their place" if spares else ""
    if not orphaned:
        reason = f"replicas {sorted(lost)} lost with no microbatches; plan unchanged{entered}"
    else:
        moves = ", ".join(f"{len(gains[r])} to replica {r}" for r in members if r in gains)
        how = "spread evenly, spares first" if spares else "to the least-loaded survivors"
        reason = (
            f"replicas {sorted(lost)} lost{entered}; their {len(orphaned)} microbatches "
            f"reassigned {how}: {moves}"
        )
    return PlanDecision(assignment, reason)


def drop_lost(
    current: Mapping[int, Sequence[int]],
    lost: Sequence[int],
    survivors: Sequence[int],
) -> PlanDecision:
    """The shrinking-batch ablation: the lost replicas' microbatches are simply not computed.

    This breaks the invariant on purpose (what systems that shrink the batch
    do); it exists to measure the drift the invariant prevents.
    """
    if not survivors:
        raise PolicyError(f"replicas {sorted(lost)} lost and no survivor left")
    unknown = [r for r in survivors if r not in current]
    if unknown:
        raise PolicyError(f"survivors {unknown} have no assignment in the current plan")
    dropped = sorted(mb for r in lost for mb in current.get(r, ()))
    assignment = {r: tuple(current[r]) for r in survivors}
    reason = (f"drop policy: replicas {sorted(lost)} lost; their {len(dropped)} microbatches "
              f"{dropped} are dropped from this step")
    return PlanDecision(assignment, reason)


def check_plan(assignment: Mapping[int, Sequence[int]], global_microbatches: int,
               expected_ids: Sequence[int] | None = None) -> str | None:
    """Why `assignment` breaks the invariant, or None when it covers 0..M-1 once.

    `expected_ids` replaces 0..M-1 when a plan legitimately covers less (the drop policy).
    """
    seen: list[int] = sorted(mb for ids in assignment.values() for mb in ids)
    expected_list = sorted(expected_ids) if expected_ids is not None else list(range(global_microbatches))
    if seen == expected_list:
        return None
    expected = set(expected_list)
    missing = sorted(expected - set(seen))
    duplicated = sorted({mb for mb in seen if seen.count(mb) > 1})
    out_of_range = sorted({mb for mb in seen if not 0 <= mb < global_microbatches})
    unplanned = sorted({mb for mb in seen if mb not in expected and 0 <= mb < global_microbatches})
    return (f"plan covers the wrong microbatches: missing {missing}, duplicated {duplicated}"
            + (f", outside 0..{global_microbatches - 1}: {out_of_range}" if out_of_range else "")
            + (f", not planned this step: {unplanned}" if unplanned else ""))


class PlanPolicy(ABC):
    """Who computes what: the one place a job's `policy` setting is looked at.

    The coordinator asks a policy for every plan (at the start, at each commit, when the
    membership changes at a step boundary) and for every change mid-step (a loss); each
    answer is a PlanDecision with its reason. Quota policies plug in here.
    """

    name: str = ""
    spares_enter_mid_step: bool = True
    """May a caught-up spare take a lost member's place inside the step being recovered?"""

    def plan(self, members: Sequence[int], global_microbatches: int) -> PlanDecision:
        """The plan of a step that nobody has started yet."""
        return uniform_plan(members, global_microbatches)

    @abstractmethod
    def reassign(self, current: Mapping[int, Sequence[int]], lost: Sequence[int],
                 survivors: Sequence[int], spares: Sequence[int] = ()) -> PlanDecision:
        """The plan of a step in flight after `lost` went: survivors keep what they had."""

    def expected(self, current: Mapping[int, Sequence[int]],
                 global_microbatches: int) -> list[int] | None:
        """The microbatch ids a commit of the step planned as `current` must cover (None:
        all of 0..M-1, the invariant)."""
        return None

    def with_measurements(self, speeds: Speeds | None,
                          current: Mapping[int, Sequence[int]] | None = None) -> PlanPolicy:
        """This policy informed of the measured speeds and of the plan the workers hold.

        How a driver hands measurements to a quota policy without changing any call of
        `plan`/`reassign`: bind them once per transition. A policy that plans by counts
        alone ignores them and returns itself.
        """
        return self


class RecoverPolicy(PlanPolicy):
    """ReCoVer's own: uniform quotas; a lost replica's microbatches are recomputed by the
    survivors (and spares) inside the step, so every step sums all M."""

    name = "recover"

    def reassign(self, current: Mapping[int, Sequence[int]], lost: Sequence[int],
                 survivors: Sequence[int], spares: Sequence[int] = ()) -> PlanDecision:
        return reassign_lost(current, lost, survivors, spares)


class DropPolicy(PlanPolicy):
    """The shrinking-batch ablation (drop_lost): a lost replica's microbatches are dropped,
    so a step commits with what its planned survivors computed."""

    name = "drop"
    spares_enter_mid_step = False

    def reassign(self, current: Mapping[int, Sequence[int]], lost: Sequence[int],
                 survivors: Sequence[int], spares: Sequence[int] = ()) -> PlanDecision:
        return drop_lost(current, lost, survivors)

    def expected(self, current: Mapping[int, Sequence[int]],
                 global_microbatches: int) -> list[int] | None:
        return [mb for ids in current.values() for mb in ids]


class ProportionalPolicy(PlanPolicy):
    """Quotas in proportion to measured throughput (quotas.py), so a step takes what the
    sum of the replicas' speeds allows instead of waiting for the slowest at M/R.

    Speeds come as a frozen `Speeds` snapshot (throughput.py), bound by the constructor or
    `with_measurements` (how a driver passes them) or given per call (`speeds=`, which
    wins), so every decision stays a pure function of its arguments. With no speeds, or
    nobody measured, every answer is RecoverPolicy's, exactly: the coordinator's calls
    `plan(members, M)` and `reassign(plan, lost, survivors, spares)` work unchanged and
    mean what they mean today.
    """

    name = "proportional"

    def __init__(self, speeds: Speeds | None = None, threshold: float = DEFAULT_THRESHOLD,
                 at_least: int = 1, current: Mapping[int, Sequence[int]] | None = None) -> None:
        self.speeds = speeds
        self.current = current
        """The plan the workers hold, for `plan`'s hysteresis when no `current=` is passed."""
        self.threshold = threshold
        """Hysteresis: replan only for a predicted step this much shorter (should_replan)."""
        self.at_least = at_least
        """Microbatches every member keeps when M allows (proportional_quotas says why)."""

    def with_measurements(self, speeds: Speeds | None,
                          current: Mapping[int, Sequence[int]] | None = None) -> ProportionalPolicy:
        """A copy bound to these speeds and this plan (the hysteresis' `current`)."""
        return ProportionalPolicy(speeds, self.threshold, self.at_least, current)

    def _seconds(self, members: Sequence[int],
                 speeds: Speeds | None) -> tuple[Speeds, dict[int, float]] | None:
        """The snapshot in force and every member's seconds per microbatch, or None (uniform)."""
        speeds = self.speeds if speeds is None else speeds
        seconds = None if speeds is None else speeds.seconds_for(members)
        return None if speeds is None or seconds is None else (speeds, seconds)

    def plan(self, members: Sequence[int], global_microbatches: int, *, speeds: Speeds | None = None,
             current: Mapping[int, Sequence[int]] | None = None) -> PlanDecision:
        """Quotas minimising the step's predicted makespan, as contiguous runs in member order
        (equal speeds: exactly `uniform_plan`). With `current` (the plan of the step just
        committed; default: the one bound by `with_measurements`), its quotas are kept
        unless the new ones predict a step more than `threshold` shorter or the members
        changed, so noise does not make plans flap."""
        uniform = uniform_plan(members, global_microbatches)  # also validates the inputs
        known = self._seconds(members, speeds)
        if known is None:
            return uniform
        measured, seconds = known
        leads = measured.lead_for(members)  # each one's start after the commit
        try:
            candidate = proportional_quotas(seconds, global_microbatches, members, self.at_least,
                                            leads)
        except QuotaError as exc:
            raise PolicyError(str(exc)) from None
        head = (f"proportional: {global_microbatches} microbatches over {len(members)} replicas "
                "by measured speed")
        current = self.current if current is None else current
        if current is not None:
            replan, why = should_replan(quotas_of(current), candidate, seconds, self.threshold,
                                        leads)
            if not replan:
                kept = quotas_of(current)
                return PlanDecision(contiguous_assignment(kept, members), f"{head}; {why}; "
                                    f"{describe_quotas(kept, seconds, measured, leads)}")
        predicted = makespan(candidate, seconds, leads)
        even = makespan(quotas_of(uniform.assignment), seconds, leads)
        return PlanDecision(contiguous_assignment(candidate, members),
                            f"{head}, predicted step {predicted:.3g}s (uniform {even:.3g}s); "
                            f"{describe_quotas(candidate, seconds, measured, leads)}")

    def reassign(self, current: Mapping[int, Sequence[int]], lost: Sequence[int],
                 survivors: Sequence[int], spares: Sequence[int] = (), *,
                 speeds: Speeds | None = None, elapsed_s: float | None = None) -> PlanDecision:
        """Survivors keep every microbatch they hold (they may have accumulated it: a plan
        that takes one away would count it twice or lose it); each lost one goes, in id
        order, to whoever would finish it earliest given measured speeds and loads.

        A survivor can take new work once its own is done (held * seconds per microbatch
        into the step). A spare starts from nothing but can begin only when it has
        entered: at `elapsed_s` into the step when the caller knows it (then a survivor
        already done also starts then), else assumed when the busiest survivor finishes
        its own share, the case of a loss found at the allreduce. That assumption is
        what the rejoin benchmark supports (BENCHMARKS.md section 8: handing a spare
        the whole lost share made the step 1.82x, spreading it 1.34x), and with equal
        speeds and loads it gives `reassign_lost`'s answer id for id: spread evenly,
        spares first. So spares get more only where that finishes the step earlier.
        """
        members = [*survivors, *spares]
        known = self._seconds(members, speeds)
        if known is None:
            return reassign_lost(current, lost, survivors, spares)
        if not members:
            raise PolicyError(f"replicas {sorted(lost)} lost and no survivor left")
        unknown = [r for r in survivors if r not in current]
        if unknown:
            raise PolicyError(f"survivors {unknown} have no assignment in the current plan")
        measured, seconds = known
        held = {r: len(current[r]) for r in survivors}
        if elapsed_s is None:
            entry = max((held[r] * seconds[r] for r in survivors), default=0.0)
            start, ready = held, dict.fromkeys(spares, entry)
        else:
            busy = {r for r in survivors if held[r] * seconds[r] >= elapsed_s}
            start = {r: held[r] for r in busy}
            ready = {r: float(elapsed_s) for r in members if r not in busy}
        orphaned = sorted(mb for r in lost for mb in current.get(r, ()))
        gains = hand_out_ids(orphaned, seconds, [*spares, *survivors], start, ready)
        assignment = {r: (*(current[r] if r in held else ()), *gains[r]) for r in members}
        entered = f"; spares {list(spares)} take their place" if spares else ""
        if not orphaned:
            return PlanDecision(assignment, f"replicas {sorted(lost)} lost with no microbatches; "
                                            f"plan unchanged{entered}")
        finish = max(ready.get(r, 0.0) + (start.get(r, 0) + len(gains[r])) * seconds[r]
                     for r in members)
        moves = ", ".join(f"{len(gains[r])} to replica {r}" for r in members if gains[r])
        return PlanDecision(assignment, (
            f"replicas {sorted(lost)} lost{entered}; their {len(orphaned)} microbatches "
            f"reassigned to finish earliest by measured speed: {moves}; predicted step "
            f"{finish:.3g}s; {describe_quotas(quotas_of(assignment), seconds, measured)}"))


POLICIES: dict[str, type[PlanPolicy]] = {
    p.name: p for p in (RecoverPolicy, DropPolicy, ProportionalPolicy)}
"""Every policy a job may name; the default (a job's empty `policy`) is ProportionalPolicy,
which plans exactly as RecoverPolicy until replicas measurably differ in speed."""


def policy_for(name: str) -> PlanPolicy:
    """The policy a job names (`""`: the default, proportional)."""
    try:
        return POLICIES[name or ProportionalPolicy.name]()
    except KeyError:
        raise PolicyError(f"unknown policy {name!r}: use one of {', '.join(POLICIES)}") from None


MAX_SCALE_EPOCHS = 3
"""Exact reduction: redos of one step before giving up (each lowers the scale by 2**16)."""


@dataclass(frozen=True)
class RedoDecision:
    redo: bool
    """True: redo the step at `scale_epoch`; False: the job must fail."""
    scale_epoch: int
    reason: str


def overflow_redo(step: int, scale_epoch: int, overflowed: int,
                  max_epochs: int = MAX_SCALE_EPOCHS) -> RedoDecision:
    """Whether a step whose exact reduction overflowed is redone at a lower scale.

    A finite gradient that outgrew the predicted scale fits after one redo
    (each lowers the scale by 2**16, on top of 2**10 headroom). One that still does not fit
    after `max_epochs` is non-finite (NaN/inf) or absurdly large: redoing it
    forever would hang the job, so it fails with a reason a user can act on.
    """
    if scale_epoch >= max_epochs:
        return RedoDecision(False, scale_epoch,
                            f"exact reduction: {overflowed} microbatches of step {step} still "
                            f"overflow after {scale_epoch} rescalings; "
                            "the gradient is non-finite (NaN/inf) or diverged: lower the learning "
                            "rate or check the data")
    return RedoDecision(True, scale_epoch + 1,
                        f"exact reduction: {overflowed} microbatches overflowed the predicted "
                        f"scale; redo step {step} at scale epoch {scale_epoch + 1}")
