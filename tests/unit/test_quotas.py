"""Table-style tests of throughput-proportional quotas (controller/quotas.py) and of the
ProportionalPolicy built on them (controller/policy.py).

Rows pin the exact quotas or assignment *and* a substring of the reason, which is what
users read in `recover events`; brute force and property tests pin optimality and the
invariant (every one of the M microbatches planned exactly once).
"""

from __future__ import annotations

import itertools
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from recover.controller.policy import (
    ProportionalPolicy,
    check_plan,
    uniform_plan,
)
from recover.controller.quotas import (
    QuotaError,
    contiguous_assignment,
    describe_quotas,
    finish_key,
    hand_out,
    makespan,
    proportional_quotas,
    should_replan,
    uniform_quotas,
)
from recover.controller.throughput import Speeds, ThroughputEstimator

# ---------------------------------------------------------------- proportional_quotas

QUOTA_ROWS = [
    pytest.param({0: 1.0, 1: 1.0, 2: 1.0, 3: 1.0}, 16, {0: 4, 1: 4, 2: 4, 3: 4}, id="equal"),
    pytest.param({0: 1.0, 1: 1.0, 2: 1.0, 3: 2.0}, 16, {0: 5, 1: 5, 2: 4, 3: 2},
                 id="one-2x-slow-gets-about-half"),
    pytest.param({0: 1.0, 1: 1.0, 2: 1.0, 3: 2.0}, 64, {0: 19, 1: 18, 2: 18, 3: 9},
                 id="one-2x-slow-large-M"),
    pytest.param({0: 0.5, 1: 1.0, 2: 1.0, 3: 1.0}, 16, {0: 7, 1: 3, 2: 3, 3: 3},
                 id="one-2x-fast"),
    pytest.param({0: 1.0, 1: 2.0, 2: 4.0}, 7, {0: 4, 1: 2, 2: 1}, id="geometric-speeds"),
    pytest.param({0: 1.0, 1: 10.0}, 4, {0: 3, 1: 1}, id="very-slow-keeps-its-one"),
    pytest.param({0: 1.0, 1: 10.0, 2: 1.0}, 2, {0: 1, 1: 0, 2: 1}, id="M-below-R-slow-gets-none"),
    pytest.param({2: 1.0, 0: 1.0, 1: 1.0}, 5, {0: 2, 1: 2, 2: 1}, id="default-order-by-id"),
]


@pytest.mark.parametrize(("seconds", "m", "expected"), QUOTA_ROWS)
def test_proportional_quotas(seconds, m, expected):
    quotas = proportional_quotas(seconds, m)
    assert quotas == expected
    assert list(quotas) == sorted(seconds)
    assert sum(quotas.values()) == m


@pytest.mark.parametrize(("seconds", "m", "order", "at_least", "expected"), [
    pytest.param({3: 1.0, 1: 1.0, 2: 1.0}, 5, [3, 1, 2], 1, {3: 2, 1: 2, 2: 1},
                 id="ties-follow-the-given-order"),
    pytest.param({0: 1.0, 1: 10.0}, 4, None, 0, {0: 4, 1: 0}, id="no-floor-unconstrained"),
    pytest.param({0: 1.0, 1: 10.0, 2: 10.0}, 7, None, 2, {0: 3, 1: 2, 2: 2}, id="floor-of-two"),
    pytest.param({0: 1.0, 1: 10.0, 2: 10.0}, 5, None, 2, {0: 5, 1: 0, 2: 0},
                 id="floor-dropped-when-M-too-small"),
])
def test_proportional_quotas_order_and_floor(seconds, m, order, at_least, expected):
    quotas = proportional_quotas(seconds, m, order=order, at_least=at_least)
    assert quotas == expected
    assert list(quotas) == (order or sorted(seconds))


@pytest.mark.parametrize(("seconds", "m", "order", "message"), [
    pytest.param({}, 4, None, "no replica to plan for", id="no-replica"),
    pytest.param({0: 1.0}, 0, None, "global microbatches must be >= 1, got 0", id="M=0"),
    pytest.param({0: 1.0, 1: 0.0}, 4, None, "finite and > 0: {1: 0.0}", id="zero-time"),
    pytest.param({0: 1.0, 1: float("nan")}, 4, None, "finite and > 0", id="nan-time"),
    pytest.param({0: 1.0, 1: 1.0}, 4, [0, 2], "not a permutation", id="order-mismatch"),
    pytest.param({0: 1.0, 1: 1.0}, 4, [0, 0, 1], "not a permutation", id="order-duplicate"),
])
def test_proportional_quotas_rejects(seconds, m, order, message):
    with pytest.raises(QuotaError, match=message):
        proportional_quotas(seconds, m, order=order)


