"""examples/batchnorm.py: a BatchNorm ConvNet whose buffers are inside the exact guarantee.

Real processes, real SIGKILLs, exact mode: every original replica is killed, one per phase
(forward, backward, reduce, commit), the last kill a total loss; the job resumes from its
newest checkpoint. Parameters *and buffers* after every step (the step digests cover both)
and the first replica's eval (accuracy, loss, a digest of the running statistics, computed
by the example itself) equal the failure-free run's. The model out: the final state_dict the
first replica saves, `recover.trainer.load_checkpoint` and `recover export` (.pt and
.safetensors, loaded by plain torch) all hold the failure-free run's final model, bitwise.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
import safetensors.torch
import torch

import recover.trainer as rt
from tests.integration.conftest import REPO, assert_bitwise_identical, recover_cmd, run_recover

pytestmark = pytest.mark.slow

ARGS = ["--replicas", "4", "--steps", "12", "-M", "8", "--seed", "5", "--reduce", "exact",
        "--quiet"]
KILLS = ["step=1,replica=1,phase=forward", "step=2,replica=2,phase=backward",
         "step=4,replica=3,phase=reduce", "step=7,replica=0,phase=commit"]


def script(eval_out: Path, save: Path | None = None) -> list[str]:
    return ["--", "python", str(REPO / "examples" / "batchnorm.py"), "--eval-out", str(eval_out),
            *(["--save", str(save)] if save else [])]


def assert_same_tensors(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(recover_cmd(*args), capture_output=True, text=True, timeout=120)


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
    reference = run_recover(tmp_path / "reference", *ARGS,
                            *script(tmp_path / "reference.jsonl", tmp_path / "reference.pt"),
                            timeout=240)
    assert reference.returncode == 0, reference.stderr
    assert all("+" in d for d in reference.summary["param_sha256_per_step"])  # buffers digested

    # Emulated compute keeps the steps long enough for each kill to land in its step;
    # checkpoints every step give the resume its starting point after the total loss.
    slow = ["--compute-ms", "50", "--checkpoint-dir", str(tmp_path / "ckpt"),
            "--checkpoint-every", "1"]
    # No restarts: a warm restart is back within a second, and this run must lose them all.
    lost = run_recover(tmp_path / "killed", *ARGS, *slow, "--max-restarts", "0",
                       *[part for kill in KILLS for part in ("--kill", kill)],
                       *script(tmp_path / "killed.jsonl", tmp_path / "resumed.pt"), timeout=240)
    assert lost.returncode != 0 and "all replicas lost" in lost.stdout + lost.stderr, lost.stderr
    assert [f["phase"] for f in lost.summary["failures"]] == ["forward", "backward", "reduce",
                                                              "commit"]
    resumed = run_recover(tmp_path / "resumed", *ARGS, *slow, "--resume", str(tmp_path / "ckpt"),
                          *script(tmp_path / "killed.jsonl", tmp_path / "resumed.pt"),
                          timeout=240)  # the same command (a resume refuses another)
    assert resumed.returncode == 0, resumed.stderr
    assert_bitwise_identical(resumed.summary, reference.summary)
    killed_steps = lost.summary["param_sha256_per_step"][:7]  # applied before the total loss
    assert killed_steps == reference.summary["param_sha256_per_step"][:7]

    want = evals(tmp_path / "reference.jsonl")
    got = evals(tmp_path / "killed.jsonl")  # both runs append to it
    assert set(range(7, 12)) <= set(got)  # the resumed run evaluated every step it trained
    for step, entry in got.items():
        assert entry == want[step], f"eval after step {step} differs"

    # The model out, four ways, all the failure-free run's final model (buffers included).
    final = torch.load(tmp_path / "reference.pt", weights_only=True)
    assert any("running_mean" in name for name in final)
    assert_same_tensors(torch.load(tmp_path / "resumed.pt", weights_only=True), final)
    checkpoint = rt.load_checkpoint(tmp_path / "ckpt")  # the folder: its newest file
    assert checkpoint.step == 12 and checkpoint.path.name == "ckpt-0000000012.rcv"
    assert_same_tensors(checkpoint.model, final)
    for name in ("model.pt", "model.safetensors"):
        exported = run_cli("export", str(tmp_path / "ckpt"), str(tmp_path / name))
        assert exported.returncode == 0, exported.stderr
        assert "after 12 steps" in exported.stdout
        assert (tmp_path / name).stat().st_mode & 0o777 == 0o600
    assert_same_tensors(torch.load(tmp_path / "model.pt", weights_only=True), final)
    assert_same_tensors(safetensors.torch.load_file(tmp_path / "model.safetensors"), final)
    refused = run_cli("export", str(tmp_path / "reference"), str(tmp_path / "x.pt"))
    assert refused.returncode == 1 and refused.stderr.startswith("recover export: no checkpoint")
