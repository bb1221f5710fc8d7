"""Table-style tests of the throughput estimator and its frozen snapshot (controller/throughput.py)."""

from __future__ import annotations

import dataclasses
import math
import random

import pytest

from recover.controller.throughput import DEFAULT_WINDOW, Speeds, ThroughputEstimator, low_median

# ---------------------------------------------------------------- low_median

@pytest.mark.parametrize(("values", "expected"), [
    pytest.param([], None, id="empty"),
    pytest.param([3.0], 3.0, id="one"),
    pytest.param([5.0, 1.0], 1.0, id="two-takes-the-lower"),
    pytest.param([2.0, 9.0, 1.0], 2.0, id="odd"),
    pytest.param([4.0, 1.0, 3.0, 2.0], 2.0, id="even-lower-middle"),
    pytest.param([1.0, 1.0, 100.0], 1.0, id="outlier-ignored"),
])
def test_low_median(values, expected):
    assert low_median(values) == expected


# ---------------------------------------------------------------- estimates

# (observations as (replica, microbatches, compute_s), replica asked, expected s/mb)
ESTIMATE_ROWS = [
    pytest.param([(0, 4, 2.0)], 0, 0.5, id="one-observation-per-microbatch"),
    pytest.param([(0, 4, 2.0), (0, 2, 2.0), (0, 4, 2.0)], 0, 0.5, id="median-of-three"),
    pytest.param([(0, 1, 1.0)] * 2 + [(0, 1, 10.0)] + [(0, 1, 1.0)] * 2, 0, 1.0,
                 id="one-outlier-in-five-ignored"),
    pytest.param([(0, 1, 1.0), (0, 1, 9.0), (0, 1, 1.0), (0, 1, 8.0), (0, 1, 1.0)], 0, 1.0,
                 id="two-outliers-in-five-ignored"),
    pytest.param([(0, 1, 5.0), (0, 1, 1.0)], 0, 1.0, id="cold-first-step-then-warm"),
    pytest.param([(0, 1, 1.0)] * 5 + [(0, 1, 2.0)] * 2, 0, 1.0,
                 id="real-slowdown-not-yet-after-two"),
    pytest.param([(0, 1, 1.0)] * 5 + [(0, 1, 2.0)] * 3, 0, 2.0,
                 id="real-slowdown-followed-after-three"),
    pytest.param([(0, 1, 1.0)] * 5 + [(0, 1, 7.0)] * 3, 0, 7.0,
                 id="a-big-real-slowdown-is-not-clipped"),
    pytest.param([(0, 1, 1.0), (1, 1, 3.0), (2, 1, 2.0)], 9, 2.0, id="unmeasured-gets-the-median"),
    pytest.param([(0, 1, 1.0), (1, 1, 3.0)], 9, 1.0, id="unmeasured-even-count-lower-median"),
    pytest.param([], 0, None, id="nobody-measured"),
    pytest.param([(0, 0, 1.0)], 0, None, id="no-microbatches-measures-nothing"),
    pytest.param([(0, 2, 0.0)], 0, None, id="zero-time-ignored"),
    pytest.param([(0, 2, -1.0)], 0, None, id="negative-time-ignored"),
    pytest.param([(0, 2, math.nan)], 0, None, id="nan-ignored"),
    pytest.param([(0, 2, math.inf)], 0, None, id="inf-ignored"),
]


@pytest.mark.parametrize(("observations", "replica", "expected"), ESTIMATE_ROWS)
def test_estimate(observations, replica, expected):
    estimator = ThroughputEstimator()
    for replica_id, microbatches, seconds in observations:
        estimator.observe(replica_id, microbatches, seconds)
    assert estimator.estimate(replica) == expected


@pytest.mark.parametrize(("microbatches", "seconds", "counted"), [
    pytest.param(3, 1.5, True, id="ordinary"),
    pytest.param(0, 1.5, False, id="idle-member"),
    pytest.param(3, 0.0, False, id="untimed"),
    pytest.param(3, math.nan, False, id="nan"),
])
def test_observe_says_whether_it_counted(microbatches, seconds, counted):
    estimator = ThroughputEstimator()
    assert estimator.observe(4, microbatches, seconds) is counted
    assert estimator.measured(4) is counted


def test_own_estimate_does_not_fall_back_to_the_median():
    estimator = ThroughputEstimator()
    estimator.observe(0, 1, 2.0)
    assert estimator.own_estimate(1) is None
    assert estimator.estimate(1) == 2.0


def test_window_keeps_only_the_last_observations():
    estimator = ThroughputEstimator(window=3)
    for seconds in (9.0, 9.0, 9.0, 1.0, 1.0):
        estimator.observe(0, 1, seconds)
    assert estimator.estimate(0) == 1.0  # only [9, 1, 1] remain
    with pytest.raises(ValueError, match="window must be >= 1, got 0"):
        ThroughputEstimator(window=0)
    assert ThroughputEstimator().window == DEFAULT_WINDOW


def test_forget_drops_a_replica_and_the_median_moves():
    estimator = ThroughputEstimator()
    estimator.observe(0, 1, 1.0)
    estimator.observe(1, 1, 5.0)
    estimator.observe(2, 1, 6.0)
    assert estimator.estimate(7) == 5.0
    estimator.forget(2)
    estimator.forget(2)  # forgetting twice, or an unknown replica, is harmless
    estimator.forget(42)
    assert not estimator.measured(2)
    assert estimator.estimate(2) == 1.0  # now unmeasured: the median of [1, 5]
    assert dict(estimator.snapshot()) == {0: 1.0, 1: 5.0}


