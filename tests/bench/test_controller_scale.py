"""`recover bench controller` at a tiny size: simulated agents register and heartbeat against a
real controller process, one dies, the survivors get the new plan; the fit is pure."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from recover.bench.controller_scale import RACK_PROCESSES, ScaleConfig, client_commands, process_split
from recover.bench.scale_results import (
    agents_per_core,
    answered_of,
    cpu_fit,
    plan_receipts,
    reactions,
)
from recover.cli.main import main


@pytest.mark.timeout(90)
@pytest.mark.parametrize("relays, sim_racks, kills", [(0, 0, 1), (1, 0, 1), (0, 2, 2)])
def test_sim_agents_against_a_real_controller(tmp_path, capsys, relays, sim_racks, kills):
    # Real processes: the controller (with `relays`, a relay process in front of it) and the
    # simulated agents' processes are what is measured; the bench runs in this process. With
    # `sim_racks`, the agents' relays are simulated, speaking the relay protocol to the real
    # leader: it must register their agents, plan them and answer each death.
    code = main(["bench", "controller", "--agents", "4", "--duration", "3", "--out", str(tmp_path),
                 "--relays", str(relays), "--sim-racks", str(sim_racks), "--kills", str(kills)])
    assert code == 0, capsys.readouterr().err
    (row,) = json.loads((tmp_path / "results.json").read_text())["rows"]
    assert "error" not in row, row
    assert row["agents_alive_in_window"] == 4  # all registered and kept alive
    assert row["heartbeats"] >= (0 if sim_racks else 4)  # behind relays, beats end there
    assert row["session_errors"] == 0
    assert row["killed"] == kills
    assert row["generation_after_death"] == 1 + kills
    assert row["agents_alive_after_death"] == 4 - kills
    # Each death answered by its own generation, which every survivor then held.
    assert [(k["generation"], k["survivors"]) for k in row["kills"]] == [
        (1 + i, 4 - i) for i in range(1, kills + 1)]
    assert all(k["last_s"] is not None and k["last_s"] >= k["first_s"] for k in row["kills"])
    assert row["death_to_last_plan_p99_s"] is not None and row["controller_cpu_fraction"] >= 0
    assert row["relays"] == relays and row["relays_cpu_fraction"] >= 0  # ticks of 10 ms: maybe 0
    assert row["sim_racks"] == sim_racks
    # Once the job ran, the leader froze its start's objects (full collections then skip them).
    assert "objects of its start frozen for the garbage collector" in (
        tmp_path / "n4" / "controller.log").read_text()


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


def test_each_kill_is_timed_against_the_generation_that_answered_it():
    # Two clients, three kills: kill 0 and 2 went to client 0, kill 1 to client 1.
    outputs = [{"kind": "racks", "kills_at": [10.0, 14.0],
                "generations": [{"1": 1.0, "2": 10.02, "3": 12.01, "4": 14.05}]},
               {"kills_at": [12.0], "generations": [{"1": 1.0, "2": 10.03, "3": 12.02},
                                                    {"1": 1.0, "2": 10.01}]}]
    rows = reactions(outputs, [2, 3, 4])
    assert [(r["generation"], r["survivors"]) for r in rows] == [(2, 3), (3, 2), (4, 1)]
    assert [(r["first_s"], r["last_s"]) for r in rows] == [
        (pytest.approx(0.01), pytest.approx(0.03)), (pytest.approx(0.01), pytest.approx(0.02)),
        (pytest.approx(0.05), pytest.approx(0.05))]
    assert [r["last_by_kind_s"] for r in rows] == [
        {"racks": pytest.approx(0.02), "agents": pytest.approx(0.03)},
        {"racks": pytest.approx(0.01), "agents": pytest.approx(0.02)},
        {"racks": pytest.approx(0.05)}]
    # A client with no live agent left to kill: that kill is skipped, not misattributed.
    assert len(reactions([{"kills_at": [], "generations": []}], [2])) == 0
    # One with none at its turn (None) keeps the later kills on their own times; a kill not
    # answered in time is a row of its own, and the next kill counts from the last answer.
    outputs = [{"kills_at": [10.0, None, 14.0],
                "generations": [{"1": 1.0, "2": 10.02, "3": 12.5, "4": 14.03}]}]
    rows = reactions(outputs, [2, None, 4])
    assert [(r["generation"], r.get("unanswered", False)) for r in rows] == [(2, False), (4, False)]
    rows = reactions([{"kills_at": [10.0, 12.0, 14.0],
                       "generations": [{"1": 1.0, "2": 10.02, "3": 14.04}]}], [2, None, 3])
    assert [r["generation"] for r in rows] == [2, None, 3]
    assert rows[1]["unanswered"] and rows[1]["last_s"] is None
    assert rows[2]["first_s"] == pytest.approx(0.04)
    assert answered_of({"kills": rows}) == "2/3" and answered_of({"kills": rows[:1]}) == "1"


def test_simulated_racks_split_the_agents_and_the_racks_over_a_few_processes():
    config = ScaleConfig(agents=[12_500], duration_s=3, out=Path("."), sim_racks=50)
    commands = client_commands(12_500, config, "127.0.0.1:1", [])
    assert len(commands) == RACK_PROCESSES
    counts = [int(c[-3]) for c in commands]
    racks = [int(c[-1]) for c in commands]
    assert sum(counts) == 12_500 and sum(racks) == 50 and max(racks) - min(racks) <= 1
    assert all(c[2] == "recover.bench.sim_racks" for c in commands)
    relayed = client_commands(600, ScaleConfig(agents=[600], duration_s=3, out=Path(".")),
                              "leader", ["r0", "r1"])
    assert [c[3] for c in relayed] == ["r0", "r1", "r0"]  # relays round robin, 250 each
    both = client_commands(3000, config, "leader", ["r0", "r1"])  # 50 racks and 2 real relays
    assert [(c[2], c[3], c[4], c[5]) for c in both[-2:]] == [
        ("recover.bench.sim_agents", "r0", "2500", "250"),
        ("recover.bench.sim_agents", "r1", "2750", "250")]
    assert sum(int(c[-3]) for c in both[:-2]) == 2500 and sum(int(c[-1]) for c in both[:-2]) == 50
    few = client_commands(5, ScaleConfig(agents=[5], duration_s=3, out=Path("."), sim_racks=4),
                          "127.0.0.1:1", [])
    assert [(int(c[-3]), int(c[-1])) for c in few] == [(2, 1), (1, 1), (1, 1), (1, 1)]


@pytest.mark.parametrize(("argv", "phrase"), [
    (["--agents", "12500"], "at most 5000 agents with sessions of their own, got 12500; "
                            "larger counts with --sim-racks"),
    (["--agents", "251", "--sim-racks", "2", "--relays", "1"],
     "every agent count must be at least the racks and the 250 agents of the relays, got 251"),
    (["--agents", "3", "--sim-racks", "4"], "every agent count must be at least the racks, got 3"),
    (["--agents", "3", "--kills", "3"], "--kills 3 must leave a survivor of the smallest count"),
    (["--agents", "3", "--kills", "0"], "--kills must be 1..1000, got 0"),
])
def test_bench_controller_refuses_what_it_cannot_run_in_one_line(tmp_path, capsys, argv, phrase):
    assert main(["bench", "controller", "--out", str(tmp_path), *argv]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1 and phrase in err, err
