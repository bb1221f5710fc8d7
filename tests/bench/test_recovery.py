"""`recover bench recovery`: the kill schedule covers every phase, the phase split is computed from
a run's summary and events, and one real run writes results.json with p50_s / p99_s."""

from __future__ import annotations

import json

import pytest

from recover.bench import recovery
from recover.bench.recovery import KILL_PHASES, SECONDARY, schedule, split_recoveries
from recover.cli.main import main

# The bench's job (-M 16 -B 8, the default reference GPT) with a smaller model and
# microbatch: what is asserted (three kills recorded and timed, the split computed) does
# not depend on the model's size. Later flags win.
SMALL = ["-B", "2", "--n-layer", "1", "--n-embd", "32", "--n-head", "2", "--seq-len", "16"]


def test_default_schedule_covers_every_phase_with_distinct_victims():
    kills = [k for run in range(8) for k in schedule(run, 4)]
    assert len(kills) >= 20
    assert {k["phase"] for k in kills} == set(KILL_PHASES + SECONDARY)
    for run in range(8):
        assert len({k["replica"] for k in schedule(run, 4)}) == 3


def test_split_of_a_hand_made_recovery():
    start = 1000.0
    summary = {
        "started_at": start,
        # killed at +1.00, detected at +1.03, computing again at +1.08
        "failures": [{"at_s": 1.03, "detected_s": 0.03, "recovered_s": 0.08}],
        "events": [{"at": start + 0.1, "kind": "generation"},
                   {"at": start + 1.04, "kind": "generation"}],
        "committed_at_s_per_step": [0.5, 1.2, 1.3],
        "commit_wait_s_per_step": [0.01, 0.006, 0.01],
    }
    (row,) = split_recoveries(summary)
    assert row["detect"] == pytest.approx(0.03, abs=1e-4)
    assert row["plan"] == pytest.approx(0.01, abs=1e-4)
    assert row["rebuild"] == pytest.approx(0.04, abs=1e-4)
    assert row["total"] == pytest.approx(0.08, abs=1e-4)
    assert row["recompute"] == pytest.approx(0.12, abs=1e-4)
    assert row["commit"] == pytest.approx(0.006)


@pytest.mark.timeout(120)
def test_one_run_writes_results(tmp_path, capsys, monkeypatch):
    # Real processes: the run is a real job whose workers are SIGKILLed; the bench that starts
    # it runs in this process.
    run_recover = recovery.run_recover
    monkeypatch.setattr(recovery, "run_recover",
                        lambda out, args, **kw: run_recover(out, [*args, *SMALL], **kw))
    code = main(["bench", "recovery", "--runs", "1", "--out", str(tmp_path)])
    err = capsys.readouterr().err
    assert code == 0, err
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["n_failures"] == 3 and results["failed_runs"] == 0
    assert results["p50_s"] is not None and results["p99_s"] >= results["p50_s"]
    assert set(results["split"]) == {"detect", "plan", "rebuild", "recompute", "commit", "total"}
    assert results["split"]["total"]["n"] >= 1
    assert "[run 1/1]" in err
