"""deploy/slurm/recover.sbatch under a real Slurm (Debian's slurm-wlm and munge).

Multi-process on purpose (issue 24): a single-host Slurm cluster of two nodes (two slurmd
daemons with their own ports on loopback, one slurmctld, munge for authentication) is
brought up in a temporary folder; the batch script is submitted with `sbatch --wait`, a
worker is killed in the middle of a step, and the job must train to the end with every
agent named after its node, mutual TLS from the job's shared folder, and summary.json.
The nodes bring 4 slots to a job of 3 replicas, as clusters deliver capacity: the fourth
slot waits, registered, and takes the killed worker's place the moment it is lost (the
killed worker's own restart then finds the job full and waits in turn).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.etcd_cluster import free_port
from tests.integration.conftest import REPO

pytestmark = pytest.mark.slow

DAEMONS = ("munged", "slurmctld", "slurmd", "sbatch", "sinfo")


def slurm_conf(root: Path, host: str) -> str:
    nodes = "\n".join(
        f"NodeName={name} NodeHostname={host} NodeAddr=127.0.0.1 Port={free_port()} "
        "CPUs=2 RealMemory=2000" for name in ("n1", "n2"))
    return f"""ClusterName=recovertest
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={free_port()}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={root}/munge/munge.sock
CredType=cred/munge
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool/%n
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd-%n.pid
SlurmctldLogFile={root}/log/slurmctld.log
SlurmdLogFile={root}/log/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
ReturnToService=2
SchedulerType=sched/backfill
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
{nodes}
PartitionName=debug Nodes=n1,n2 Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE
"""


@pytest.fixture
def slurm(tmp_path: Path) -> Iterator[dict[str, str]]:
    """A two-node Slurm on this host; yields the environment its commands need."""
    missing = [d for d in DAEMONS if shutil.which(d) is None]
    if missing:
        pytest.skip(f"{', '.join(missing)} not installed (scripts/test.sh installs the Debian "
                    "packages slurm-wlm and munge)")
    root = tmp_path / "slurm"
    for folder in ("munge", "state", "spool", "log"):
        (root / folder).mkdir(parents=True, mode=0o700)
    key = root / "munge" / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o600)
    conf = root / "slurm.conf"
    conf.write_text(slurm_conf(root, socket.gethostname().split(".")[0]))
    env = dict(os.environ, SLURM_CONF=str(conf))
    processes: list[subprocess.Popen[bytes]] = []
    log = open(root / "log" / "daemons.log", "wb")  # noqa: SIM115 - closed below

    def start(*argv: str) -> None:
        processes.append(subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT,
                                          start_new_session=True))

    try:
        munge = root / "munge"
        start("munged", "--foreground", "--force", f"--socket={munge / 'munge.sock'}",
              f"--key-file={key}", f"--pid-file={munge / 'munged.pid'}",
              f"--log-file={munge / 'munged.log'}", f"--seed-file={munge / 'seed'}")
        deadline = time.monotonic() + 30
        while not (munge / "munge.sock").exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        start("slurmctld", "-D", "-i")
        start("slurmd", "-D", "-N", "n1")
        start("slurmd", "-D", "-N", "n2")
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            state = subprocess.run(["sinfo", "-h", "-o", "%t", "-N"], env=env,
                                   capture_output=True, text=True, timeout=30).stdout.split()
            if state == ["idle", "idle"]:
                break
            time.sleep(0.5)
        else:
            pytest.fail(f"Slurm's nodes did not come up: {state}; "
                        f"{(root / 'log' / 'slurmctld.log').read_text()[-2000:]}")
        yield env
    finally:
        for process in reversed(processes):
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGTERM)
        for process in processes:
            try:
                process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
        log.close()


def job_end(env: dict[str, str], job_id: str, timeout_s: float) -> tuple[str, str]:
    """(JobState, ExitCode) of a Slurm job once it has ended."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        shown = subprocess.run(["scontrol", "show", "job", "-o", job_id], env=env,
                               capture_output=True, text=True, timeout=30).stdout
        fields = dict(f.split("=", 1) for f in shown.split() if "=" in f)
        if fields.get("JobState") in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT",
                                      "NODE_FAIL", "OUT_OF_MEMORY"):
            return fields["JobState"], fields.get("ExitCode", "")
        time.sleep(0.5)
    pytest.fail(f"Slurm job {job_id} did not end in {timeout_s:.0f}s")


