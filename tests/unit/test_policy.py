"""Table-style tests of the workload policy (controller/policy.py).

Every row pins the exact assignment *and* a substring of the reason, since the
reason is what users read in `recover events`.
"""

from __future__ import annotations

import random

import pytest

from recover.controller.policy import (
    PolicyError,
    check_plan,
    overflow_redo,
    reassign_lost,
    uniform_plan,
)

# ---------------------------------------------------------------- uniform_plan

UNIFORM_ROWS = [
    pytest.param(
        [0, 1, 2, 3], 8,
        {0: (0, 1), 1: (2, 3), 2: (4, 5), 3: (6, 7)},
        "uniform: 8 microbatches over 4 replicas (2 each)",
        id="M-divisible-by-R",
    ),
    pytest.param(
        [0, 1, 2], 8,
        {0: (0, 1, 2), 1: (3, 4, 5), 2: (6, 7)},
        "8 microbatches over 3 replicas (2-3 each)",
        id="M-not-divisible-first-members-take-extra",
    ),
    pytest.param(
        [0, 1, 2, 3], 7,
        {0: (0, 1), 1: (2, 3), 2: (4, 5), 3: (6,)},
        "7 microbatches over 4 replicas (1-2 each)",
        id="M-not-divisible-last-gets-fewer",
    ),
    pytest.param(
        [5], 4,
        {5: (0, 1, 2, 3)},
        "4 microbatches over 1 replicas (4 each)",
        id="R=1-takes-everything",
    ),
    pytest.param(
        [0, 1, 2], 3,
        {0: (0,), 1: (1,), 2: (2,)},
        "3 microbatches over 3 replicas (1 each)",
        id="M=R-one-each",
    ),
    pytest.param(
        [3, 1, 2], 5,
        {3: (0, 1), 1: (2, 3), 2: (4,)},
        "5 microbatches over 3 replicas (1-2 each)",
        id="member-order-not-id-order",
    ),
    pytest.param(
        [0, 2], 1,
        {0: (0,), 2: ()},
        "1 microbatches over 2 replicas (0-1 each)",
        id="M-smaller-than-R-leaves-idle-member",
    ),
]


@pytest.mark.parametrize(("members", "m", "expected", "reason"), UNIFORM_ROWS)
def test_uniform_plan(members, m, expected, reason):
    decision = uniform_plan(members, m)
    assert decision.assignment == expected
    assert list(decision.assignment) == list(members), "plan must follow member order"
    assert reason in decision.reason
    assert check_plan(decision.assignment, m) is None


@pytest.mark.parametrize(
    ("members", "m", "reason"),
    [
        pytest.param([], 4, "no live replica", id="empty-members"),
        pytest.param([0, 1, 0], 4, "duplicate members in [0, 1, 0]", id="duplicate-members"),
        pytest.param([0, 1], 0, "global microbatches must be >= 1, got 0", id="M=0"),
        pytest.param([0], -3, "got -3", id="M-negative"),
    ],
)
def test_uniform_plan_rejects(members, m, reason):
    with pytest.raises(PolicyError) as info:
        uniform_plan(members, m)
    assert reason in str(info.value)
    assert isinstance(info.value, ValueError)  # PolicyError is a ValueError


# ---------------------------------------------------------------- reassign_lost

UNIFORM_4x8 = {0: (0, 1), 1: (2, 3), 2: (4, 5), 3: (6, 7)}

