"""The checkpoint-and-restart baseline really restarts and resumes from its checkpoint;
`recover bench throughput` writes its results at tiny sizes. Real processes throughout.

Runs are shared between tests (module fixtures): the baseline's failure-free run is the
reference of the restart test and, against the throughput bench's failure-free ReCoVer run,
the proof that both train the same job."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from recover.cli.main import main

TINY = ["--replicas", "2", "--steps", "8", "-M", "4", "-B", "2", "--seed", "3", "--n-layer", "1",
        "--n-embd", "32", "--n-head", "2", "--seq-len", "16", "--compute-ms", "20", "--quiet"]
TOKENS_PER_STEP = 4 * 2 * 16  # M x B x seq_len


def recover(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "recover.cli.main", *args], capture_output=True,
                          text=True, timeout=timeout)


@pytest.fixture(scope="module")
def ckpt_reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The baseline without failures (8 steps, a checkpoint every 3): its summary."""
    # Real processes: the baseline's supervisor starts and restarts real worker processes.
    out = tmp_path_factory.mktemp("ckpt") / "ref"
    ref = recover("run", "--mode", "ckpt-restart", *TINY, "--ckpt-every-steps", "3",
                  "--out", str(out))
    assert ref.returncode == 0, ref.stderr
    return json.loads((out / "summary.json").read_text())


@pytest.fixture(scope="module")
def throughput(tmp_path_factory: pytest.TempPathFactory) -> tuple[subprocess.CompletedProcess[str],
                                                                  Path]:
    """`recover bench throughput` at tiny sizes (16 steps, one slot lost and given back):
    the finished process and its --out folder."""
    # Real processes: the bench runs real ReCoVer jobs and kills real worker PIDs.
    tmp = tmp_path_factory.mktemp("throughput")
    schedule = tmp / "one.json"
    # Slot 1 is lost and its replacement host arrives a second later (an agent joining the
    # running ReCoVer job; the baseline uses it at its next restart).
    schedule.write_text(json.dumps({"kind": "explicit", "events": [
        {"at_s": 0.3, "slot": 1, "repair_s": 0.3}]}))
    out = tmp / "tp"
    result = recover("bench", "throughput", *[a for a in TINY if a != "--quiet"], "--steps", "16",
                     "--schedule", str(schedule), "--out", str(out), timeout=190)
    return result, out


@pytest.mark.timeout(120)
def test_baseline_restarts_and_resumes_from_checkpoint(tmp_path, ckpt_reference):
    # Real processes: the crash is a SIGKILL of a real worker, the restart a new process.
    a = ckpt_reference
    # A crash of slot 1 during step 4: the last checkpoint holds step 3 (after steps 0-2).
    hit = recover("run", "--mode", "ckpt-restart", *TINY, "--ckpt-every-steps", "3",
                  "--kill", "step=4,replica=1,phase=forward", "--out", str(tmp_path / "hit"))
    assert hit.returncode == 0, hit.stderr
    b = json.loads((tmp_path / "hit" / "summary.json").read_text())
    assert a["state"] == b["state"] == "succeeded"
    assert a["restarts"] == [] and len(b["restarts"]) == 1
    restart = b["restarts"][0]
    assert restart["resumed_from_step"] == 3  # from the checkpoint, not from step 0
    assert [x["first_step"] for x in b["attempts"]] == [0, 3]
    assert restart["lost_steps"] >= 1 and b["steps_redone"] == restart["lost_steps"]
    assert restart["import_s"] > 0 and restart["load_s"] > 0  # the restart paid real costs
    assert b["steps_committed"] == 8
    for got, want in zip(b["loss_per_step"], a["loss_per_step"], strict=True):
        assert got == pytest.approx(want, rel=1e-5)


def _exit_code(argv: list[str]) -> int:
    try:
        return main(argv)
    except SystemExit as exc:  # argparse's own errors
        return int(exc.code or 0)


def test_bad_input_is_one_line_exit_2(tmp_path, capsys):
    bad = tmp_path / "s.json"
    bad.write_text('{"kind": "lose-half", "first_at_s": 1}')
    for args in (["bench", "throughput", "--schedule", str(bad), "--out", str(tmp_path)],
                 ["run", "--mode", "ckpt-restart", "--schedule", str(bad)],
                 ["run", "--mode", "ckpt-restart", "--kill", "step=1,replica=0,phase=stop"],
                 ["run", "--mode", "ckpt-restart", "--", "python", "train.py"],
                 ["run", "--compute-ms", "-1"]):
        code = _exit_code(args)
        stderr = capsys.readouterr().err
        assert code == 2, (args, stderr)
        assert len(stderr.strip().splitlines()) == 1, stderr


@pytest.mark.timeout(200)
def test_bench_throughput_plumbing(tmp_path, throughput, capsys):
    # Real processes: the bench's three runs are real jobs (the `throughput` fixture).
    result, out = throughput
    assert result.returncode == 0, result.stderr[-2000:]
    results = json.loads((out / "results.json").read_text())
    for key in ("speedup_tokens_per_wall_s", "speedup_tokens_per_slot_hour",
                "speedup_tokens_per_alive_slot_s"):
        assert results[key] > 0
    assert set(results["runs"]) == {"reference", "recover", "ckpt-restart"}
    assert [r["slot"] for r in results["recover_returns"]] == [1]
    assert all(run["steps"] == 16 for run in results["runs"].values())
    # Same job everywhere: failures change only the float summation order.
    assert max(results["max_abs_loss_diff_vs_reference"].values()) < 1e-4
    assert (out / "tokens_over_time.png").stat().st_size > 0
    assert (out / "loss_per_step.png").stat().st_size > 0
    assert "ckpt-restart" in result.stderr  # the progress display
    # The simulator is pure computation: run in this process.
    code = main(["bench", "simulate", "--out", str(tmp_path / "sim"), "--calibrate",
                 str(out / "results.json")])
    assert code == 0, capsys.readouterr().err
    simulated = json.loads((tmp_path / "sim" / "results.json").read_text())
    assert set(simulated["calibration"]["relative_error"]) == {"recover", "ckpt-restart"}
    assert len(simulated["projections"]) == 3


@pytest.mark.timeout(200)
def test_baseline_trains_the_same_job_as_recover(ckpt_reference, throughput):
    """No failure, one split of M: the baseline's losses are ReCoVer's, bit for bit (the
    baseline's 8 steps against the first 8 of the throughput bench's failure-free ReCoVer
    run of the same job: no learning-rate schedule, so a step's loss does not depend on
    the run's length)."""
    # Real processes: both runs are real jobs (the fixtures), compared bit for bit.
    result, out = throughput
    assert result.returncode == 0, result.stderr[-2000:]
    runs = {"ckpt-restart": ckpt_reference,
            "recover": json.loads((out / "reference" / "summary.json").read_text())}
    assert runs["recover"]["state"] == runs["ckpt-restart"]["state"] == "succeeded"
    assert runs["recover"]["steps_committed"] == 16 and runs["ckpt-restart"]["restarts"] == []
    assert runs["ckpt-restart"]["loss_per_step"] == runs["recover"]["loss_per_step"][:8]
    assert runs["ckpt-restart"]["tokens"] == 8 * TOKENS_PER_STEP
    assert runs["recover"]["tokens"] == 16 * TOKENS_PER_STEP
