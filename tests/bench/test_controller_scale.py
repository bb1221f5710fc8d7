"""`recover bench controller` at a tiny size: simulated agents register and heartbeat against a
real controller process, one dies, the survivors get the new plan; the fit is pure."""

from __future__ import annotations

import json

import pytest

from recover.bench.controller_scale import agents_per_core, cpu_fit, plan_receipts, process_split
from recover.cli.main import main


@pytest.mark.timeout(90)
@pytest.mark.parametrize("relays", [0, 1])
def test_sim_agents_against_a_real_controller(tmp_path, capsys, relays):
    # Real processes: the controller (with `relays`, a relay process in front of it) and the
    # simulated agents' processes are what is measured; the bench runs in this process.
    code = main(["bench", "controller", "--agents", "3", "--duration", "3", "--out", str(tmp_path),
                 "--relays", str(relays)])
    assert code == 0, capsys.readouterr().err
    (row,) = json.loads((tmp_path / "results.json").read_text())["rows"]
    assert "error" not in row, row
    assert row["agents_alive_in_window"] == 3  # all registered and kept alive by heartbeats
    assert row["heartbeats"] >= 3
    assert row["session_errors"] == 0
    assert row["generation_after_death"] == 2 and row["agents_alive_after_death"] == 2
    assert row["survivors_with_new_plan"] == 2
    assert row["death_to_last_plan_s"] is not None and row["controller_cpu_fraction"] >= 0
    assert row["relays"] == relays and row["relays_cpu_fraction"] >= 0  # ticks of 10 ms: maybe 0


def test_fit_and_split():
    fixed, slope = cpu_fit([(10, 0.02), (100, 0.11), (1000, 1.01)])
    assert fixed == pytest.approx(0.01) and slope == pytest.approx(0.001)
    assert agents_per_core((fixed, slope)) == 990
    assert cpu_fit([(10, 0.05)]) == (0.0, 0.005)
    assert agents_per_core((0.1, 0.0)) is None
    assert process_split(600, 250) == [(0, 250), (250, 250), (500, 100)]


def test_plan_receipts_ignore_generations_from_the_teardown():
    seen = [{"1": 5.0, "2": 10.01, "3": 13.0}, {"1": 5.0, "2": 10.02}, {"1": 5.0}]
    assert plan_receipts(seen, killed_at=10.0, newest=2) == [10.01, 10.02]