REASSIGN_ROWS = [
    pytest.param(
        UNIFORM_4x8, [1], [0, 2, 3],
        {0: (0, 1, 2), 2: (4, 5, 3), 3: (6, 7)},
        "replicas [1] lost; their 2 microbatches reassigned to the least-loaded survivors: "
        "1 to replica 0, 1 to replica 2",
        id="one-lost-equal-loads-tie-breaks-in-member-order",
    ),
    pytest.param(
        UNIFORM_4x8, [3, 1], [0, 2],
        {0: (0, 1, 2, 6), 2: (4, 5, 3, 7)},
        "replicas [1, 3] lost; their 4 microbatches reassigned to the least-loaded survivors: "
        "2 to replica 0, 2 to replica 2",
        id="two-lost-at-once",
    ),
    pytest.param(
        {0: (0, 1, 2), 1: (3, 4, 5), 2: (6, 7)}, [0], [1, 2],
        {1: (3, 4, 5, 1), 2: (6, 7, 0, 2)},
        "their 3 microbatches reassigned to the least-loaded survivors: "
        "1 to replica 1, 2 to replica 2",
        id="least-loaded-first-then-tie",
    ),
    pytest.param(
        {0: (0,), 1: (1,), 2: (2,)}, [1], [2, 0],
        {2: (2, 1), 0: (0,)},
        "1 to replica 2",
        id="tie-goes-to-earlier-member-not-lower-id",
    ),
    pytest.param(
        {0: (0, 1), 1: (2, 3)}, [1], [0],
        {0: (0, 1, 2, 3)},
        "their 2 microbatches reassigned to the least-loaded survivors: 2 to replica 0",
        id="single-survivor-takes-all",
    ),
    pytest.param(
        {0: (0, 1, 2, 3), 1: (4, 5, 6, 7), 2: ()}, [2], [0, 1],
        {0: (0, 1, 2, 3), 1: (4, 5, 6, 7)},
        "replicas [2] lost with no microbatches; plan unchanged",
        id="lost-replica-had-no-microbatches",
    ),
    pytest.param(
        {0: (0, 1), 1: (2, 3)}, [9], [0, 1],
        {0: (0, 1), 1: (2, 3)},
        "replicas [9] lost with no microbatches; plan unchanged",
        id="lost-replica-absent-from-plan",
    ),
    pytest.param(
        {0: (3, 0), 1: (1,), 2: (2,)}, [0], [1, 2],
        {1: (1, 0), 2: (2, 3)},
        "their 2 microbatches reassigned",
        id="orphans-handed-out-in-id-order",
    ),
]


@pytest.mark.parametrize(("current", "lost", "survivors", "expected", "reason"), REASSIGN_ROWS)
def test_reassign_lost(current, lost, survivors, expected, reason):
    before = {r: tuple(ids) for r, ids in current.items()}
    decision = reassign_lost(current, lost, survivors)
    assert decision.assignment == expected
    assert reason in decision.reason
    # Survivors keep their own ids, first and in order (superset property).
    for replica in survivors:
        kept = tuple(current[replica])
        assert decision.assignment[replica][: len(kept)] == kept
    assert set(decision.assignment) == set(survivors)
    assert {r: tuple(ids) for r, ids in current.items()} == before, "input plan was mutated"


@pytest.mark.parametrize(("current", "lost", "survivors", "spares", "expected", "reason"), [
    pytest.param(
        {0: (0, 1, 2), 1: (3, 4, 5), 2: (6, 7, 8)}, [1], [0, 2], [5],
        {0: (0, 1, 2, 4), 2: (6, 7, 8, 5), 5: (3,)},
        "replicas [1] lost; spares [5] take their place; their 3 microbatches reassigned "
        "spread evenly, spares first: 1 to replica 0, 1 to replica 2, 1 to replica 5",
        id="the-lost-work-is-spread-not-all-given-to-the-spare",
    ),
    pytest.param(
        {0: (0, 1), 1: (2, 3), 2: (4, 5)}, [1, 2], [0], [6],
        {0: (0, 1, 3, 5), 6: (2, 4)},
        "2 to replica 0, 2 to replica 6",
        id="two-lost-one-spare",
    ),
    pytest.param(
        {0: (0, 1), 1: (2, 3)}, [0, 1], [], [4, 5],
        {4: (0, 2), 5: (1, 3)},
        "spares [4, 5] take their place",
        id="every-member-lost-spares-carry-the-step",
    ),
    pytest.param(
        {0: (0,), 1: ()}, [1], [0], [3],
        {0: (0,), 3: ()},
        "replicas [1] lost with no microbatches; plan unchanged; spares [3] take their place",
        id="nothing-lost-the-spare-enters-idle",
    ),
    pytest.param(
        {0: (0, 1), 1: (2, 3), 2: (4, 5)}, [2], [0, 1], [7, 8],
        {0: (0, 1), 1: (2, 3), 7: (4,), 8: (5,)},
        "1 to replica 7, 1 to replica 8",
        id="enough-spares-take-it-all",
    ),
])
def test_reassign_lost_to_spares(current, lost, survivors, spares, expected, reason):
    decision = reassign_lost(current, lost, survivors, spares)
    assert decision.assignment == expected
    assert reason in decision.reason