@pytest.mark.parametrize("relays", [0, 1], ids=["direct", "through-a-relay"])
def test_the_batch_script_trains_through_a_killed_worker(slurm: dict[str, str],
                                                          tmp_path: Path, relays: int) -> None:
    """Second run, why: `RECOVER_RELAYS=1` puts a rack relay (its own Slurm step, on the
    first node, with its certificate from the job's throwaway CA) between both nodes'
    agents and the controller; the same job and checks must hold through it."""
    out = tmp_path / "out"
    env = dict(slurm, RECOVER_BIN=f"{sys.executable} -m recover.cli.main",
               RECOVER_HOST="127.0.0.1", RECOVER_OUT=str(out), RECOVER_TLS="1",
               RECOVER_SLOTS="2", RECOVER_AGENT_FLAGS="--max-restarts 1",
               RECOVER_RELAYS=str(relays), RECOVER_RELAY_HOST="127.0.0.1")
    submitted = subprocess.run(
        ["sbatch", "--parsable", "--nodes", "2",
         str(REPO / "deploy" / "slurm" / "recover.sbatch"),
         # Long enough after the kill (step 4) for the restarted slot's request to be
         # answered before the end: it asks after a 0.5 s backoff (at --compute-ms 20 and 12
         # steps the job once ended first on a fast machine, and the answer never came).
         "--replicas", "3", "--steps", "16", "-M", "6", "-B", "2", "--compute-ms", "80",
         "--kill", "step=4,replica=1,phase=backward"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert submitted.returncode == 0, submitted.stderr
    # Polled here rather than with `sbatch --wait`, whose own polls back off to 10 s apart
    # (the test took 10 s or 42 s for the same job).
    state, exit_code = job_end(env, submitted.stdout.strip().split(";")[0], timeout_s=400)
    batch_output = "\n".join(p.read_text() for p in tmp_path.glob("recover-*.out"))
    assert (state, exit_code) == ("COMPLETED", "0:0"), batch_output
    assert "the job ended succeeded" in batch_output, batch_output
    summary = json.loads((out / "summary.json").read_text())
    assert summary["state"] == "succeeded"
    assert summary["steps_committed"] == 16
    assert summary["microbatches_per_step"] == [6] * 16  # every step kept all M microbatches
    assert [f["phase"] for f in summary["failures"]] == ["backward"]
    assert len(summary["live_replicas"]) == 3  # the waiting slot's replica joined
    logs = out / "logs"
    assert {p.name for p in logs.glob("warm-*.log")} == {"warm-n1.log", "warm-n2.log"}
    agents = (logs / "agents.log").read_text()
    assert "restart 1 of 1" in agents, agents[-2000:]  # the killed worker's slot asked again
    assert "wait for room in the job" in agents and "waits: job has its 3 replicas" in agents
    controller = (logs / "controller.log").read_text()
    assert controller.count("slot-filled") == 1, controller[-3000:]
    assert (out / "tls" / "ca.pem").exists() and not (out / "tls" / "ca-key.pem").exists()
    if relays:
        assert "relay-connected: relay rack0" in controller, controller[-3000:]
        assert (out / "tls" / "rack0.pem").exists()
        # Both nodes' agents hold their session with it (not with the controller's port).
        relay_port = (out / "rack0.port").read_text().strip()
        assert agents.count(f"session with the leader at 127.0.0.1:{relay_port} ") == 2, \
            agents[-3000:]
