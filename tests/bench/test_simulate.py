"""The simulator reproduces hand-computed runs."""

from __future__ import annotations

import pytest

from recover.bench.elastic_sim import Elastic, projections, simulate_elastic
from recover.bench.simulate import Costs, Job, simulate_ckpt, simulate_recover, step_s

COSTS = Costs(microbatch_s=1.0, overhead_s=0.5, startup_s=10.0, recover_stall_s=0.25,
              restart_s=20.0, ckpt_write_s=2.0)
JOB = Job(replicas=4, global_microbatches=8, steps=10)


def test_failure_free():
    assert step_s(COSTS, JOB, 4) == 2.5  # ceil(8/4) x 1 + 0.5
    assert simulate_recover(JOB, COSTS, []) == 10 + 10 * 2.5
    # checkpoints after steps 3, 6, 9 (not after the last): 3 x 2 s
    assert simulate_ckpt(JOB, COSTS, [], every_steps=3, mtbf_s=None) == 10 + 25 + 6


def test_recover_by_hand():
    # Failure at t=11 in step 0 (started at 10): 1 s x 4 replicas = 4 microbatches done, the
    # dead one's is lost -> 3 kept, 5 left on 3 survivors: ceil(5/3) x 1 + 0.5 = 2.5 after the
    # 0.25 s stall -> step 0 commits at 13.75; 9 more steps at ceil(8/3) + 0.5 = 3.5 s.
    assert simulate_recover(JOB, COSTS, [(11.0, 3, None)]) == pytest.approx(13.75 + 9 * 3.5)


def test_ckpt_by_hand():
    # Steps 0-2 end at 17.5, checkpoint -> 19.5; steps 3, 4 end at 24.5; the failure at 25.0
    # (in step 5) restarts at 45 from step 3 with 3 slots: 7 steps of 3.5 s plus
    # checkpoints after steps 6 and 9 (2 x 2 s) -> 45 + 24.5 + 4.
    assert simulate_ckpt(JOB, COSTS, [(25.0, 3, None)], every_steps=3, mtbf_s=None) == \
        pytest.approx(45 + 24.5 + 4)


def test_elastic_without_failures_or_spares_is_the_plain_run():
    elastic = Elastic(spares=2, join_s=5.0, entry_s=0.75)
    assert simulate_elastic(JOB, COSTS, elastic, []) == simulate_recover(JOB, COSTS, [])


def test_a_spare_enters_the_recovery_itself():
    # As in test_recover_by_hand, 3 microbatches of step 0 are kept at the loss (t=11); the
    # spare enters the recovering generation (no second stall): the 5 left on 4 replicas,
    # ceil(5/4) x 1 + 0.5 after the 0.25 s stall -> 13.75, then 9 steps at full size.
    elastic = Elastic(spares=1, join_s=100.0, entry_s=0.75)
    assert simulate_elastic(JOB, COSTS, elastic, [(11.0, 3, None)]) == \
        pytest.approx(13.75 + 9 * 2.5)


def test_a_restarted_slot_rejoins_in_the_background_and_extra_ones_wait_as_spares():
    # No spares: the slot is back at 12 and ready at 12 + join_s 3 = 15: steps 1 (13.75 ->
    # 17.25) runs on 3, the replica enters at 17.25 (+0.75), then 8 steps at full size.
    elastic = Elastic(spares=0, join_s=3.0, entry_s=0.75)
    assert simulate_elastic(JOB, COSTS, elastic, [(11.0, 3, 12.0)]) == \
        pytest.approx(17.25 + 0.75 + 8 * 2.5)
    # With a spare as well, the spare enters the recovery and the returning slot, ready at
    # 15, finds the job full: it becomes a spare and nobody stalls again.
    with_spare = Elastic(spares=1, join_s=3.0, entry_s=0.75)
    assert simulate_elastic(JOB, COSTS, with_spare, [(11.0, 3, 12.0)]) == \
        pytest.approx(13.75 + 9 * 2.5)


def test_projections_come_back_faster_with_spares():
    rows = projections(seed=1)
    for row in rows:
        assert row["ettr_rejoin_spares"] >= row["ettr_rejoin"] - 1e-9, row
        assert 0 < row["ettr_rejoin_spares_per_provisioned_gpu"] <= row["ettr_rejoin_spares"]