@pytest.mark.parametrize(
    ("current", "lost", "survivors", "spares", "reason"),
    [
        pytest.param(UNIFORM_4x8, [2, 0, 1, 3], [], (),
                     "replicas [0, 1, 2, 3] lost and no survivor left", id="no-survivor"),
        pytest.param({0: (0, 1), 1: (2, 3)}, [1], [0, 4], (), "survivors [4] have no assignment",
                     id="survivor-unknown-to-plan"),
        pytest.param({0: (0,), 1: (1,), 2: (2,)}, [2], [0, 1, 0], (),
                     "survivors [0, 1, 0] and spares [] must be distinct replicas",
                     id="survivor-twice"),
        pytest.param({0: (0,), 1: (1,), 2: (2,)}, [2], [0, 1], [1],
                     "survivors [0, 1] and spares [1] must be distinct replicas",
                     id="spare-also-survivor"),
    ],
)
def test_reassign_lost_rejects(current, lost, survivors, spares, reason):
    with pytest.raises(PolicyError) as info:
        reassign_lost(current, lost, survivors, spares)
    assert reason in str(info.value)


# ---------------------------------------------------------------- check_plan

CHECK_ROWS = [
    pytest.param({0: (0, 1), 1: (2, 3)}, 4, None, id="valid"),
    pytest.param({1: (3, 2), 0: (1, 0)}, 4, None, id="valid-any-order"),
    pytest.param({0: (0, 1, 2, 3), 1: ()}, 4, None, id="valid-with-idle-member"),
    pytest.param({0: (0, 1), 1: (3,)}, 4, "missing [2], duplicated []", id="missing-one"),
    pytest.param({0: (0, 1), 1: (1, 2, 3)}, 4, "missing [], duplicated [1]", id="duplicated-one"),
    pytest.param({0: (0, 0), 1: (2, 2)}, 4, "missing [1, 3], duplicated [0, 2]",
                 id="missing-and-duplicated"),
    pytest.param({}, 2, "missing [0, 1]", id="empty-plan"),
    pytest.param({0: (0, 1, 2)}, 2, "plan covers the wrong microbatches", id="id-beyond-M"),
]


@pytest.mark.parametrize(("assignment", "m", "reason"), CHECK_ROWS)
def test_check_plan(assignment, m, reason):
    problem = check_plan(assignment, m)
    if reason is None:
        assert problem is None
    else:
        assert problem is not None
        assert reason in problem


@pytest.mark.parametrize(("assignment", "m", "bad"), [
    pytest.param({0: (0, 1, 2)}, 2, "2", id="beyond-M"),
    pytest.param({0: (-1, 0, 1)}, 2, "-1", id="negative"),
])
def test_check_plan_reason_names_out_of_range_ids(assignment, m, bad):
    problem = check_plan(assignment, m)
    assert problem is not None
    assert bad in problem


# ---------------------------------------------------------------- property

def _assert_superset(old, new, survivors):
    for replica in survivors:
        kept = tuple(old[replica])
        assert new[replica][: len(kept)] == kept


