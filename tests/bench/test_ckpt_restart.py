"""The checkpoint-and-restart baseline really restarts and resumes from its checkpoint;
`recover bench throughput` writes its results at tiny sizes. Real processes throughout."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

TINY = ["--replicas", "2", "--steps", "8", "-M", "4", "-B", "2", "--seed", "3", "--n-layer", "1",
        "--n-embd", "32", "--n-head", "2", "--seq-len", "16", "--compute-ms", "20", "--quiet"]


def recover(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "recover.cli.main", *args], capture_output=True,
                          text=True, timeout=timeout)


@pytest.mark.timeout(120)
def test_baseline_restarts_and_resumes_from_checkpoint(tmp_path):
    ref = recover("run", "--mode", "ckpt-restart", *TINY, "--ckpt-every-steps", "3",
                  "--out", str(tmp_path / "ref"))
    assert ref.returncode == 0, ref.stderr
    # A crash of slot 1 during step 4: the last checkpoint holds step 3 (after steps 0-2).
    hit = recover("run", "--mode", "ckpt-restart", *TINY, "--ckpt-every-steps", "3",
                  "--kill", "step=4,replica=1,phase=forward", "--out", str(tmp_path / "hit"))
    assert hit.returncode == 0, hit.stderr
    a = json.loads((tmp_path / "ref" / "summary.json").read_text())
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


@pytest.mark.timeout(60)
def test_bad_input_is_one_line_exit_2(tmp_path):
    bad = tmp_path / "s.json"
    bad.write_text('{"kind": "lose-half", "first_at_s": 1}')
    for args in (["bench", "throughput", "--schedule", str(bad), "--out", str(tmp_path)],
                 ["run", "--mode", "ckpt-restart", "--schedule", str(bad)],
                 ["run", "--mode", "ckpt-restart", "--kill", "step=1,replica=0,phase=stop"],
                 ["run", "--mode", "ckpt-restart", "--", "python", "train.py"],
                 ["run", "--compute-ms", "-1"]):
        result = recover(*args, timeout=60)
        assert result.returncode == 2, (args, result.stderr)
        assert len(result.stderr.strip().splitlines()) == 1, result.stderr


@pytest.mark.timeout(200)
def test_bench_throughput_plumbing(tmp_path):
    schedule = tmp_path / "one.json"
    # Slot 1 is lost and its replacement host arrives a second later (an agent joining the
    # running ReCoVer job; the baseline uses it at its next restart).
    schedule.write_text(json.dumps({"kind": "explicit", "events": [
        {"at_s": 0.3, "slot": 1, "repair_s": 0.3}]}))
    out = tmp_path / "tp"
    result = recover("bench", "throughput", *[a for a in TINY if a != "--quiet"], "--steps", "16",
                     "--schedule", str(schedule), "--out", str(out), timeout=190)
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
    sim = recover("bench", "simulate", "--out", str(tmp_path / "sim"), "--calibrate",
                  str(out / "results.json"))
    assert sim.returncode == 0, sim.stderr
    simulated = json.loads((tmp_path / "sim" / "results.json").read_text())
    assert set(simulated["calibration"]["relative_error"]) == {"recover", "ckpt-restart"}
    assert len(simulated["projections"]) == 3


@pytest.mark.timeout(120)
def test_baseline_trains_the_same_job_as_recover(tmp_path):
    """No failure, one split of M: the baseline's losses are ReCoVer's, bit for bit."""
    runs = {}
    for mode in ("recover", "ckpt-restart"):
        done = recover("run", "--mode", mode, *TINY, "--compute-ms", "0",
                       "--out", str(tmp_path / mode))
        assert done.returncode == 0, done.stderr
        runs[mode] = json.loads((tmp_path / mode / "summary.json").read_text())
    assert runs["ckpt-restart"]["loss_per_step"] == runs["recover"]["loss_per_step"]
    assert runs["ckpt-restart"]["tokens"] == runs["recover"]["tokens"] == 8 * 4 * 2 * 16
