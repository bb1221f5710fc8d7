"""deploy/prometheus and deploy/grafana against the real tool and the code's own metrics.

The alert rules are checked and unit-tested by `promtool` (the Debian `prometheus` package,
installed by scripts/test.sh); the scrape configuration is parsed by it. Every metric the
rules and the dashboard query must be one the controller or an agent exports, and every
metric exported is documented in its module's table. (The dashboard's queries run against
a real Prometheus scraping a real job in tests/integration/test_prometheus.py.)
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest

from recover.agent import metrics as agent_metrics
from recover.controller import metrics as controller_metrics
from tests.unit.coordinator_harness import Harness, make_job

REPO = Path(__file__).resolve().parents[2]
PROMETHEUS = REPO / "deploy" / "prometheus"
DASHBOARD = REPO / "deploy" / "grafana" / "recover.json"
SUFFIXES = ("_total", "_bucket", "_sum", "_count")


def promtool(*args: str) -> subprocess.CompletedProcess[str]:
    binary = shutil.which("promtool")
    if binary is None:
        pytest.skip("promtool is not installed (scripts/test.sh installs the Debian "
                    "package prometheus)")
    return subprocess.run([binary, *args], capture_output=True, text=True, timeout=60,
                          cwd=PROMETHEUS)


@pytest.mark.parametrize("args", [
    ("check", "config", "--syntax-only", "recover.yml"),  # its TLS files exist on a cluster
    ("check", "rules", "rules.yml"),
    ("test", "rules", "rules_test.yml"),
], ids=["config", "rules", "rule-tests"])
def test_promtool_accepts_the_shipped_files(args: tuple[str, ...]) -> None:
    result = promtool(*args)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout + result.stderr


def exported() -> set[str]:
    """The families a controller (leading, with its role) and an agent export."""
    harness = Harness(make_job())
    election = SimpleNamespace(holds=lambda: True, refused_writes=0)
    agent = SimpleNamespace(workers={}, generation=0, term=0, fenced_commands=0, reconnects=0,
                            heartbeats_sent=0, reports_relayed=0)
    collectors = [controller_metrics.ControllerCollector(harness.coord),
                  controller_metrics.RoleCollector(election,  # type: ignore[arg-type]
                                                   SimpleNamespace(resets=0)),
                  agent_metrics.AgentCollector(agent)]  # type: ignore[arg-type]
    return {family.name for collector in collectors for family in collector.collect()}


def documented() -> set[str]:
    tables = (controller_metrics.__doc__ or "") + (agent_metrics.__doc__ or "")
    return {name.removesuffix("_total") for name in re.findall(r"^\| `(recover_\w+)`", tables,
                                                                 re.MULTILINE)}


def queried(text: str) -> set[str]:
    """The metric families named in PromQL text (a counter's _total, a histogram's parts)."""
    names = set()
    for name in re.findall(r"\b(recover_\w+)", text):
        for suffix in SUFFIXES:
            if name.endswith(suffix) and name.removesuffix(suffix) in exported_names:
                name = name.removesuffix(suffix)
        names.add(name)
    return names - {"recover_job", "recover_process"}  # labels, not metrics


exported_names = exported()


def test_every_exported_metric_is_documented_and_nothing_documented_is_missing() -> None:
    assert exported_names == documented()


def dashboard_queries() -> list[str]:
    board = json.loads(DASHBOARD.read_text())
    queries = [target["expr"] for panel in board["panels"] for target in panel.get("targets", [])]
    queries += [v["definition"] for v in board["templating"]["list"] if "definition" in v]
    return queries


def test_the_rules_and_the_dashboard_query_only_metrics_that_exist() -> None:
    rules = queried((PROMETHEUS / "rules.yml").read_text())
    board = queried("\n".join(dashboard_queries()))
    assert rules <= exported_names, rules - exported_names
    assert board <= exported_names, board - exported_names
    # The dashboard shows what the issue asks a person to see.
    for wanted in ("recover_live_replicas", "recover_generation", "recover_tokens_per_second",
                   "recover_steps_committed", "recover_recovery_seconds",
                   "recover_microbatches_planned", "recover_heartbeat_age_seconds",
                   "recover_joins", "recover_state_transfer_seconds",
                   "recover_store_write_seconds"):
        assert wanted in board, wanted


def test_the_dashboard_is_well_formed() -> None:
    board = json.loads(DASHBOARD.read_text())
    ids = [panel["id"] for panel in board["panels"]]
    assert len(ids) == len(set(ids))
    cells: set[tuple[int, int]] = set()
    for panel in board["panels"]:
        grid = panel["gridPos"]
        mine = {(grid["x"] + dx, grid["y"] + dy) for dx in range(grid["w"])
                for dy in range(grid["h"])}
        assert not mine & cells, f"panel {panel['title']!r} overlaps another"
        assert grid["x"] + grid["w"] <= 24
        cells |= mine
        if panel["type"] != "row":
            assert panel["targets"] and panel["datasource"]["uid"] == "${datasource}"
            assert all(t["expr"] and t["refId"] for t in panel["targets"])
    variables = {v["name"] for v in board["templating"]["list"]}
    assert variables == {"datasource", "recover_job"}
    assert all("$recover_job" in q for q in dashboard_queries()[:-1])  # each panel filters