def test_successive_reassignments_always_cover_every_microbatch_once():
    plans_checked = 0
    for seed in range(300):
        rng = random.Random(seed)
        replicas = rng.randint(1, 8)
        members = rng.sample(range(32), replicas)
        m = rng.randint(1, 40)
        decision = uniform_plan(members, m)
        assert check_plan(decision.assignment, m) is None, (seed, decision)
        plan = decision.assignment
        while len(members) > 1 and rng.random() < 0.8:
            if rng.random() < 0.25:
                # A commit in between: the coordinator re-plans uniformly.
                plan = uniform_plan(members, m).assignment
            lost = rng.sample(members, rng.randint(1, len(members) - 1))
            survivors = [r for r in members if r not in lost]
            orphaned = sorted(mb for r in lost for mb in plan[r])
            decision = reassign_lost(plan, lost, survivors)
            new = decision.assignment
            context = (seed, members, lost, plan, new)
            assert check_plan(new, m) is None, context
            assert list(new) == survivors, context
            _assert_superset(plan, new, survivors)
            gained = sorted(mb for r in survivors for mb in new[r][len(plan[r]):])
            assert gained == orphaned, context
            # Deterministic: the same inputs give the same decision.
            assert reassign_lost(plan, lost, survivors) == decision
            plan, members = new, survivors
            plans_checked += 1
    assert plans_checked > 300  # the loop really exercised reassignments


# ---------------------------------------------------------------- drop_lost (ablation)

from recover.controller.policy import drop_lost  # noqa: E402

DROP_ROWS = [
    pytest.param(
        {0: (0, 1), 1: (2, 3), 2: (4, 5), 3: (6, 7)}, [1], [0, 2, 3],
        {0: (0, 1), 2: (4, 5), 3: (6, 7)},
        "drop policy: replicas [1] lost; their 2 microbatches [2, 3] are dropped from this step",
        id="one-lost",
    ),
    pytest.param(
        {0: (0, 1, 2), 1: (3, 4, 5), 2: (6, 7)}, [2, 0], [1],
        {1: (3, 4, 5)},
        "replicas [0, 2] lost; their 5 microbatches [0, 1, 2, 6, 7] are dropped",
        id="two-lost-sorted",
    ),
    pytest.param(
        {0: (0, 1), 1: (), 2: (2, 3)}, [1], [0, 2],
        {0: (0, 1), 2: (2, 3)},
        "their 0 microbatches [] are dropped",
        id="lost-replica-had-nothing",
    ),
    pytest.param(
        {0: (0, 1), 1: (2, 3)}, [5], [0, 1],
        {0: (0, 1), 1: (2, 3)},
        "replicas [5] lost; their 0 microbatches",
        id="lost-replica-not-in-plan",
    ),
    pytest.param(
        {3: (0, 4), 1: (1, 5), 2: (2, 3)}, [1], [3, 2],
        {3: (0, 4), 2: (2, 3)},
        "[1, 5] are dropped",
        id="survivor-order-kept-non-contiguous-ids",
    ),
]


@pytest.mark.parametrize(("current", "lost", "survivors", "expected", "reason"), DROP_ROWS)
def test_drop_lost(current, lost, survivors, expected, reason):
    before = {r: tuple(ids) for r, ids in current.items()}
    decision = drop_lost(current, lost, survivors)
    assert decision.assignment == expected
    assert list(decision.assignment) == list(survivors)
    assert reason in decision.reason, decision.reason
    assert current == before  # the input plan is not mutated
    # The dropped plan covers exactly what the survivors had: valid against those ids only.
    kept = [mb for r in survivors for mb in current.get(r, ())]
    assert check_plan(decision.assignment, 8, expected_ids=kept) is None
    assert drop_lost(current, lost, survivors) == decision


@pytest.mark.parametrize(("current", "lost"), [
    pytest.param({0: (0, 1), 1: (2, 3)}, [0, 1], id="all-lost"),
    pytest.param({}, [], id="empty"),
])
def test_drop_lost_without_survivors_raises(current, lost):
    with pytest.raises(PolicyError, match="no survivor left"):
        drop_lost(current, lost, [])


