"""Capacity comes back (issue 13): restarted workers, replacement hosts and hot spares join a
running job with live state transfer, and the trajectory stays bitwise the failure-free one.

Real processes, real SIGKILLs; capacity comes back in each run. Steps carry 30 ms of
emulated accelerator time so that a restarted worker (seconds to import torch) joins mid-run.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import uuid
from pathlib import Path
from typing import Any

import grpc
import pytest

from recover.cli.verify import compare
from recover.common import ckptfile
from recover.proto import pb, rpc
from tests.ckptforge import forge, payload_job
from tests.etcd_cluster import free_port
from tests.integration.conftest import (
    Processes,
    assert_bitwise_identical,
    recover_cmd,
    run_recover,
    wait_for,
    without_emulated_compute,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

ARGS = ["--replicas", "4", "--steps", "90", "-M", "12", "-B", "4", "--seed", "7", "--quiet",
        "--reduce", "exact", "--compute-ms", "30"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    result = run_recover(tmp_path_factory.mktemp("rejoin-reference"),
                         *without_emulated_compute(ARGS), timeout=180)
    assert result.returncode == 0, result.stderr
    return result.summary


class Job:
    """A controller to ask for status, events and worker pids."""

    def __init__(self, address: str) -> None:
        self.channel = grpc.insecure_channel(address)
        self.stub = rpc.ControlStub(self.channel)

    def status(self) -> pb.JobStatus | None:
        try:
            return self.stub.Status(pb.StatusRequest(), timeout=2)
        except grpc.RpcError:
            return None

    def at_step(self, step: int) -> bool:
        status = self.status()
        return status is not None and status.steps_committed >= step

    def events(self, kind: str) -> list[pb.Event]:
        return [e for e in self.stub.Events(pb.EventsRequest(), timeout=2).events if e.kind == kind]

    def pids(self) -> dict[int, int]:
        return {e.replica: e.pid for e in self.events("replica-ready")}


def proc_stats(pid: int) -> tuple[int, int]:
    """(resident KiB, open sockets) of a process."""
    rss = next(int(line.split()[1]) for line in Path(f"/proc/{pid}/status").read_text().splitlines()
               if line.startswith("VmRSS:"))
    sockets = sum(os.readlink(f"/proc/{pid}/fd/{fd}").startswith("socket:")
                  for fd in os.listdir(f"/proc/{pid}/fd"))
    return rss, sockets


def job_processes(marker: str) -> list[str]:
    out = subprocess.run(["pgrep", "-af", marker], capture_output=True, text=True).stdout
    return [line for line in out.splitlines() if "pgrep" not in line]


@pytest.mark.timeout(600)
def test_churn_brings_capacity_back_bitwise_without_leaks(tmp_path: Path,
                                                           reference: dict[str, Any]) -> None:
    """Workers lost and back all run long: one SIGKILLed from outside, the donor of a join
    dying mid-stream, a joiner dying right after its snapshot, another kill mid-run. The job
    runs until every replacement is in (however long each takes to import torch on this
    machine), then an operator stops it: full strength, and its first 90 steps are the
    failure-free run's."""
    out = tmp_path / "run"
    kills = ["step=0,replica=0,phase=donate",  # the first join's donor dies mid-stream
             "step=0,replica=5,phase=join",    # a later joiner dies after loading its snapshot
             "step=45,replica=3,phase=forward"]
    steps = reference["steps_committed"]
    at = ARGS.index("--steps") + 1
    args = [*ARGS[:at], "100000", *ARGS[at + 1:]]
    proc = subprocess.Popen(recover_cmd("run", "--out", str(out), "--agents", "1", *args,
                                        *[p for k in kills for p in ("--kill", k)]),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        port = wait_for(lambda: (out / "controller.port").exists()
                        and (out / "controller.port").read_text(), 60, "the controller")
        job = Job(f"127.0.0.1:{port}")
        wait_for(lambda: job.at_step(3), 90, "step 3")
        pids = job.pids()
        survivor = pids[2]
        before = proc_stats(survivor)
        os.kill(pids[1], signal.SIGKILL)  # from outside, no cooperation
        # Every lost worker's slot gets a fresh replica that joins (4, 5, 6, 7 for 1, 0, 3, 5
        # as a rule). Which ids depends on a race: should the dying donor (0) have reduced
        # the step in flight before its death is seen, that step commits, its joiner (4)
        # is admitted without that step's gradient and joins again (see the step-short test). So the
        # test waits for full strength after every fault, whoever the replacements are.
        def full_strength_after_every_fault() -> bool:
            status = job.status()
            return (status is not None and status.steps_committed >= steps
                    and len(status.load) == 4  # the plan's replicas: the members
                    and {0, 1, 3, 5} <= {e.replica for e in job.events("replica-failed")})

        wait_for(full_strength_after_every_fault, 450, "full strength after every fault")
        joined = {e.replica for e in job.events("replica-joined")}
        after = proc_stats(survivor)
        stopped = job.stub.Stop(pb.StopRequest(reason="churn test done"), timeout=10)
        assert stopped.accepted, stopped.reason
        _, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 3, stderr  # stopped by an operator
    summary = json.loads((out / "summary.json").read_text())
    committed = summary["steps_committed"]
    assert committed >= steps
    verdict = compare(reference, summary)  # the reference ends at `steps`
    assert verdict.identical or (verdict.first_difference is None and committed > steps), \
        verdict.message
    assert summary["param_sha256_per_step"][steps - 1] == reference["param_sha256"]
    # Every live replica agreed after every step, the one the stop ended on too.
    for step, by_replica in enumerate(summary["param_sha256_by_replica_per_step"]):
        assert len(set(by_replica.values())) == 1, (step, by_replica)
    assert summary["microbatches_per_step"] == [12] * committed
    failures = {(f["replica"], f["phase"], f["cause"]) for f in summary["failures"]}
    assert any(r == 1 and cause == "external" for r, _, cause in failures), failures
    assert {(0, "donate"), (5, "join"), (3, "forward")} <= {(r, p) for r, p, _ in failures}
    # Full strength again: the untouched survivor and replacements that joined the job.
    live = sorted(summary["live_replicas"])
    assert len(live) == 4 and 2 in live and set(live) - {2} <= joined, (live, joined)
    # The survivor donated, rebuilt its group many times: its memory and sockets did not grow.
    assert after[0] < before[0] * 1.25 + 20_000, (before, after)
    assert after[1] <= before[1] + 2, (before, after)
    assert not job_processes(str(out)), "a process of the job outlived it"


def test_a_hot_spare_takes_a_lost_replicas_place_within_a_step(
        tmp_path: Path, reference: dict[str, Any]) -> None:
    result = run_recover(tmp_path, *ARGS, "--spares", "1",
                         "--kill", "step=5,replica=1,phase=backward", timeout=180)
    assert result.returncode == 0, result.stderr
    summary = result.summary
    assert_bitwise_identical(summary, reference)
    generations, strength = summary["generation_per_step"], summary["replicas_per_step"]
    assert generations[4] == 1 and generations[5] == 2, generations[:10]
    if strength[5] == 4:
        # The spare had applied step 4 when the loss was known: it entered the recovery
        # generation of step 5 itself (computing the lost microbatches), no second rebuild.
        assert generations[6] == 2, generations[:10]
    else:
        # Step 4's gradient was still on its way to the spare (a matter of timing): it
        # entered at the next boundary instead.
        assert strength[5] == 3 and generations[6] == 3, (strength[:10], generations[:10])
    assert strength[6] == 4 and len(summary["live_replicas"]) == 4


def test_a_joiner_admitted_a_step_short_joins_again_instead_of_restarting(
        tmp_path: Path, reference: dict[str, Any]) -> None:
    """Replica 2's restart (4) is admitted at the commit of the step its donor (0) then dies
    before streaming: it cannot compute that step. It leaves the step (its microbatches go
    to the others) and joins again from another member, its process kept. A multi-process
    test because the path crosses all three layers: the worker must wait out the admission
    it cannot meet instead of raising, which only a real stream's break shows."""
    result = run_recover(tmp_path, *ARGS, "--kill", "step=3,replica=2,phase=forward",
                         "--kill", "step=0,replica=0,phase=feed", timeout=180)
    assert result.returncode == 0, result.stderr
    summary = result.summary
    assert_bitwise_identical(summary, reference)
    controller_log = (tmp_path / "logs" / "controller.log").read_text()
    assert "join-demoted: replica 4 was admitted" in controller_log, controller_log[-3000:]
    failures = {(f["replica"], f["phase"]) for f in summary["failures"]}
    assert failures == {(2, "forward"), (0, "feed")}, failures  # replica 4 was never stopped
    assert sorted(summary["live_replicas"]) == [1, 3, 4, 5]
    assert [j["replica"] for j in summary["joins"]].count(4) == 2  # admitted, then again


def test_a_replacement_host_started_by_hand_joins(tmp_path: Path,
                                                  reference: dict[str, Any]) -> None:
    port = free_port()
    address = f"127.0.0.1:{port}"
    logs = tmp_path / "logs"
    processes = Processes(logs)
    start = processes.start
    job_args = [a for a in ARGS if a != "--quiet"]
    try:
        start("controller", "controller", "--port", str(port), "--summary-out",
              str(tmp_path / "summary"), "--linger", "2", *job_args)
        start("agent-a", "agent", "--controller", address, "--slots", "2", "--agent-id", "a",
              "--log-dir", str(logs), "--connect-timeout", "30")
        lost = start("agent-b", "agent", "--controller", address, "--slots", "2",
                     "--agent-id", "b", "--log-dir", str(logs), "--connect-timeout", "30")
        job = Job(address)
        wait_for(lambda: job.at_step(3), 90, "step 3")
        lost.kill()  # the host is gone: its workers die with their agent
        wait_for(lambda: (s := job.status()) is not None and len(s.live_replicas) == 2, 30,
                 "the host's replicas lost")
        start("agent-c", "agent", "--controller", address, "--slots", "2", "--agent-id", "c",
              "--log-dir", str(logs))
        wait_for(lambda: (tmp_path / "summary" / "summary.json").exists(), 150, "the job's end")
        summary = json.loads((tmp_path / "summary" / "summary.json").read_text())
    finally:
        processes.stop()
    assert summary["state"] == "succeeded", summary["reason"]
    assert_bitwise_identical(summary, reference)
    # Agents a and b raced for ids 0-3; the new host's replicas got fresh ones.
    live = summary["live_replicas"]
    assert len(live) == 4 and {4, 5} <= set(live), live


def test_a_job_that_lost_everything_resumes_bitwise_from_its_checkpoint(
        tmp_path: Path, reference: dict[str, Any]) -> None:
    """Kill every process of the job mid-training, damage the newest checkpoint and plant
    two forged newer ones naming a payload command, resume: the newest authentic one is
    used, saying why the others were passed over, no payload runs, and every step equals
    the uninterrupted run's."""
    # Real processes: a payload would run as the workers agents spawn, from the file `--resume` picks.
    out, checkpoints = tmp_path / "run", tmp_path / "checkpoints"
    proc = subprocess.Popen(recover_cmd("run", "--out", str(out), "--agents", "1", *ARGS,
                                        "--checkpoint-dir", str(checkpoints),
                                        "--checkpoint-every", "10"),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: any(step >= 30 for step, _ in ckptfile.listed(checkpoints)), 150,
                 "a checkpoint of step 30")
    finally:
        for line in job_processes(str(out)):  # the whole job, as a lost cluster would be
            os.kill(int(line.split()[0]), signal.SIGKILL)
        proc.kill()
        proc.wait()
    (newest_step, newest), (_, authentic) = ckptfile.listed(checkpoints)[:2]
    assert newest_step < 90
    with open(newest, "r+b") as f:  # a torn copy
        f.truncate(newest.stat().st_size // 2)
    # The attack: a newer file naming a payload, its digests recomputed (plain
    # sha256, as the old format's), and one made by ReCoVer's own writer with another key.
    marker, elsewhere = Path(f"/tmp/pwned-{uuid.uuid4().hex}"), tmp_path / "attacker"
    planted = [forge(authentic, checkpoints / ckptfile.file_name(newest_step + extra),
                     lambda meta, s=newest_step + extra: (payload_job(meta, marker, elsewhere),
                                                          setattr(meta, "step", s)), **key)
               for extra, key in ((5, {}), (7, {"attacker_key": os.urandom(32)}))]
    resumed = run_recover(tmp_path / "resumed", "--resume", str(checkpoints), *ARGS,
                          timeout=180)
    assert resumed.returncode == 0, resumed.stderr
    assert f"passed over: {newest.name} is truncated" in resumed.stderr
    assert f"passed over: {planted[0].name} fails authentication" in resumed.stderr
    assert f"passed over: {planted[1].name} was not written with this folder's key" \
        in resumed.stderr
    assert f"the state before step {newest_step - 10} of 90" in resumed.stderr
    assert not marker.exists() and not elsewhere.exists()
    assert_bitwise_identical(resumed.summary, reference)  # no loss of 999 carried either
    assert resumed.summary["steps_committed"] == 90
    # The job's very last checkpoint is written and reported before the job ends, owner-only.
    last = resumed.summary["last_checkpoint"]
    assert last["step"] == 90 and Path(last["path"]).parent == checkpoints.resolve(), last
    assert (Path(last["path"]).stat().st_mode & 0o777, checkpoints.stat().st_mode & 0o777) \
        == (0o600, 0o700)
    assert "last checkpoint: the state before step 90" in resumed.stdout
