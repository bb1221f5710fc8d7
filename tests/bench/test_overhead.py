"""`recover bench overhead` at tiny sizes: the DDP baseline trains (real processes, gloo) and its
loss matches ReCoVer fast's on the same job; results.json has the keys. No timing asserted."""

from __future__ import annotations

import json

import pytest

from recover.bench.ddp_worker import my_microbatches
from recover.bench.overhead import MODES, order, steady_intervals
from recover.cli.main import main
from recover.controller.policy import uniform_plan


@pytest.mark.timeout(150)
def test_overhead_runs_ddp_and_recover_with_matching_loss(tmp_path, capsys):
    # Real processes: the three runs are real jobs (DDP over gloo, ReCoVer fast and exact); the
    # bench that starts them runs in this process (it only launches and reads them).
    code = main(["bench", "overhead", "--replicas", "2", "-M", "4", "-B", "2", "--steps", "5",
                 "--warmup", "1", "--reps", "1", "--n-layer", "1", "--n-embd", "32",
                 "--n-head", "2", "--seq-len", "16", "--out", str(tmp_path)])
    done = capsys.readouterr()
    assert code == 0, done.err
    results = json.loads((tmp_path / "results.json").read_text())
    for key in ("overhead_vs_ddp", "overhead_exact_vs_ddp", "step_s", "runs"):
        assert key in results
    assert set(results["step_s"]) == set(MODES)
    assert len(results["runs"]) == 3
    # Same microbatches, same seeds, same split: only float summation order differs.
    assert results["max_loss_diff_fast_vs_ddp"] < 1e-4
    assert results["max_loss_diff_exact_vs_ddp"] < 1e-4
    assert done.err.count("steady step") == 3  # one progress line per run
    assert "torch DDP" in done.out


def test_ddp_split_is_the_controllers_uniform_plan():
    for replicas, m in ((1, 1), (2, 4), (3, 16), (4, 6), (5, 5)):
        plan = uniform_plan(list(range(replicas)), m).assignment
        for rank in range(replicas):
            assert my_microbatches(rank, replicas, m) == list(plan[rank])


def test_steady_intervals_skip_warmup_and_order_rotates():
    assert steady_intervals([0.0, 5.0, 6.0, 7.5, 8.5], 2) == [1.5, 1.0]
    assert steady_intervals([0.0, 1.0], 2) == []
    assert [order(r)[0] for r in range(3)] == list(MODES)
    assert all(sorted(order(r)) == sorted(MODES) for r in range(4))


def test_torchft_is_a_fourth_mode_only_when_named_and_rotates_with_the_others(tmp_path):
    from recover.bench.overhead import OverheadConfig
    from recover.proto import pb

    plain = OverheadConfig(job=pb.JobConfig(), out=tmp_path)
    assert plain.modes == MODES
    with_torchft = OverheadConfig(job=pb.JobConfig(), out=tmp_path, torchft="/somewhere")
    assert with_torchft.modes == (*MODES, "torchft")
    assert [order(r, with_torchft.modes)[0] for r in range(4)] == list(with_torchft.modes)


def test_speed_against_torchft_is_torchfts_step_over_recovers():
    from recover.bench.overhead import vs_torchft

    runs = [{"mode": m, "rep": k, "median_step_s": s, "all_committed": True}
            for k, steps in enumerate(({"fast": 0.05, "exact": 0.06, "torchft": 0.055},
                                       {"fast": 0.06, "exact": 0.06, "torchft": 0.054}))
            for m, s in steps.items()]
    losses = {"fast": [2.0, 1.5], "exact": [2.0, 1.5], "torchft": [2.0, 1.5 + 1e-7]}
    got = vs_torchft(runs, {"fast": 0.055, "exact": 0.06, "torchft": 0.0545}, losses)
    assert got["speed_vs_torchft"] == {"fast": round(0.0545 / 0.055, 4),
                                       "exact": round(0.0545 / 0.06, 4)}
    assert got["speed_vs_torchft_per_rep"]["fast"] == [1.1, 0.9]  # faster, then slower
    assert got["max_loss_diff_vs_torchft"]["fast"] == pytest.approx(1e-7)
    assert got["torchft_every_step_committed"]


def test_a_folder_without_torchft_is_one_line_before_anything_runs(tmp_path, capsys):
    code = main(["bench", "overhead", "--out", str(tmp_path / "o"), "--torchft",
                 str(tmp_path)])
    err = capsys.readouterr().err
    assert code == 2 and "no torchft there" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "o").exists()
