"""Table-style tests of the ProportionalPolicy (controller/policy.py), built on the quotas of
controller/quotas.py (tested in test_quotas.py).

Rows pin the exact quotas or assignment *and* a substring of the reason, which is what
users read in `recover events`; brute force and property tests pin optimality and the
invariant (every one of the M microbatches planned exactly once).
"""

from __future__ import annotations

import random
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from recover.controller.policy import (
    POLICIES,
    PolicyError,
    ProportionalPolicy,
    RecoverPolicy,
    check_plan,
    policy_for,
    reassign_lost,
    uniform_plan,
)
from recover.controller.quotas import (
    quotas_of,
)
from recover.controller.throughput import Speeds

# ---------------------------------------------------------------- ProportionalPolicy

def test_proportional_is_the_default():
    assert POLICIES["proportional"] is ProportionalPolicy
    assert type(policy_for("")) is ProportionalPolicy
    assert type(policy_for("recover")) is RecoverPolicy
    assert isinstance(policy_for("proportional"), ProportionalPolicy)


def test_with_measurements_binds_speeds_and_plan_and_count_policies_ignore_them():
    speeds, held = Speeds.of({0: 1.0, 1: 1.2}), {0: (0, 1, 2, 3, 4), 1: (5, 6, 7)}
    for count_policy in (RecoverPolicy(), policy_for("drop")):
        assert count_policy.with_measurements(speeds, held) is count_policy
    base = ProportionalPolicy(threshold=0.5, at_least=0)
    bound = base.with_measurements(speeds, held)
    assert (bound.speeds, bound.current, bound.threshold, bound.at_least) == (speeds, held, 0.5, 0)
    assert base.speeds is None and base.current is None, "binding copies, never mutates"
    kept = bound.plan([0, 1], 8)
    assert kept.assignment == held and "keep the current quotas" in kept.reason
    # An explicit current= wins over the bound one; without any, plain planning.
    assert bound.plan([0, 1], 8, current={0: (0, 1, 2, 3), 1: (4, 5, 6, 7)}).assignment == \
        {0: (0, 1, 2, 3), 1: (4, 5, 6, 7)}
    assert base.with_measurements(speeds).plan([0, 1], 8).assignment == \
        {0: (0, 1, 2, 3), 1: (4, 5, 6, 7)}


@pytest.mark.parametrize("speeds", [None, Speeds()], ids=["no-speeds", "nobody-measured"])
def test_without_measurements_it_is_recover_policy_exactly(speeds):
    rng = random.Random(1)
    recover, proportional = RecoverPolicy(), ProportionalPolicy(speeds)
    for _ in range(200):
        members = rng.sample(range(20), rng.randint(1, 8))
        m = rng.randint(1, 40)
        assert proportional.plan(members, m) == recover.plan(members, m)
        plan = recover.plan(members, m).assignment
        assert proportional.plan(members, m, current=plan) == recover.plan(members, m)
        lost = rng.sample(members, rng.randint(1, len(members)))
        survivors = [r for r in members if r not in lost]
        spares = rng.sample(range(20, 30), rng.randint(0 if survivors else 1, 2))
        assert proportional.reassign(plan, lost, survivors, spares) == \
            recover.reassign(plan, lost, survivors, spares)


PLAN_ROWS = [
    pytest.param({0: 1.0, 1: 1.0, 2: 2.1, 3: 1.0}, [0, 1, 2, 3], 16,
                 {0: (0, 1, 2, 3, 4), 1: (5, 6, 7, 8, 9), 2: (10, 11), 3: (12, 13, 14, 15)},
                 "proportional: 16 microbatches over 4 replicas by measured speed, predicted step "
                 "5s (uniform 8.4s); replica 2 measured 2.1x slower than the median: 2 of 16 "
                 "microbatches; replicas [0, 1, 3] near the median: 4-5 each", id="one-slow"),
    pytest.param({0: 0.2, 1: 0.2}, [0, 1, 7], 9,
                 {0: (0, 1, 2), 1: (3, 4, 5), 7: (6, 7, 8)},
                 "replica 7 not measured yet, assumed at the median: 3 of 9", id="newcomer-at-median"),
    pytest.param({3: 1.0, 1: 3.0}, [3, 1], 8, {3: (0, 1, 2, 3, 4, 5), 1: (6, 7)},
                 "replica 1 measured 3.0x slower than the median: 2 of 8", id="member-order-kept"),
]


@pytest.mark.parametrize(("speeds", "members", "m", "expected", "reason"), PLAN_ROWS)
def test_proportional_plan(speeds, members, m, expected, reason):
    decision = ProportionalPolicy().plan(members, m, speeds=Speeds.of(speeds))
    assert decision.assignment == expected and list(decision.assignment) == members
    assert reason in decision.reason, decision.reason
    assert ProportionalPolicy(Speeds.of(speeds)).plan(members, m) == decision


