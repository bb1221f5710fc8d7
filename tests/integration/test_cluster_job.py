"""A job started by hand, as on a cluster: a job file on the controller names the user's
script and its config, agents bring only slots, and the summary comes from the controller."""

from __future__ import annotations

import json
import signal
import subprocess
from pathlib import Path

import pytest

from tests.etcd_cluster import free_port
from tests.integration.conftest import REPO, Processes, recover_cmd, wait_for
from tests.integration.test_hosts import job_state

pytestmark = pytest.mark.slow

JOB_FILE = """
[job]
replicas = 2
steps = 5
global_microbatches = 4
reduce = "exact"
job_id = "by-hand"

[workload]
command = ["python", "{script}", "--mistake", "none"]
config = {{ lr = 0.25, name = "cluster" }}
"""


def test_job_file_command_config_and_controller_written_summary(tmp_path: Path) -> None:
    port = free_port()
    address = f"127.0.0.1:{port}"
    job_file = tmp_path / "job.toml"
    job_file.write_text(JOB_FILE.format(script=REPO / "tests" / "fixtures" / "faulty_workload.py"))
    logs = tmp_path / "logs"
    processes = Processes(logs)
    start = processes.start

    try:
        controller = start("controller", "controller", "--port", str(port), "--job", str(job_file),
                           "--summary-out", str(tmp_path / "ctl"), "--linger", "60")
        for name in ("a", "b"):
            start(f"agent-{name}", "agent", "--controller", address, "--slots", "1",
                  "--agent-id", name, "--log-dir", str(logs), "--connect-timeout", "30")
        wait_for(lambda: job_state(address) in ("succeeded", "failed"), 120, "the job to end")
        written = wait_for(lambda: (tmp_path / "ctl" / "summary.json").exists(), 10,
                           "the controller's summary.json")
        assert written
        summary = json.loads((tmp_path / "ctl" / "summary.json").read_text())
        assert summary["state"] == "succeeded", summary["reason"]
        assert (summary["job_id"], summary["steps_committed"], summary["reduce"]) == (
            "by-hand", 5, "exact")
        assert summary["workload"]["command"][-2:] == ["--mistake", "none"]
        assert all(summary["param_sha256_per_step"])
        fetched = subprocess.run(recover_cmd("summary", "--controller", address, "--out",
                                             str(tmp_path / "fetched")),
                                 capture_output=True, text=True, timeout=30)
        assert fetched.returncode == 0, fetched.stderr
        again = json.loads((tmp_path / "fetched" / "summary.json").read_text())
        for key in ("steps_committed", "sample_digest_per_step", "param_sha256_per_step",
                    "loss_per_step", "workload"):
            assert again[key] == summary[key], key
        for replica in (0, 1):
            log = (logs / f"replica-{replica}.log").read_text()
            assert "workload config: {'lr': 0.25, 'name': 'cluster'}" in log
        controller.send_signal(signal.SIGTERM)
        assert controller.wait(timeout=15) == 0
    finally:
        processes.stop()
