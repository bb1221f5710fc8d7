"""The simulator reproduces hand-computed runs."""

from __future__ import annotations

import pytest

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