def test_a_replica_that_evaluates_after_every_commit_is_planned_to_finish_with_the_others():
    # Measured on the demo (bench/results/buffers-demo-size/plans-with-eval.txt): replica 0,
    # which evaluated after each commit, computed its microbatches faster while the others
    # waited for it, and was handed 5-7 of 16. With its lead it gets what fits after it.
    speeds = Speeds.of({0: 0.003, 1: 0.004, 2: 0.004, 3: 0.004},
                       {0: 0.020, 1: 0.002, 2: 0.002, 3: 0.002})
    decision = ProportionalPolicy().plan([0, 1, 2, 3], 16, speeds=speeds,
                                         current={0: (0, 1, 2, 3, 4, 5), 1: (6, 7, 8, 9),
                                                  2: (10, 11, 12), 3: (13, 14, 15)})
    assert quotas_of(decision.assignment) == {0: 1, 1: 5, 2: 5, 3: 5}
    assert "predicted step 0.023s (uniform 0.032s)" in decision.reason, decision.reason
    assert "replica 0 starts its share 18 ms after the median" in decision.reason
    assert quotas_of(ProportionalPolicy().plan([0, 1, 2, 3], 16, speeds=Speeds.of(
        dict(speeds))).assignment)[0] > 4, "without leads it was handed more"


@pytest.mark.parametrize(("current", "speeds", "expected", "reason"), [
    pytest.param({0: (0, 1, 2, 3), 1: (4, 5, 6, 7)}, {0: 1.0, 1: 1.02}, {0: (0, 1, 2, 3), 1: (4, 5, 6, 7)},
                 "the current quotas are already the best", id="noise-same-quotas"),
    pytest.param({0: (0, 1, 2, 3), 1: (4, 5, 6, 7)}, {0: 1.0, 1: 1.3}, {0: (0, 1, 2, 3), 1: (4, 5, 6, 7)},
                 "keep the current quotas: predicted step 5.2s -> 5s, 4% shorter (threshold 5%)",
                 id="small-gain-keeps"),
    pytest.param({0: (0, 1, 2, 3, 4), 1: (5, 6, 7)}, {0: 1.0, 1: 1.2}, {0: (0, 1, 2, 3, 4), 1: (5, 6, 7)},
                 "keep the current quotas: predicted step 5s -> 4.8s, 4% shorter",
                 id="a-slow-replica-recovering-a-little-keeps-its-quota"),
    pytest.param({1: (7, 0, 1), 0: (2, 3, 4, 5, 6)}, {0: 1.0, 1: 1.2}, {0: (0, 1, 2, 3, 4), 1: (5, 6, 7)},
                 "keep the current quotas", id="kept-quotas-laid-out-contiguously-in-member-order"),
    pytest.param({0: (0, 1, 2, 3), 1: (4, 5, 6, 7)}, {0: 1.0, 1: 2.0}, {0: (0, 1, 2, 3, 4, 5), 1: (6, 7)},
                 "predicted step 6s (uniform 8s); replica 1 measured 2.0x slower", id="2x-replans"),
    pytest.param({0: (0, 1, 2, 3), 1: (4, 5, 6, 7)}, {0: 1.0, 1: 1.0, 2: 1.0},
                 {0: (0, 1, 2), 1: (3, 4, 5), 2: (6, 7)}, "predicted step 3s", id="member-entered"),
])
def test_proportional_plan_hysteresis(current, speeds, expected, reason):
    members = sorted(speeds)
    decision = ProportionalPolicy().plan(members, 8, speeds=Speeds.of(speeds), current=current)
    assert decision.assignment == expected
    assert reason in decision.reason, decision.reason


@pytest.mark.parametrize(("members", "m", "message"), [
    pytest.param([], 4, "no live replica", id="empty"),
    pytest.param([0, 1], 0, "global microbatches must be >= 1", id="M=0"),
    pytest.param([0, 0], 4, "duplicate members", id="duplicate"),
])
def test_proportional_plan_rejects(members, m, message):
    with pytest.raises(PolicyError, match=message):
        ProportionalPolicy(Speeds.of({0: 1.0})).plan(members, m)


NINE = {0: (0, 1, 2), 1: (3, 4, 5), 2: (6, 7, 8)}

