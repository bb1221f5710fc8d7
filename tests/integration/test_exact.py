"""Bitwise-identical trajectory under failures (--reduce exact), hangs, and the drop ablation."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from recover.cli.verify import compare
from tests.integration.conftest import assert_bitwise_identical, run_recover

pytestmark = pytest.mark.slow

EXACT_ARGS = ["--steps", "6", "-M", "12", "-B", "4", "--seed", "7", "--quiet", "--reduce", "exact"]


def exact_run(tmp_path: Path, replicas: int, *kills: str, extra: tuple[str, ...] = ()) -> dict[str, Any]:
    args = [*EXACT_ARGS, "--replicas", str(replicas), *extra]
    for kill in kills:
        args += ["--kill", kill]
    result = run_recover(tmp_path, *args, agents=2)
    assert result.returncode == 0, result.stderr
    return result.summary


@pytest.fixture(scope="module")
def exact_reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    summary = exact_run(tmp_path_factory.mktemp("exact-reference"), 4)
    assert summary["failures"] == []
    return summary


@pytest.mark.parametrize("kills", [
    pytest.param(["step=1,replica=2,phase=forward"], id="forward"),
    pytest.param(["step=2,replica=1,phase=backward"], id="backward"),
    pytest.param(["step=2,replica=3,phase=reduce"], id="reduce"),
    pytest.param(["step=3,replica=0,phase=commit"], id="commit"),
    pytest.param(["step=2,replica=1,phase=backward", "step=2,replica=2,phase=rebuild"],
                 id="during-recovery"),
    pytest.param(["step=3,replica=1,phase=forward", "step=3,replica=3,phase=backward"],
                 id="two-at-once"),
])
def test_exact_under_crashes(kills: list[str], tmp_path: Path,
                             exact_reference: dict[str, Any]) -> None:
    summary = exact_run(tmp_path, 4, *kills)
    assert len(summary["failures"]) == len(kills)
    assert_bitwise_identical(summary, exact_reference)


def test_exact_under_every_kind_of_hang(tmp_path: Path, exact_reference: dict[str, Any]) -> None:
    """SIGSTOP, a Python busy loop and a deadlock: the watchdog kills each, training goes on."""
    summary = exact_run(tmp_path, 4, "step=1,replica=1,phase=stop", "step=2,replica=2,phase=spin",
                        "step=3,replica=3,phase=deadlock")
    failures = {f["replica"]: f for f in summary["failures"]}
    assert {r: f["phase"] for r, f in failures.items()} == {1: "stop", 2: "spin", 3: "deadlock"}
    assert all(f["cause"] == "watchdog" for f in failures.values())
    # Detected after the configured bound (2 s default), not at the group timeout (30 s).
    assert all(1.5 < f["detected_s"] < 15 for f in failures.values()), failures
    assert_bitwise_identical(summary, exact_reference)


@pytest.mark.parametrize("replicas", [3, 2])
def test_exact_with_other_replica_counts(replicas: int, tmp_path: Path,
                                         exact_reference: dict[str, Any]) -> None:
    assert_bitwise_identical(exact_run(tmp_path, replicas), exact_reference)


def test_proportional_quotas_around_a_slow_replica_keep_the_trajectory(
        tmp_path: Path, exact_reference: dict[str, Any]) -> None:
    """Quotas that follow measured speed change who computes, never what is computed: a
    replica 4x slower gets a smaller share once measured, a kill on top is recovered, and
    the trajectory is the uniform failure-free one, bit for bit. Real processes: the
    speeds are measured from the workers' own reports of their compute time. The same run
    has replica 3 slow but alive in step 2 (1.2 s per microbatch, below the watchdog's
    bound): it is not killed."""
    summary = exact_run(tmp_path, 4, "step=3,replica=1,phase=forward",
                        "step=2,replica=3,phase=slow,seconds=1.2",
                        extra=("--policy", "proportional", "--compute-ms", "30",
                               "--slowdown", "replica=2,factor=4"))
    assert summary["policy"] == "proportional"
    assert [(f["replica"], f["phase"]) for f in summary["failures"]] == [(1, "forward")]
    assert 3 in summary["live_replicas"]
    loads = summary["microbatches_by_replica_per_step"]
    assert loads[0] == {"0": 3, "1": 3, "2": 3, "3": 3}  # nobody measured yet: uniform
    assert all(sum(step.values()) == 12 for step in loads)
    assert loads[-1]["2"] < 3 and loads[-1]["2"] == min(loads[-1].values())
    assert_bitwise_identical(summary, exact_reference)


def test_work_stealing_with_kills_racing_steals_keeps_the_trajectory(
        tmp_path: Path, exact_reference: dict[str, Any]) -> None:
    """Work-stealing changes who computes inside a step, never what: two replicas 4x slower
    from step 1 have their unstarted microbatches taken by the idle ones, step after step
    (under uniform quotas: proportional ones would leave them little to give);
    the giver is SIGKILLed right after answering a Release (its answer may or may not have
    left) and a taker right after being handed stolen microbatches, and both are recovered.
    Every step sums the same 12 microbatches and the trajectory is the uniform failure-free
    one, bit for bit. Real processes: a Release and its answer cross the agents and the
    controller's gRPC streams while the workers compute, which no fake orders for us."""
    summary = exact_run(tmp_path, 4, "step=2,replica=2,phase=release",
                        "step=3,replica=0,phase=steal",
                        extra=("--work-stealing", "--policy", "recover", "--compute-ms", "30",
                               "--slowdown", "replica=2,factor=4,from_step=1",
                               "--slowdown", "replica=3,factor=4,from_step=1"))
    assert summary["work_stealing"]
    assert sorted((f["replica"], f["phase"]) for f in summary["failures"]) == [
        (0, "steal"), (2, "release")]
    assert sum(summary["stolen_per_step"][1:]) > 0
    loads = summary["microbatches_by_replica_per_step"]
    assert all(sum(step.values()) == 12 for step in loads)
    assert any(step.get("3", 3) < 3 for step in loads[1:])  # the slow one gave some away
    assert_bitwise_identical(summary, exact_reference)