def test_a_2x_slow_replica_gets_about_half_the_share():
    for replicas in range(2, 9):
        for m in range(4 * replicas, 120, 7):
            seconds = {r: 1.0 for r in range(replicas)} | {replicas - 1: 2.0}
            quotas = proportional_quotas(seconds, m)
            others = [quotas[r] for r in range(replicas - 1)]
            assert max(others) - min(others) <= 1
            assert abs(quotas[replicas - 1] - min(others) / 2) <= 1, (replicas, m, quotas)


# ---------------------------------------------------------------- optimality

def brute_force_makespan(seconds, m, floor, leads=None):
    members = list(seconds)
    best = None
    for split in itertools.product(range(floor, m + 1), repeat=len(members)):
        if sum(split) == m:
            span = makespan(dict(zip(members, split, strict=True)), seconds, leads)
            best = span if best is None else min(best, span)
    return best


def test_makespan_is_optimal_against_brute_force():
    times = (0.7, 1.0, 1.5, 2.0, 3.0, 1.0)
    cases = 0
    for replicas in (1, 2, 3):
        for combo in itertools.product(times, repeat=replicas):
            seconds = dict(enumerate(combo))
            for m in range(1, 9):
                for at_least in (0, 1):
                    floor = at_least if m >= at_least * replicas else 0
                    quotas = proportional_quotas(seconds, m, at_least=at_least)
                    assert min(quotas.values()) >= floor
                    assert makespan(quotas, seconds) == \
                        pytest.approx(brute_force_makespan(seconds, m, floor), rel=1e-12), \
                        (seconds, m, at_least, quotas)
                    cases += 1
    rng = random.Random(3)
    for _ in range(60):  # R = 4, random speeds (ties included)
        seconds = {r: rng.choice(times) * rng.choice((1, 0.1)) for r in range(4)}
        m = rng.randint(1, 10)
        quotas = proportional_quotas(seconds, m, at_least=0)
        assert makespan(quotas, seconds) == \
            pytest.approx(brute_force_makespan(seconds, m, 0), rel=1e-12), (seconds, m)
        cases += 1
    assert cases > 1000


def naive_hand_out(count, seconds, order, start, ready):
    """The textbook greedy, one microbatch at a time: the oracle for hand_out's head start."""
    given_ = dict.fromkeys(order, 0)
    grain = min(seconds.values()) * 1e-9
    for _ in range(count):
        best = min(order, key=lambda r: (
            finish_key(ready[r] + (start[r] + given_[r] + 1) * seconds[r], grain), order.index(r)))
        given_[best] += 1
    return given_


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.sampled_from([0.1, 0.25, 1.0, 1.0, 1.7, 3.0]),
                          st.integers(0, 6), st.sampled_from([0.0, 0.0, 0.5, 2.0, 7.0])),
                min_size=1, max_size=7),
       st.integers(0, 120), st.randoms(use_true_random=False))
def test_hand_out_equals_the_one_at_a_time_greedy(specs, count, rng):
    order = list(range(len(specs)))
    rng.shuffle(order)
    seconds = {r: specs[r][0] for r in order}
    start = {r: specs[r][1] for r in order}
    ready = {r: specs[r][2] for r in order}
    assert hand_out(count, seconds, order, start, ready) == \
        naive_hand_out(count, seconds, order, start, ready)


def test_large_plans_are_cheap():
    rng = random.Random(11)
    seconds = {r: rng.uniform(0.05, 0.2) for r in range(1000)}
    quotas = proportional_quotas(seconds, 100_000)
    assert sum(quotas.values()) == 100_000
    # Balanced to within one microbatch of the slowest finisher.
    span = makespan(quotas, seconds)
    assert all((q + 1) * seconds[r] >= span for r, q in quotas.items())


# ---------------------------------------------------------------- equal speeds == uniform

@pytest.mark.parametrize("seconds_per_mb", [1.0, 0.1, 0.3, 7.77])
def test_equal_speeds_give_exactly_the_uniform_plan(seconds_per_mb):
    rng = random.Random(5)
    for replicas in range(1, 13):
        for m in range(1, 50):
            members = sorted(rng.sample(range(40), replicas))
            for order in (members, members[::-1], rng.sample(members, replicas)):
                expected = uniform_plan(order, m).assignment
                quotas = proportional_quotas(dict.fromkeys(order, seconds_per_mb), m, order=order)
                assert quotas == uniform_quotas(order, m)
                assert contiguous_assignment(quotas, order) == expected
                assert list(contiguous_assignment(quotas, order)) == order
                policy = ProportionalPolicy(Speeds.of(dict.fromkeys(order, seconds_per_mb)))
                assert policy.plan(order, m).assignment == expected


