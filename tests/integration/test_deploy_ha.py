"""The deploy/ha recipe, run as written on one machine (loopback): certs.sh makes the CA and
a host certificate, etcd.sh starts a TLS etcd that requires client certificates, and
controller.sh and agent.sh train a job over mutual TLS, one agent directly and one behind
a rack relay (relay.sh), all configured by recover-ha.env edited the way a user would."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import ssl
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tests.etcd_cluster import free_port, require_etcd
from tests.integration.conftest import REPO, recover_cmd, wait_for

pytestmark = pytest.mark.slow

DEPLOY = REPO / "deploy" / "ha"
STEPS = 4


def edited_env_file(tmp_path: Path, settings: dict[str, str]) -> Path:
    """recover-ha.env with `settings` in place of the example values (nothing else changed)."""
    text = (DEPLOY / "recover-ha.env").read_text()
    for key, value in settings.items():
        text, count = re.subn(rf"^{key}=.*$", f"{key}={shlex.quote(value)}", text, flags=re.M)
        assert count == 1, f"recover-ha.env has no single {key}= line"
    path = tmp_path / "recover-ha.env"
    path.write_text(text)
    return path


def test_the_ha_recipe_trains_over_mutual_tls(tmp_path: Path) -> None:
    require_etcd()
    if shutil.which("etcdctl") is None:
        pytest.skip("etcdctl is not installed (Debian package etcd-client; scripts/test.sh "
                    "installs it)")
    port, metrics_port, etcd_port, relay_port = free_port(), free_port(), free_port(), free_port()
    tls = tmp_path / "tls"
    env_file = edited_env_file(tmp_path, {
        "RECOVER_TLS_DIR": str(tls),
        "RECOVER_ETCD_CLUSTER": "m1=127.0.0.1",
        "RECOVER_ETCD_CLIENT_PORT": str(etcd_port),
        "RECOVER_ETCD_PEER_PORT": str(free_port()),
        "RECOVER_CONTROLLERS": f"127.0.0.1:{port}",
        "RECOVER_CONTROLLER_PORT": str(port),
        "RECOVER_METRICS_PORT": str(metrics_port),
        "RECOVER_JOB_ARGS": f"--job-id ha --replicas 2 --steps {STEPS} -M 4 -B 2 --reduce exact "
                            "--linger 30",
        "RECOVER_WORKER_COMMAND": "",
        "RECOVER_SLOTS": "1",
    })
    # Two agents on this one machine: each its own metrics port (from the environment).
    env = dict(os.environ, RECOVER_BIN=f"{sys.executable} -m recover.cli.main",
               RECOVER_AGENT_METRICS_PORT=str(free_port()),
               RECOVER_HOST_NAME="host0", RECOVER_ETCD_DATA=str(tmp_path / "etcd"),
               RECOVER_SUMMARY_DIR=str(tmp_path / "summary"), PYTHONUNBUFFERED="1")
    made = subprocess.run(["bash", str(DEPLOY / "certs.sh"), str(tls),
                           "host0:controller+agent+relay@127.0.0.1,recover-etcd", "gpu1:agent",
                           "root:operator"],
                          capture_output=True, text=True, timeout=60, env=env)
    assert made.returncode == 0, made.stderr
    assert {"ca.pem", "host0.pem", "host0-key.pem"} <= {p.name for p in tls.iterdir()}

    logs = tmp_path / "logs"
    logs.mkdir()
    started: list[subprocess.Popen[bytes]] = []

    def start(name: str, *args: str, log_name: str = "",
              **extra_env: str) -> subprocess.Popen[bytes]:
        with open(logs / f"{log_name or name}.log", "wb") as log:
            process = subprocess.Popen(["bash", str(DEPLOY / f"{name}.sh"), str(env_file), *args],
                                       stdout=log, stderr=subprocess.STDOUT,
                                       env=dict(env, **extra_env), start_new_session=True)
        started.append(process)
        return process

    try:
        start("etcd", "m1")
        # etcd closed to all but the controllers' certificates (users by common name).
        closed = subprocess.run(["bash", str(DEPLOY / "etcd-auth.sh"), str(env_file), "host0"],
                                capture_output=True, text=True, timeout=120, env=env)
        assert closed.returncode == 0, closed.stdout + closed.stderr
        controller = start("controller", "127.0.0.1")
        # One replica on host0's agent, directly; the other on gpu1's, behind the rack relay
        # host0 runs (relay.sh): the relay names gpu1's certificate to the leader.
        relay = f"127.0.0.1:{relay_port}"
        start("relay", RECOVER_RELAY=relay)
        start("agent")
        start("agent", log_name="agent-gpu1", RECOVER_HOST_NAME="gpu1", RECOVER_RELAY=relay,
              RECOVER_AGENT_METRICS_PORT=str(free_port()))
        summary_file = tmp_path / "summary" / "summary.json"
        wait_for(summary_file.exists, 180, "the controller's summary.json "
                 f"(logs: {sorted(p.name for p in logs.iterdir())})")
        summary = json.loads(summary_file.read_text())
        assert summary["state"] == "succeeded", summary["reason"]
        assert summary["steps_committed"] == STEPS
        assert summary["replicas_per_step"][-1] == 2
        assert "relaying to the leader" in (logs / "relay.log").read_text()
        assert f"session with the leader at {relay}" in (logs / "agent-gpu1.log").read_text()

        # Without the cluster's credentials nobody is let in: the controller asks for a
        # client certificate and the store for one too.
        bare = {k: v for k, v in os.environ.items() if not k.startswith("RECOVER_TLS_")}
        refused = subprocess.run(recover_cmd("status", "--controller", f"127.0.0.1:{port}"),
                                 capture_output=True, text=True, timeout=30, env=bare)
        assert refused.returncode != 0 and "TLS" in refused.stderr, refused.stderr
        # etcd: an agent's certificate (same CA) reaches it but may neither read nor write
        # the job's keys, the leader's included; the controller's may.
        def etcdctl(name: str, *args: str) -> subprocess.CompletedProcess[str]:
            return subprocess.run(
                ["etcdctl", "--endpoints", f"https://127.0.0.1:{etcd_port}",
                 "--cacert", str(tls / "ca.pem"), "--cert", str(tls / f"{name}.pem"),
                 "--key", str(tls / f"{name}-key.pem"), *args],
                capture_output=True, text=True, errors="replace", timeout=30,
                env=dict(env, ETCDCTL_API="3"))

        leader = "/recover/ha/leader"
        assert etcdctl("host0", "get", leader).stdout.strip()  # the last leader's record
        for attempt in (("get", "/recover/", "--prefix"), ("put", leader, "forged")):
            refused_etcd = etcdctl("gpu1", *attempt)
            assert refused_etcd.returncode != 0, refused_etcd.stdout
            assert "permission denied" in refused_etcd.stderr or \
                "user name not found" in refused_etcd.stderr, refused_etcd.stderr
        # The metrics are as closed as the controller: HTTPS, a client certificate of the CA.
        url = f"https://127.0.0.1:{metrics_port}/metrics"
        context = ssl.create_default_context(cafile=str(tls / "ca.pem"))
        with pytest.raises((ssl.SSLError, urllib.error.URLError, ConnectionError)):
            urllib.request.urlopen(url, context=context, timeout=10).read()
        context.load_cert_chain(str(tls / "host0.pem"), str(tls / "host0-key.pem"))
        with urllib.request.urlopen(url, context=context, timeout=10) as response:
            assert "recover_controller_is_leader 1.0" in response.read().decode()
        # Checked: end the controller's linger (`--linger 30` keeps it answering for the
        # checks above, however long they take) as systemd stops it; it exits cleanly.
        controller.send_signal(signal.SIGTERM)
        assert controller.wait(timeout=60) == 0
    finally:
        for process in started:
            if process.poll() is None:
                process.kill()
                process.wait()