def test_deterministic_same_observations_same_estimates():
    rng = random.Random(7)
    observations = [(rng.randrange(4), rng.randint(0, 5), rng.uniform(0.0, 3.0))
                    for _ in range(200)]
    snapshots = []
    for _ in range(2):
        estimator = ThroughputEstimator()
        for obs in observations:
            estimator.observe(*obs)
        snapshots.append(estimator.snapshot())
    assert snapshots[0] == snapshots[1]
    assert hash(snapshots[0]) == hash(snapshots[1])


# ---------------------------------------------------------------- snapshots

def test_snapshot_is_frozen_and_restricted():
    estimator = ThroughputEstimator()
    for replica, seconds in ((2, 3.0), (0, 1.0), (5, 2.0)):
        estimator.observe(replica, 2, seconds)
    speeds = estimator.snapshot()
    assert list(speeds) == [0, 2, 5]  # by replica id
    assert dict(speeds) == {0: 0.5, 2: 1.5, 5: 1.0}
    assert dict(estimator.snapshot([5, 0, 9])) == {0: 0.5, 5: 1.0}  # 9 unmeasured: left out
    with pytest.raises(dataclasses.FrozenInstanceError):
        speeds.pairs = ()  # type: ignore[misc]
    estimator.observe(0, 1, 100.0)
    assert speeds[0] == 0.5, "a snapshot does not follow later observations"


@pytest.mark.parametrize(("measured", "members", "expected"), [
    pytest.param({0: 1.0, 1: 2.0, 2: 4.0}, [2, 0], {2: 4.0, 0: 1.0}, id="all-measured-in-order"),
    pytest.param({0: 1.0, 1: 2.0, 2: 4.0}, [0, 1, 2, 7], {0: 1.0, 1: 2.0, 2: 4.0, 7: 2.0},
                 id="newcomer-at-the-members-median"),
    pytest.param({0: 1.0, 1: 3.0, 5: 9.0}, [0, 1, 7], {0: 1.0, 1: 3.0, 7: 1.0},
                 id="median-of-measured-members-not-of-the-lost"),
    pytest.param({5: 9.0}, [0, 1], {0: 9.0, 1: 9.0}, id="no-member-measured-global-median"),
    pytest.param({}, [0, 1], None, id="nobody-measured"),
])
def test_seconds_for(measured, members, expected):
    seconds = Speeds.of(measured).seconds_for(members)
    assert seconds == expected
    if expected is not None:
        assert list(seconds) == members


@pytest.mark.parametrize(("pairs", "message"), [
    pytest.param({0: 0.0}, "replica 0: seconds per microbatch must be finite and > 0, got 0.0",
                 id="zero"),
    pytest.param({3: -1.0}, "replica 3", id="negative"),
    pytest.param({1: math.inf}, "got inf", id="inf"),
])
def test_speeds_reject_bad_times(pairs, message):
    with pytest.raises(ValueError, match=message):
        Speeds.of(pairs)


def test_speeds_reject_a_replica_twice_and_compare_by_value():
    with pytest.raises(ValueError, match="appears twice"):
        Speeds(((0, 1.0), (0, 2.0)))
    assert Speeds.of({1: 2.0, 0: 1.0}) == Speeds.of({0: 1.0, 1: 2.0})
    assert Speeds.of({0: 1.0}) != Speeds.of({0: 1.5})
    assert Speeds().median() is None and len(Speeds()) == 0
    assert Speeds.of({0: 1.0, 1: 5.0, 2: 2.0}).median() == 2.0


# ---------------------------------------------------------------- leads

def test_leads_are_smoothed_like_speeds_and_unmeasured_ones_sit_at_the_median():
    estimator = ThroughputEstimator(window=3)
    # Not measured (0: a step entered by a new generation), or nonsense: ignored.
    assert [estimator.observe_lead(0, v) for v in (0.0, -1.0, math.nan, math.inf)] == [False] * 4
    for replica, leads in ((0, (0.020, 0.5, 0.021, 0.022)), (1, (0.002, 0.003)), (2, (0.002,))):
        for lead in leads:
            assert estimator.observe_lead(replica, lead)
    estimator.observe(0, 1, 1.0)
    speeds = estimator.snapshot()
    assert speeds.leads == ((0, 0.022), (1, 0.002), (2, 0.002))  # window 3: 0.5 outvoted
    assert speeds.lead_for([2, 0, 7]) == {2: 0.002, 0: 0.022, 7: 0.002}  # 7: the members' median
    assert estimator.snapshot([1]).leads == ((1, 0.002),)
    estimator.forget(0)
    assert dict(estimator.snapshot().leads) == {1: 0.002, 2: 0.002}
    assert Speeds.of({0: 1.0}).lead_for([0, 1]) == {0: 0.0, 1: 0.0}  # nobody's: plans as before
    with pytest.raises(ValueError, match="replica 3: a lead must be finite and >= 0"):
        Speeds.of({3: 1.0}, {3: -0.1})
    with pytest.raises(ValueError, match="appears twice"):
        Speeds(((0, 1.0),), ((0, 0.1), (0, 0.2)))