REASSIGN_ROWS = [
    pytest.param(NINE, [1], [0, 2], [], {0: 1.0, 2: 1.0}, None,
                 {0: (0, 1, 2, 3, 5), 2: (6, 7, 8, 4)},
                 "replicas [1] lost; their 3 microbatches reassigned to finish earliest by measured "
                 "speed: 2 to replica 0, 1 to replica 2; predicted step 5s", id="equal-like-recover"),
    pytest.param(NINE, [1], [0, 2], [], {0: 1.0, 2: 3.0}, None,
                 {0: (0, 1, 2, 3, 4, 5), 2: (6, 7, 8)},
                 "3 to replica 0; predicted step 9s; replica 2 measured 3.0x slower", id="slow-gets-none"),
    pytest.param(NINE, [1], [0, 2], [5], {0: 1.0, 2: 1.0}, None,
                 {0: (0, 1, 2, 4), 2: (6, 7, 8, 5), 5: (3,)},
                 "spares [5] take their place; their 3 microbatches reassigned to finish earliest "
                 "by measured speed: 1 to replica 0, 1 to replica 2, 1 to replica 5",
                 id="spare-spread-like-recover"),
    pytest.param(NINE, [1], [0, 2], [5], {0: 1.0, 2: 1.0}, 0.0,
                 {0: (0, 1, 2), 2: (6, 7, 8), 5: (3, 4, 5)},
                 "3 to replica 5; predicted step 3s", id="loss-at-step-start-spare-takes-all"),
    pytest.param(NINE, [1], [0, 2], [5], {0: 1.0, 2: 1.0, 5: 4.0}, 0.0,
                 {0: (0, 1, 2, 4), 2: (6, 7, 8, 5), 5: (3,)},
                 "replica 5 measured 4.0x slower", id="slow-spare-gets-less"),
    pytest.param({0: (0, 1), 1: (2, 3, 4, 5), 2: (6, 7)}, [1], [0, 2], [], {0: 1.0, 2: 1.0}, 3.0,
                 {0: (0, 1, 2, 4), 2: (6, 7, 3, 5)}, "predicted step 5s", id="elapsed-idle-survivors"),
    pytest.param({0: (0, 1), 1: (2, 3)}, [0, 1], [], [4, 5], {4: 1.0, 5: 1.0}, None,
                 {4: (0, 2), 5: (1, 3)}, "spares [4, 5] take their place", id="only-spares-left"),
    pytest.param({0: (0, 1, 2, 3), 1: ()}, [1], [0], [], {0: 1.0}, None, {0: (0, 1, 2, 3)},
                 "replicas [1] lost with no microbatches; plan unchanged", id="nothing-to-reassign"),
]


@pytest.mark.parametrize(("current", "lost", "survivors", "spares", "speeds", "elapsed", "expected",
                          "reason"), REASSIGN_ROWS)
def test_proportional_reassign(current, lost, survivors, spares, speeds, elapsed, expected, reason):
    decision = ProportionalPolicy().reassign(current, lost, survivors, spares,
                                             speeds=Speeds.of(speeds), elapsed_s=elapsed)
    assert decision.assignment == expected
    assert reason in decision.reason, decision.reason
    for r in survivors:  # survivors keep their own ids, first and in order
        assert decision.assignment[r][:len(current[r])] == tuple(current[r])
    m = sum(len(ids) for ids in current.values())
    assert check_plan(decision.assignment, m) is None


@pytest.mark.parametrize(("current", "lost", "survivors", "message"), [
    pytest.param(NINE, [0, 1, 2], [], "replicas [0, 1, 2] lost and no survivor left", id="none-left"),
    pytest.param(NINE, [1], [0, 7], "survivors [7] have no assignment", id="unknown-survivor"),
])
def test_proportional_reassign_rejects(current, lost, survivors, message):
    with pytest.raises(PolicyError, match=re.escape(message)):
        ProportionalPolicy(Speeds.of({0: 1.0})).reassign(current, lost, survivors)


def test_equal_speeds_reassign_like_recover_policy_id_for_id():
    rng = random.Random(9)
    for _ in range(300):
        members = rng.sample(range(20), rng.randint(2, 8))
        m = rng.randint(1, 40)
        plan = uniform_plan(members, m).assignment
        lost = rng.sample(members, rng.randint(1, len(members) - 1))
        survivors = [r for r in members if r not in lost]
        # Spares spread like reassign_lost's when every survivor holds as many.
        even = len({len(plan[r]) for r in survivors}) == 1
        spares = rng.sample(range(20, 30), rng.randint(0, 2)) if even else []
        speeds = Speeds.of(dict.fromkeys([*members, *spares], 0.3))
        got = ProportionalPolicy(speeds).reassign(plan, lost, survivors, spares)
        assert got.assignment == reassign_lost(plan, lost, survivors, spares).assignment


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 8), st.integers(1, 40), st.randoms(use_true_random=False))
def test_successive_proportional_reassignments_cover_every_microbatch_once(replicas, m, rng):
    members = rng.sample(range(32), replicas)
    speeds = Speeds.of({r: rng.choice([0.5, 1.0, 1.0, 2.0, 3.3]) for r in range(40)})
    policy = ProportionalPolicy(speeds)
    plan = policy.plan(members, m).assignment
    assert check_plan(plan, m) is None
    spare_pool = list(range(32, 40))
    while len(members) > 1:
        lost = rng.sample(members, rng.randint(1, len(members) - 1))
        survivors = [r for r in members if r not in lost]
        spares = [spare_pool.pop()] if spare_pool and rng.random() < 0.3 else []
        elapsed = rng.choice([None, 0.0, 1.5, 100.0])
        new = policy.reassign(plan, lost, survivors, spares, elapsed_s=elapsed).assignment
        assert check_plan(new, m) is None, (plan, lost, new)
        assert list(new) == [*survivors, *spares]
        for r in survivors:
            assert new[r][:len(plan[r])] == plan[r]
        assert policy.reassign(plan, lost, survivors, spares, elapsed_s=elapsed).assignment == new
        plan, members = new, [*survivors, *spares]
    assert quotas_of(plan) == {members[0]: m}
