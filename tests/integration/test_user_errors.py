"""Mistakes in a user's script end the job with one line naming them, never a hang, and show
the user's own traceback when their code raised (tests/fixtures/faulty_workload.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.integration.conftest import REPO, assert_bitwise_identical, run_recover

pytestmark = pytest.mark.slow

SCRIPT = str(REPO / "tests" / "fixtures" / "faulty_workload.py")
ARGS = ["--replicas", "2", "--steps", "4", "-M", "4", "--quiet"]


def failed_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.startswith("recover run: training failed")]
    assert len(lines) == 1, stderr
    return lines[0]


@pytest.mark.parametrize("mistake, extra, phrase", [
    pytest.param("no-api", [], "the worker command exited (exit code 0) without calling "
                               "recover.trainer.init(): is it a ReCoVer training script?",
                 id="never-calls-the-api"),
    pytest.param("no-train", [], "does the script call recover.trainer.train()?", id="no-train"),
    pytest.param("non-scalar", [], "loss_fn returned a loss of shape [8, 1]; it must be a scalar",
                 id="non-scalar-loss"),
    pytest.param("private-rng", ["--check-determinism"],
                 "determinism check failed: microbatch 0 of step 0 gave different gradients",
                 id="unseeded-generator"),
    # Fast mode, no flag: the batch is still loaded twice (a source that is not a pure
    # function of (step, microbatch) breaks "the same M microbatches" in either mode).
    pytest.param("random-batch", [],
                 "determinism check failed: the batch of microbatch 0 of step 0 differed "
                 "between two loads", id="random-batch-in-fast-mode"),
    # A setting the workers cannot honour (no GPU, or a model on the CPU): refused at start,
    # not at the first reduce; the unit tests check each reason (test_groups.py).
    pytest.param("none", ["--group-backend", "nccl"], "use --group-backend gloo",
                 id="nccl-for-a-model-on-the-cpu"),
])
def test_a_mistake_is_one_line_and_exit_1(tmp_path: Path, mistake: str, extra: list[str],
                                          phrase: str) -> None:
    result = run_recover(tmp_path, *ARGS, *extra, "--", "python", SCRIPT, "--mistake", mistake,
                         timeout=90)
    assert result.returncode == 1
    assert phrase in failed_line(result.stderr)
    assert "Traceback" not in result.stderr  # a broken contract is not the user's code raising
    assert result.summary["state"] == "failed"


def test_an_exception_in_the_loss_shows_the_users_traceback_only(tmp_path: Path) -> None:
    result = run_recover(tmp_path, *ARGS, "--", "python", SCRIPT, "--mistake", "raise", timeout=90)
    assert result.returncode == 1
    line = failed_line(result.stderr)
    assert "loss_fn raised at step 0, microbatch 3: ZeroDivisionError: float division by zero" in line
    assert "a bug in the workload, not a fault" in line  # it failed on a second replica too
    traceback = result.stderr[:result.stderr.index(line)]
    assert "Traceback (most recent call last)" in traceback
    assert "in loss_fn" in traceback and "in divide" in traceback
    assert "trainer/" not in traceback  # ReCoVer's own frames are left out


def test_a_bare_torch_rand_is_seeded_so_exact_mode_stays_bitwise(tmp_path: Path) -> None:
    script = ["--", "python", SCRIPT, "--mistake", "bare-rand"]
    reference = run_recover(tmp_path / "reference", *ARGS, "--reduce", "exact", *script)
    assert reference.returncode == 0, reference.stderr
    assert reference.summary["workload"]["determinism_sha256"]
    killed = run_recover(tmp_path / "killed", *ARGS, "--reduce", "exact",
                         "--kill", "step=1,replica=1,phase=backward", *script)
    assert killed.returncode == 0, killed.stderr
    assert_bitwise_identical(killed.summary, reference.summary)