def test_drop_then_check_plan_without_expected_ids_reports_missing():
    decision = drop_lost({0: (0, 1), 1: (2, 3)}, [1], [0])
    problem = check_plan(decision.assignment, 4)
    assert problem is not None and "missing [2, 3]" in problem


CHECK_EXPECTED_ROWS = [
    pytest.param({0: (0, 1), 2: (4, 5)}, 6, [0, 1, 4, 5], None, id="exact-cover-of-expected"),
    pytest.param({0: (5, 0), 2: (1, 4)}, 6, [4, 5, 1, 0], None, id="order-does-not-matter"),
    pytest.param({0: ()}, 6, [], None, id="empty-expected-empty-plan"),
    pytest.param({0: (0, 1), 2: (4,)}, 6, [0, 1, 4, 5], "missing [5]", id="missing"),
    pytest.param({0: (0, 1), 2: (4, 5, 5)}, 6, [0, 1, 4, 5], "duplicated [5]", id="duplicated"),
    pytest.param({0: (0, 1, 2), 2: (4, 5)}, 6, [0, 1, 4, 5], "not planned this step: [2]",
                 id="in-range-but-not-expected"),
    pytest.param({0: (0, 1), 2: (4, 5, 9)}, 6, [0, 1, 4, 5], "outside 0..5: [9]",
                 id="beyond-M"),
    pytest.param({0: (0, 1, 2, 3, 4, 5)}, 6, [0, 1, 4, 5], "plan covers the wrong microbatches",
                 id="full-plan-against-dropped-expectation"),
]


@pytest.mark.parametrize(("assignment", "m", "expected_ids", "reason"), CHECK_EXPECTED_ROWS)
def test_check_plan_with_expected_ids(assignment, m, expected_ids, reason):
    problem = check_plan(assignment, m, expected_ids=expected_ids)
    if reason is None:
        assert problem is None
    else:
        assert problem is not None and reason in problem, problem


def test_check_plan_does_not_call_in_range_ids_out_of_range():
    problem = check_plan({0: (0, 1, 2), 2: (4, 5)}, 6, expected_ids=[0, 1, 4, 5])
    assert problem is not None and "outside" not in problem, problem


def test_drop_lost_survivor_without_assignment_raises():
    with pytest.raises(PolicyError, match=r"survivors \[7\] have no assignment"):
        drop_lost({0: (0, 1), 1: (2, 3)}, [1], [0, 7])


OVERFLOW_ROWS = [
    pytest.param(5, 0, 2, True, 1, "2 microbatches overflowed the predicted scale; redo step 5 "
                 "at scale epoch 1", id="first-overflow-redoes"),
    pytest.param(5, 2, 1, True, 3, "redo step 5 at scale epoch 3", id="last-allowed-redo"),
    pytest.param(5, 3, 4, False, 3, "4 microbatches of step 5 still overflow after 3 rescalings",
                 id="gives-up-after-max"),
    pytest.param(0, 9, 1, False, 9, "non-finite (NaN/inf)", id="beyond-max-fails-with-hint"),
]


@pytest.mark.parametrize(("step", "epoch", "overflowed", "redo", "next_epoch", "reason"),
                         OVERFLOW_ROWS)
def test_overflow_redo(step, epoch, overflowed, redo, next_epoch, reason):
    decision = overflow_redo(step, epoch, overflowed)
    assert decision.redo is redo
    assert decision.scale_epoch == next_epoch
    assert reason in decision.reason, decision.reason


def test_overflow_redo_bound_is_a_parameter():
    assert overflow_redo(1, 0, 1, max_epochs=0).redo is False
    assert overflow_redo(1, 0, 1, max_epochs=1).redo is True


def test_check_plan_expected_ids_none_means_all():
    assert check_plan({0: (0, 1, 2)}, 3, expected_ids=None) is None
    assert check_plan({0: (0, 1)}, 3, expected_ids=None) is not None
    assert check_plan({0: (0, 1)}, 3, expected_ids=[0, 1]) is None
