"""A real Prometheus scrapes a real job started with `recover run --metrics-port 0`.

Multi-process on purpose (issue 24): what is checked is the chain a user relies on — the
targets file found by Prometheus' own file discovery, every process scraped, the shipped
alert rules loaded by a real server, and PromQL over what happened: a SIGKILLed worker
seen as a failure within two scrapes of the controller recording it, the live replicas
dropping by one and coming back when the restarted worker joins, and every query of the
shipped Grafana dashboard answered.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from tests.etcd_cluster import free_port
from tests.integration.conftest import REPO, recover_cmd, wait_for

pytestmark = pytest.mark.slow

SCRAPE_S = 0.5
"""Scrape interval: the live-replica dip lasts at least one step and a cold worker start
(seconds), so it is seen on every machine."""


def prometheus_config(tmp: Path, targets: Path) -> Path:
    config = tmp / "prometheus.yml"
    config.write_text(json.dumps({  # JSON is YAML
        "global": {"scrape_interval": f"{int(SCRAPE_S * 1000)}ms",
                   "evaluation_interval": "1s"},
        "rule_files": [str(REPO / "deploy" / "prometheus" / "rules.yml")],
        "scrape_configs": [{"job_name": "recover-local",
                            "file_sd_configs": [{"files": [str(targets)]}]}],
    }))
    return config


class Prometheus:
    def __init__(self, port: int) -> None:
        self.base = f"http://127.0.0.1:{port}"

    def get(self, path: str, **params: Any) -> Any:
        url = f"{self.base}{path}?{urllib.parse.urlencode(params)}"
        with urllib.request.urlopen(url, timeout=10) as response:
            body = json.loads(response.read())
        assert body["status"] == "success", body
        return body["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        return self.get("/api/v1/query", query=expr)["result"]

    def value(self, expr: str) -> float | None:
        result = self.query(expr)
        return float(result[0]["value"][1]) if result else None

    def samples(self, expr: str) -> list[tuple[float, float]]:
        """The raw samples of a range selector `expr` (one series), oldest first."""
        result = self.query(expr)
        return [(float(t), float(v)) for t, v in result[0]["values"]] if result else []

    def ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.base}/-/ready", timeout=2) as response:
                return response.status == 200
        except OSError:
            return False


def test_prometheus_scrapes_a_job_and_sees_a_kill_and_the_join(tmp_path: Path) -> None:
    binary = shutil.which("prometheus")
    if binary is None:
        pytest.skip("prometheus is not installed (scripts/test.sh installs the Debian package)")
    out = tmp_path / "run"
    out.mkdir()  # Prometheus watches the folder for the targets file: it must exist first
    port = free_port()
    config = prometheus_config(tmp_path, out / "prometheus-targets.json")
    logs = {name: open(tmp_path / f"{name}.log", "wb")  # noqa: SIM115 - closed in finally
            for name in ("prometheus", "run")}
    server = subprocess.Popen([binary, f"--config.file={config}", "--log.level=warn",
                               f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                               f"--web.listen-address=127.0.0.1:{port}"],
                              stdout=logs["prometheus"], stderr=subprocess.STDOUT,
                              start_new_session=True)
    prom = Prometheus(port)
    # Long enough to outlast the test; stopped by `recover stop` once everything is seen.
    # --cold-start: the restarted worker imports torch, so its replica is missing for
    # seconds, not for less than a scrape.
    job = subprocess.Popen(recover_cmd(
        "run", "--out", str(out), "--replicas", "2", "--steps", "5000", "-M", "4", "-B", "2",
        "--compute-ms", "20", "--max-restarts", "1", "--cold-start", "--metrics-port", "0",
        "--quiet"), stdout=logs["run"], stderr=subprocess.STDOUT, start_new_session=True)
    try:
        scrape_and_check(prom, job, out)
    except AssertionError as failure:
        raise AssertionError(f"{failure}\n{diagnostics(prom, tmp_path)}") from None
    finally:
        for process in (job, server):
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
        for log in logs.values():
            log.close()


def diagnostics(prom: Prometheus, tmp: Path) -> str:
    try:
        targets = [(t["labels"].get("recover_process"), t["health"], t["lastError"])
                   for t in prom.get("/api/v1/targets")["activeTargets"]]
    except OSError as exc:
        targets = [("unreachable", str(exc), "")]
    tails = {name: (tmp / f"{name}.log").read_text(errors="replace")[-1500:]
             for name in ("prometheus", "run")}
    return f"targets: {targets}\n" + "\n".join(f"--- {n}.log\n{t}" for n, t in tails.items())


def scrape_and_check(prom: Prometheus, job: subprocess.Popen[bytes], out: Path) -> None:
    wait_for(prom.ready, 60, "Prometheus to be ready")
    wait_for(lambda: (prom.value("sum(recover_steps_committed_total)") or 0) >= 3, 180,
             "Prometheus to see training")
    # Every process found by file discovery and scraped (each target's first scrape comes
    # at its own offset within the interval: wait for it, however slow the machine).
    wait_for(lambda: {r["metric"]["recover_process"]: r["value"][1] for r in prom.query("up")}
             == {"controller": "1", "host0": "1", "host1": "1"}, 60, "every process scraped")
    address = f"127.0.0.1:{(out / 'controller.port').read_text()}"

    def events() -> list[dict[str, Any]]:
        result = subprocess.run([*recover_cmd("events", "--controller", address, "--json")],
                                capture_output=True, text=True, timeout=30)
        assert result.returncode == 0, result.stderr
        return [json.loads(line) for line in result.stdout.splitlines()]

    ready = [e for e in events() if e["kind"] == "replica-ready" and e.get("replica") == 1]
    os.kill(int(ready[-1]["pid"]), signal.SIGKILL)

    wait_for(lambda: (prom.value("sum(recover_joins_total)") or 0) >= 1
             and prom.value("recover_live_replicas") == 2, 180,
             "Prometheus to see the restarted replica join")
    failed = [e for e in events() if e["kind"] == "replica-failed"]
    assert len(failed) == 1, failed
    assert prom.value("min_over_time(recover_live_replicas[10m])") == 1
    assert prom.value("max_over_time(recover_live_replicas[10m])") == 2
    assert prom.value("sum(recover_failures_total)") == 1
    assert (prom.value("sum(recover_agent_worker_exits_total)") or 0) >= 1

    # Seen within two scrapes of the controller recording it: counted in scrapes of the
    # controller (its `up` samples), not in seconds, so a slow machine cannot fake a miss.
    seen = prom.samples("recover_failures_total[10m]")  # one series: one cause
    first_seen = next(t for t, v in seen if v >= 1)
    scrapes = [t for t, _ in prom.samples('up{recover_process="controller"}[10m]')]
    between = [t for t in scrapes if failed[0]["at"] <= t < first_seen]
    assert len(between) <= 1, (failed[0]["at"], first_seen, between)

    # Every query of the shipped dashboard parses and runs; those about what happened here
    # have data (the job filter set to every job, as the dashboard's "All").
    board = json.loads((REPO / "deploy" / "grafana" / "recover.json").read_text())
    answered = {}
    for panel in board["panels"]:
        for target in panel.get("targets", []):
            answered[target["expr"]] = prom.query(target["expr"].replace("$recover_job", ".*"))
    empty = [e for e, result in answered.items() if not result and any(
        name in e for name in ("live_replicas", "generation", "tokens_per_second",
                               "steps_committed", "failures_total", "recovery_seconds_sum",
                               "joins_total", "store_write", "heartbeat_age",
                               "agent_workers{"))]
    assert not empty, empty

    rules = prom.get("/api/v1/rules")["groups"]
    assert [len(g["rules"]) for g in rules] == [8]
    assert all(r["health"] == "ok" for r in rules[0]["rules"]), rules

    stop = subprocess.run(recover_cmd("stop", "--controller", address), capture_output=True,
                          text=True, timeout=30)
    assert stop.returncode == 0, stop.stderr
    job.wait(timeout=120)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["state"] == "stopped", summary["reason"]
    assert set(summary["metrics"]) == {"controller", "host0", "host1"}
    assert not (out / "prometheus-targets.json").exists()  # the run is over: no targets
