"""examples/batchnorm.py: a BatchNorm ConvNet whose buffers are inside the exact guarantee.

Real processes, real SIGKILLs, exact mode: every original replica is killed, one per phase
(forward, backward, reduce, commit), the last kill a total loss; the job resumes from its
newest checkpoint. Parameters *and buffers* after every step (the step digests cover both)
and the first replica's eval (accuracy, loss, a digest of the running statistics, computed
by the example itself) equal the failure-free run's.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.integration.conftest import REPO, assert_bitwise_identical, run_recover

pytestmark = pytest.mark.slow

ARGS = ["--replicas", "4", "--steps", "12", "-M", "8", "--seed", "5", "--reduce", "exact",
        "--quiet"]
KILLS = ["step=1,replica=1,phase=forward", "step=2,replica=2,phase=backward",
         "step=4,replica=3,phase=reduce", "step=7,replica=0,phase=commit"]


def script(eval_out: Path) -> list[str]:
    return ["--", "python", str(REPO / "examples" / "batchnorm.py"), "--eval-out", str(eval_out)]


def evals(*files: Path) -> dict[int, dict[str, Any]]:
    """step -> the eval line the first replica wrote (a step written twice must agree)."""
    by_step: dict[int, dict[str, Any]] = {}
    for file in files:
        for line in file.read_text().splitlines():
            entry = json.loads(line)
            assert by_step.setdefault(entry["step"], entry) == entry
    return by_step


def test_buffers_and_eval_are_bitwise_through_kills_in_every_phase_and_a_resume(
        tmp_path: Path) -> None:
    # One test for the whole story: every run costs ~40 s of process startup on 2 cores.
    reference = run_recover(tmp_path / "reference", *ARGS, *script(tmp_path / "reference.jsonl"),
                            timeout=240)
    assert reference.returncode == 0, reference.stderr
    assert all("+" in d for d in reference.summary["param_sha256_per_step"])  # buffers digested

    # Emulated compute keeps the steps long enough for each kill to land in its step;
    # checkpoints every step give the resume its starting point after the total loss.
    slow = ["--compute-ms", "50", "--checkpoint-dir", str(tmp_path / "ckpt"),
            "--checkpoint-every", "1"]
    lost = run_recover(tmp_path / "killed", *ARGS, *slow,
                       *[part for kill in KILLS for part in ("--kill", kill)],
                       *script(tmp_path / "killed.jsonl"), timeout=240)
    assert lost.returncode != 0 and "all replicas lost" in lost.stdout + lost.stderr, lost.stderr
    assert [f["phase"] for f in lost.summary["failures"]] == ["forward", "backward", "reduce",
                                                              "commit"]
    resumed = run_recover(tmp_path / "resumed", *ARGS, *slow, "--resume", str(tmp_path / "ckpt"),
                          *script(tmp_path / "killed.jsonl"), timeout=240)  # the same command
    assert resumed.returncode == 0, resumed.stderr
    assert_bitwise_identical(resumed.summary, reference.summary)
    killed_steps = lost.summary["param_sha256_per_step"][:7]  # applied before the total loss
    assert killed_steps == reference.summary["param_sha256_per_step"][:7]

    want = evals(tmp_path / "reference.jsonl")
    got = evals(tmp_path / "killed.jsonl")  # both runs append to it
    assert set(range(7, 12)) <= set(got)  # the resumed run evaluated every step it trained
    for step, entry in got.items():
        assert entry == want[step], f"eval after step {step} differs"