def test_drop_policy_drifts(tmp_path: Path, exact_reference: dict[str, Any]) -> None:
    """The ablation: dropping a lost replica's microbatches changes what the model learns."""
    summary = exact_run(tmp_path, 4, "step=2,replica=1,phase=backward", extra=("--policy", "drop"))
    assert summary["policy"] == "drop"
    assert summary["microbatches_per_step"][2] == 9  # 12 planned, replica 1's 3 dropped
    assert summary["microbatches_per_step"][:2] == [12, 12]
    verdict = compare(exact_reference, summary)
    assert not verdict.identical
    assert verdict.first_difference == 2
    assert summary["param_sha256"] != exact_reference["param_sha256"]


def test_non_finite_gradient_fails_the_job_instead_of_redoing_forever(tmp_path: Path) -> None:
    """A NaN gradient overflows every scale: after a bounded number of redos the job
    must end with a reason, the steps before it committed and nothing after it."""
    args = [*EXACT_ARGS, "--replicas", "2", "--kill", "step=2,replica=1,phase=nan"]
    result = run_recover(tmp_path, *args, timeout=90, agents=2)
    assert result.returncode == 1, result.stderr
    assert "non-finite" in result.stderr and "Traceback" not in result.stderr
    summary = result.summary
    assert summary["state"] == "failed"
    assert summary["steps_committed"] == 2
    assert summary["exact_redos"] == 3


def test_exact_in_pieces_reduced_during_the_last_backward_under_kills(
        tmp_path: Path, exact_reference: dict[str, Any]) -> None:
    """Exact mode's integers reduced in pieces during the last backward (trainer/overlap.py;
    `--overlap-piece-kb` makes this small model have some): the real gloo group starts them
    on the reducing thread while peers die in backward and in the reduction, and the run is
    bitwise the one that reduces after the backward. One job, two kills."""
    summary = exact_run(tmp_path, 4, "step=1,replica=2,phase=backward",
                        "step=3,replica=1,phase=reduce", extra=("--overlap-piece-kb", "64"))
    assert summary["workload"]["reduce_pieces"] > 1
    assert len(summary["failures"]) == 2
    assert_bitwise_identical(summary, exact_reference)