# ---------------------------------------------------------------- contiguous_assignment

@pytest.mark.parametrize(("quotas", "order", "expected"), [
    pytest.param({0: 2, 1: 1, 2: 3}, None, {0: (0, 1), 1: (2,), 2: (3, 4, 5)}, id="mapping-order"),
    pytest.param({0: 2, 1: 1, 2: 3}, [2, 0, 1], {2: (0, 1, 2), 0: (3, 4), 1: (5,)},
                 id="given-order"),
    pytest.param({0: 0, 1: 2}, None, {0: (), 1: (0, 1)}, id="idle-member"),
])
def test_contiguous_assignment(quotas, order, expected):
    assignment = contiguous_assignment(quotas, order)
    assert assignment == expected and list(assignment) == list(expected)


@pytest.mark.parametrize(("quotas", "order", "message"), [
    pytest.param({0: 1, 1: -1}, None, "quotas must be >= 0: {1: -1}", id="negative"),
    pytest.param({0: 1, 1: 1}, [0, 5], "not a permutation", id="order-mismatch"),
])
def test_contiguous_assignment_rejects(quotas, order, message):
    with pytest.raises(QuotaError, match=message):
        contiguous_assignment(quotas, order)


@settings(max_examples=200, deadline=None)
@given(st.dictionaries(st.integers(0, 50), st.floats(0.01, 50.0), min_size=1, max_size=9),
       st.integers(1, 300), st.integers(0, 2))
def test_assignments_always_partition_range_m(seconds, m, at_least):
    assignment = contiguous_assignment(proportional_quotas(seconds, m, at_least=at_least))
    assert sorted(mb for ids in assignment.values() for mb in ids) == list(range(m))
    assert check_plan(assignment, m) is None


# ---------------------------------------------------------------- hysteresis

EVEN = {0: 1.0, 1: 1.0, 2: 1.0, 3: 1.0}
SLOW_3 = {0: 1.0, 1: 1.0, 2: 1.0, 3: 2.0}

REPLAN_ROWS = [
    pytest.param({0: 4, 1: 4, 2: 4, 3: 4}, {0: 5, 1: 5, 2: 4, 3: 2}, SLOW_3, True,
                 "replan: predicted step 8s -> 5s, 38% shorter (threshold 5%)", id="2x-slow-replans"),
    pytest.param({0: 4, 1: 4, 2: 4, 3: 4}, {0: 4, 1: 4, 2: 4, 3: 4}, SLOW_3, False,
                 "the current quotas are already the best", id="same-quotas"),
    pytest.param({0: 4, 1: 4, 2: 4, 3: 4}, {0: 5, 1: 4, 2: 4, 3: 3},
                 {0: 0.97, 1: 1.0, 2: 1.0, 3: 1.03}, False,
                 "keep the current quotas: predicted step 4.12s -> 4.85s", id="3%-noise-keeps"),
    pytest.param({0: 2, 1: 1, 2: 1, 3: 1}, {0: 1, 1: 2, 2: 1, 3: 1},
                 {0: 1.03, 1: 1.0, 2: 1.0, 3: 1.0}, False,
                 "2.06s -> 2s, 3% shorter (threshold 5%)", id="3%-noise-moving-the-extra-keeps"),
    pytest.param({0: 5, 1: 5, 2: 4, 3: 2}, {0: 4, 1: 4, 2: 4, 3: 4}, EVEN, True,
                 "replan: predicted step 5s -> 4s, 20% shorter", id="slow-replica-recovered"),
    pytest.param({0: 4, 1: 4}, {0: 3, 1: 3, 2: 2}, {0: 1.0, 1: 1.0, 2: 1.0}, True,
                 "members changed (left [], entered [2]): plan afresh", id="member-entered"),
    pytest.param({0: 4, 1: 4}, {0: 5, 1: 4}, {0: 1.0, 1: 1.0}, True,
                 "the current plan covers 8 microbatches, not 9", id="total-changed"),
]


@pytest.mark.parametrize(("current", "candidate", "seconds", "replan", "reason"), REPLAN_ROWS)
def test_should_replan(current, candidate, seconds, replan, reason):
    decided, why = should_replan(current, candidate, seconds)
    assert decided is replan
    assert reason in why, why


