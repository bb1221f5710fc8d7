"""examples/porting.py: a script as people write them (fp16 autocast with ReCoVer's loss
scaling, torch.compile, an LR warm-up and clipping, an evaluation every few steps,
TensorBoard, a final save), under kills.

Real processes: the first replica, the one that logs, evaluates and would save, is killed
mid-run, and the next one takes over; in exact mode everything the script produces is the
failure-free run's: parameters after every step, the evaluations, the TensorBoard scalars,
the saved model, and the loss scale: the steps whose float16 gradient overflowed were
skipped on every replica, in both runs. One pair of runs, checked by many assertions (each
run ~15 s: dynamo traces the model in every worker). fp16 rather than the example's default
bf16: the two differ only in the dtype the script's own autocast is given, while fp16 also
runs ReCoVer's loss scaling.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.integration.conftest import REPO, assert_bitwise_identical, run_recover

pytestmark = pytest.mark.slow
tensorboard = pytest.importorskip("tensorboard", reason="pip install tensorboard (the test extra)")

ARGS = ["--replicas", "3", "--steps", "10", "-M", "6", "--seed", "2", "--reduce", "exact",
        "--max-restarts", "0", "--quiet"]


def script(out: Path) -> list[str]:
    # 2**22: the first steps' gradients overflow float16 and are skipped, later ones not.
    return ["--", "python", str(REPO / "examples" / "porting.py"), "--compile", "aot_eager",
            "--amp", "fp16", "--init-scale", str(2 ** 22),
            "--eval-every", "3", "--tensorboard", str(out / "tb"),
            "--eval-out", str(out / "eval.jsonl"), "--save", str(out / "final.pt")]


def scalars(folder: Path) -> dict[str, dict[int, float]]:
    """tag -> step -> value, over every event file of the folder (a writer per first replica)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    found: dict[str, dict[int, float]] = {}
    for events in sorted(folder.glob("events.out.tfevents.*")):
        accumulator = EventAccumulator(str(events))
        accumulator.Reload()
        for tag in accumulator.Tags()["scalars"]:
            for event in accumulator.Scalars(tag):
                found.setdefault(tag, {})[event.step] = event.value
    return found


def evals(path: Path) -> dict[int, float]:
    by_step: dict[int, float] = {}
    for line in path.read_text().splitlines():
        entry = json.loads(line)
        assert by_step.setdefault(entry["step"], entry["eval_loss"]) == entry["eval_loss"]
    return by_step


def test_a_ported_script_gives_the_failure_free_runs_logs_evals_and_model(tmp_path: Path) -> None:
    reference = run_recover(tmp_path / "reference", *ARGS, *script(tmp_path / "reference"),
                            timeout=240)
    assert reference.returncode == 0, reference.stderr
    killed = run_recover(tmp_path / "killed", *ARGS,
                         "--kill", "step=4,replica=0,phase=backward",  # the logging replica
                         "--kill", "step=7,replica=2,phase=reduce",
                         *script(tmp_path / "killed"), timeout=240)
    assert killed.returncode == 0, killed.stderr
    assert_bitwise_identical(killed.summary, reference.summary)
    assert killed.summary["live_replicas"] == [1]

    # The evaluations (every 3 steps, from whichever replica was first) are the same.
    assert evals(tmp_path / "killed" / "eval.jsonl") == evals(tmp_path / "reference" / "eval.jsonl")
    assert sorted(evals(tmp_path / "reference" / "eval.jsonl")) == [2, 5, 8]
    # TensorBoard: every step's loss and learning rate, and the evaluations, logged once
    # per step across the writers of the replicas that were first.
    want, got = scalars(tmp_path / "reference" / "tb"), scalars(tmp_path / "killed" / "tb")
    assert sorted(want["train/loss"]) == list(range(10)) and got == want
    assert [round(v, 4) for v in want["train/loss"].values()] == [
        round(v, 4) for v in reference.summary["loss_per_step"]]
    # The loss scale of every step: it backed off after overflowing steps (skipped) and was
    # the same in both runs, whichever replica logged it.
    scales = [want["train/loss_scale"][step] for step in range(10)]
    assert scales[0] == 2 ** 22 and scales[-1] < scales[0], scales
    # The final model, saved by the first replica at the end, is the failure-free one.
    saved = torch.load(tmp_path / "killed" / "final.pt")
    wanted = torch.load(tmp_path / "reference" / "final.pt")
    assert all(torch.equal(saved[k], wanted[k]) for k in wanted) and saved.keys() == wanted.keys()