def test_should_replan_threshold_is_a_parameter():
    current, candidate = {0: 4, 1: 4, 2: 4, 3: 4}, {0: 5, 1: 5, 2: 4, 3: 2}
    assert should_replan(current, candidate, SLOW_3, threshold=0.5)[0] is False
    with pytest.raises(QuotaError, match="threshold must be >= 0"):
        should_replan(current, candidate, SLOW_3, threshold=-0.1)


@settings(max_examples=150, deadline=None)
@given(st.lists(st.floats(0.0, 0.03), min_size=1, max_size=12), st.integers(1, 200),
       st.sampled_from([0.001, 0.1, 1.0, 13.0]))
def test_estimates_within_3_percent_never_flap_a_uniform_plan(noise, m, scale):
    """The guarantee of should_replan: estimates spread <= 3% keep an optimal plan."""
    seconds = {r: scale * (1 + n) for r, n in enumerate(noise)}
    current = uniform_quotas(list(seconds), m)
    replan, why = should_replan(current, proportional_quotas(seconds, m), seconds)
    assert not replan, why


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.sampled_from([0.5, 1.0, 1.3, 2.0, 4.0]), st.floats(0.0, 0.03)),
                min_size=1, max_size=10), st.integers(1, 200))
def test_an_optimal_plan_survives_estimates_off_by_3_percent(speeds_and_noise, m):
    """The same guarantee for unequal true speeds: the bound is on the estimates' errors."""
    truth = {r: t for r, (t, _) in enumerate(speeds_and_noise)}
    estimated = {r: t * (1 + n) for r, (t, n) in enumerate(speeds_and_noise)}
    current = proportional_quotas(truth, m)
    replan, why = should_replan(current, proportional_quotas(estimated, m), estimated)
    assert not replan, why


@pytest.mark.parametrize("m", [16, 32, 64])
def test_estimator_with_3_percent_sample_noise_keeps_the_plan_then_follows_a_2x_slowdown(m):
    rng = random.Random(m)
    estimator = ThroughputEstimator()
    policy = ProportionalPolicy()
    members = [0, 1, 2, 3]
    plan = policy.plan(members, m).assignment
    replans = []
    for step in range(60):
        slow = 2.0 if step >= 40 else 1.0  # replica 3 is throttled from step 40 on
        for r, ids in plan.items():
            per_mb = (slow if r == 3 else 1.0) * rng.uniform(0.97, 1.03)
            estimator.observe(r, len(ids), per_mb * len(ids))
        # As the driver would: bind the measurements, call plan(members, M) unchanged.
        decision = policy.with_measurements(estimator.snapshot(members), plan).plan(members, m)
        if decision.assignment != plan:
            replans.append((step, decision.reason))
        plan = decision.assignment
    assert len(replans) == 1, replans  # noise never flapped it, the slowdown did replan
    step, reason = replans[0]
    assert 41 <= step <= 43, replans  # the median follows after 3 slow observations
    assert "replica 3 measured 2.0x slower than the median" in reason
    others = [len(plan[r]) for r in (0, 1, 2)]
    assert abs(len(plan[3]) - min(others) / 2) <= 1, plan


# ---------------------------------------------------------------- leads

LEAD_ROWS = [
    pytest.param({r: 1.0 for r in range(4)}, {0: 2.0}, 16, {0: 3, 1: 5, 2: 4, 3: 4},
                 id="two-microbatches-late-gets-about-two-fewer"),
    pytest.param({r: 0.004 for r in range(4)}, {0: 0.020, 1: 0.002, 2: 0.002, 3: 0.002}, 16,
                 {0: 1, 1: 5, 2: 5, 3: 5}, id="an-eval-after-every-commit-keeps-the-floor"),
    pytest.param({0: 0.003, 1: 0.004, 2: 0.004, 3: 0.004}, {0: 0.020, 1: 0.002, 2: 0.002, 3: 0.002},
                 16, {0: 1, 1: 5, 2: 5, 3: 5},
                 id="faster-microbatches-do-not-make-up-for-starting-late"),
    pytest.param({r: 1.0 for r in range(4)}, {r: 1.0 for r in range(4)}, 18,
                 {0: 5, 1: 5, 2: 4, 3: 4}, id="equal-leads-change-nothing"),
    pytest.param({0: 1.0, 1: 1.0}, {0: 100.0}, 8, {0: 1, 1: 7}, id="never-below-the-floor"),
]


@pytest.mark.parametrize(("seconds", "leads", "m", "expected"), LEAD_ROWS)
def test_a_replica_that_starts_late_gets_fewer(seconds, leads, m, expected):
    # What a replica does between steps (an evaluation, a checkpoint after the commit)
    # delays its share: its microbatches are planned to finish with the others'.
    quotas = proportional_quotas(seconds, m, leads=leads)
    assert quotas == expected
    floor = 1 if m >= len(seconds) else 0
    assert makespan(quotas, seconds, leads) == pytest.approx(
        brute_force_makespan(seconds, m, floor, leads), rel=1e-12)


def test_makespan_with_leads_is_optimal_against_brute_force():
    rng = random.Random(11)
    for _ in range(120):
        replicas = rng.randint(1, 3)
        seconds = {r: rng.choice((0.7, 1.0, 1.5, 3.0)) for r in range(replicas)}
        leads = {r: rng.choice((0.0, 0.5, 1.0, 2.5, 6.0)) for r in range(replicas)}
        m, at_least = rng.randint(1, 8), rng.randint(0, 1)
        floor = at_least if m >= at_least * replicas else 0
        quotas = proportional_quotas(seconds, m, at_least=at_least, leads=leads)
        assert makespan(quotas, seconds, leads) == pytest.approx(
            brute_force_makespan(seconds, m, floor, leads), rel=1e-12), (seconds, leads, m)


def test_replanning_weighs_leads_and_says_who_starts_late():
    even = {r: 1.0 for r in range(4)}
    assert should_replan({0: 4, 1: 4, 2: 4, 3: 4}, {0: 3, 1: 5, 2: 4, 3: 4}, even,
                         leads={0: 2.0}) == (True, "replan: predicted step 6s -> 5s, 17% shorter "
                                                    "(threshold 5%)")
    assert should_replan({0: 4, 1: 4, 2: 4, 3: 4}, {0: 3, 1: 5, 2: 4, 3: 4}, even)[0] is False
    eval_leads = {0: 0.020, 1: 0.002, 2: 0.002, 3: 0.002}
    assert describe_quotas({0: 1, 1: 5, 2: 5, 3: 5}, dict.fromkeys(range(4), 0.004), None,
                           eval_leads) == (
        "replica 0 starts its share 18 ms after the median (its time between steps): 1 of 16 "
        "microbatches; replicas [1, 2, 3] near the median: 5 each")
    assert "replica 0 starts its share 18 ms after the median (its time between steps), 0.8x " \
           "the median's time per microbatch: 2 of 16" in describe_quotas(
               {0: 2, 1: 5, 2: 5, 3: 4}, {0: 0.003, 1: 0.004, 2: 0.004, 3: 0.004}, None, eval_leads)
    # Late by less than half a microbatch: not worth a word.
    assert "starts its share" not in describe_quotas(
        {0: 4, 1: 4}, {0: 1.0, 1: 1.0}, None, {0: 0.4, 1: 0.0})


# ---------------------------------------------------------------- describe_quotas

@pytest.mark.parametrize(("quotas", "seconds", "measured", "reason"), [
    pytest.param({0: 5, 1: 5, 2: 4, 3: 2}, {0: 1.0, 1: 1.0, 2: 1.0, 3: 2.1}, None,
                 "replica 3 measured 2.1x slower than the median: 2 of 16 microbatches; "
                 "replicas [0, 1, 2] near the median: 4-5 each", id="one-slow"),
    pytest.param({0: 7, 1: 3, 2: 3, 3: 3}, {0: 0.5, 1: 1.0, 2: 1.0, 3: 1.0}, None,
                 "replica 0 measured 2.0x faster than the median: 7 of 16 microbatches; "
                 "replicas [1, 2, 3] near the median: 3 each", id="one-fast"),
    pytest.param({0: 4, 1: 4, 2: 4}, {0: 1.0, 1: 1.0, 2: 1.0}, [0, 1],
                 "replica 2 not measured yet, assumed at the median: 4 of 12 microbatches; "
                 "replicas [0, 1] near the median: 4 each", id="newcomer"),
    pytest.param({0: 6, 1: 2}, {0: 1.0, 1: 3.0}, None,
                 "replica 1 measured 3.0x slower than the median: 2 of 8 microbatches; "
                 "replica 0 near the median: 6 of 8 microbatches", id="two-replicas"),
    pytest.param({r: 1 for r in range(12)}, {r: 1.0 + r for r in range(12)}, None,
                 "replica 11 measured 2.0x slower", id="many-slowest-first"),
])
def test_describe_quotas(quotas, seconds, measured, reason):
    assert reason in describe_quotas(quotas, seconds, measured)


def test_describe_quotas_summarises_beyond_eight_named():
    text = describe_quotas({r: 1 for r in range(12)}, {r: 1.0 + r for r in range(12)})
    assert text.count("measured") == 8 and "more replicas off the median" in text
