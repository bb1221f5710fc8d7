"""An attacker on the network, scripted against real running jobs (security off, loopback):
impersonation and forged reports are refused by session, the rendezvous store keeps its
keys and bounds a stranger's writes, and a job does not outlive its launcher. The job's
result stays bitwise its own."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import grpc
import pytest

from recover.controller.rendezvous import MAX_MB
from recover.proto import pb, rpc
from tests.integration.conftest import (
    alive,
    assert_bitwise_identical,
    control_status,
    recover_cmd,
    run_recover,
    wait_for,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

ARGS = ["--replicas", "3", "--steps", "40", "-M", "6", "-B", "4", "--seed", "5", "--quiet",
        "--reduce", "exact", "--compute-ms", "20", "--max-restarts", "0",
        "--kill", "step=1,replica=2,phase=forward"]  # leaves room for a rogue agent


class Rogue:
    """A hand-written agent session: whatever the test puts in, out it goes."""

    def __init__(self, address: str, first: pb.AgentMessage) -> None:
        self.outgoing: queue.SimpleQueue[pb.AgentMessage | None] = queue.SimpleQueue()
        self.outgoing.put(first)
        self.channel = grpc.insecure_channel(address)
        self.replies = rpc.AgentSessionStub(self.channel).Session(self._requests())

    def _requests(self) -> Iterator[pb.AgentMessage]:
        while (message := self.outgoing.get()) is not None:
            yield message

    def first_reply(self) -> pb.ControllerMessage:
        return next(self.replies)

    def close(self) -> None:
        self.outgoing.put(None)
        self.channel.close()


def job_processes(marker: str) -> list[str]:
    out = subprocess.run(["pgrep", "-af", marker], capture_output=True, text=True).stdout
    return [line for line in out.splitlines() if "pgrep" not in line]


def test_impostors_forged_reports_and_strangers_change_nothing(tmp_path: Path) -> None:
    # Real processes: the attacks go over the network against a real running job's controller.
    reference = run_recover(tmp_path / "reference", *ARGS, timeout=120)
    assert reference.returncode == 0, reference.stderr
    out = tmp_path / "attacked"
    proc = subprocess.Popen(recover_cmd("run", "--out", str(out), *ARGS),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        port = wait_for(lambda: (out / "controller.port").exists()
                        and (out / "controller.port").read_text(), 60, "the controller")
        address = f"127.0.0.1:{port}"
        # 0. A stranger floods the rendezvous store while the workers start (and may be
        # building the first group on it): refused within the bound of the store's own
        # process, which is reset; the job goes on, bitwise (checked at the end).
        from torch.distributed import TCPStore

        store_address = wait_for(lambda: _logged_rendezvous(out), 30, "the rendezvous address")
        flood = TCPStore(*store_address, is_master=False, timeout=timedelta(seconds=30))
        written = 0
        with pytest.raises(RuntimeError):
            for _ in range(2 * MAX_MB):
                flood.set(f"flood/{written}", b"x" * (1 << 20))
                written += 1
        assert written <= MAX_MB + 16, written  # + what the socket buffers hold
        controller_log = out / "logs" / "controller.log"
        wait_for(lambda: "reset (" in controller_log.read_text(), 60, "the store's reset")
        wait_for(lambda: (s := control_status(address)) is not None and s.steps_committed >= 3
                 and len(s.live_replicas) == 2, 90, "step 3 on two replicas")
        # 1. Impersonation: a registration claiming a live agent's id.
        impostor = Rogue(address, pb.AgentMessage(register=pb.RegisterAgent(
            agent_id="host0", host="evil", slots=1)))
        with pytest.raises(grpc.RpcError) as refused:
            impostor.first_reply()
        assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert "has a live session" in refused.value.details()
        impostor.close()
        # 2. A rogue agent with a session of its own forges reports about other replicas.
        rogue = Rogue(address, pb.AgentMessage(register=pb.RegisterAgent(
            agent_id="rogue", host="evil", slots=1)))
        registered = rogue.first_reply().registered
        forged_step = control_status(address).steps_committed  # type: ignore[union-attr]
        for message in (
                pb.AgentMessage(worker_exited=pb.WorkerExited(replica=0, signal=9)),
                pb.AgentMessage(report=pb.WorkerReport(replica=1, reduced=pb.Reduced(
                    generation=2, step=forged_step, microbatch_ids=range(6), loss=999.0))),
                pb.AgentMessage(report=pb.WorkerReport(replica=0, applied=pb.Applied(
                    step=forged_step - 1, param_sha256="ff" * 32))),
                # Its own newcomer asks for the model at an address off its host (0.0.0.0 is
                # not where its session comes from; were it accepted, a donor would only
                # reach this machine): it gets no donor, and is dropped.
                pb.AgentMessage(report=pb.WorkerReport(replica=3, ready=pb.Ready(
                    pid=1, transfer_address="0.0.0.0:7")))):
            rogue.outgoing.put(message)
        # 3. A stranger at the rendezvous store: it does not listen beyond loopback, and the
        # group's keys are under a prefix the stranger cannot know.
        host, store_port = _rendezvous(out)
        sockets = subprocess.run(["ss", "-ltnH"], capture_output=True, text=True).stdout
        bound = [line.split()[3] for line in sockets.splitlines()
                 if line.split()[3].endswith(f":{store_port}")]
        assert bound == [f"127.0.0.1:{store_port}"], bound  # not 0.0.0.0 nor [::]
        stranger = TCPStore(host, store_port, is_master=False, timeout=timedelta(seconds=2))
        with pytest.raises(RuntimeError):
            stranger.get("gen/2/0")  # where an unprotected group would keep rank 0's address
        del stranger
        _, stderr = proc.communicate(timeout=120)
        rogue.close()
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, stderr
    summary = json.loads((out / "summary.json").read_text())
    assert_bitwise_identical(summary, reference.summary)
    lost = [f["replica"] for f in summary["failures"]]
    assert 2 in lost and 0 not in lost  # the forged exit of replica 0 changed nothing
    assert registered.replica_ids == [3]
    log = (out / "logs" / "controller.log").read_text()
    assert "rejected: impostor" in log and log.count("rejected: foreign-replica") == 3
    assert "rejected: foreign-address: transfer address '0.0.0.0:7' is not on the host" in log
    assert "join-started" not in log.split("foreign-address")[1]  # no donor was sent
    assert [f["cause"] for f in summary["failures"] if f["replica"] == 3] == ["refused"]


def _rendezvous(out: Path) -> tuple[str, int]:
    """The rendezvous address the controller logged at start."""
    address = _logged_rendezvous(out)
    if address is None:
        raise AssertionError("no rendezvous address in the controller log")
    return address


def _logged_rendezvous(out: Path) -> tuple[str, int] | None:
    log = out / "logs" / "controller.log"
    for line in (log.read_text() if log.exists() else "").splitlines():
        if "rendezvous " in line:
            address = line.split("rendezvous ", 1)[1].split(",", 1)[0]
            host, _, port = address.rpartition(":")
            return host, int(port)
    return None


@pytest.mark.timeout(300)
def test_no_process_of_the_job_outlives_its_launcher(tmp_path: Path) -> None:
    """One job per way to end a launcher (SIGKILL, SIGTERM, double SIGINT), the three
    started together so that their start-ups overlap; each ends on its own."""
    # Real processes: what is checked is that the OS processes of a job die with its launcher.
    hows = ("SIGKILL", "SIGTERM", "double SIGINT")
    outs = {how: tmp_path / how.replace(" ", "-") for how in hows}
    # --compute-ms: the jobs train (slowly) until their launcher goes, leaving the cores to
    # the start-ups of the others.
    # One agent each: three jobs start on 2 cores at once, and an agent more per job checks
    # nothing more here.
    procs = {how: subprocess.Popen(recover_cmd("run", "--out", str(outs[how]), "--replicas", "2",
                                               "--agents", "1", "--steps", "2000", "-M", "4",
                                               "--compute-ms", "50", "--quiet"),
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
             for how in hows}
    try:
        workers: dict[str, list[int]] = {}
        for how in hows:
            out = outs[how]
            port = wait_for(lambda out=out: (out / "controller.port").exists()
                            and (out / "controller.port").read_text(), 60, f"{how}: the controller")
            wait_for(lambda port=port: (s := control_status(f"127.0.0.1:{port}")) is not None
                     and s.steps_committed >= 2, 90, f"{how}: training")
            lines = job_processes(str(out))
            assert len(lines) >= 4, how  # launcher, controller, agent, zygote
            # the agent's warm interpreter and its 2 forked workers (they share its command line)
            assert sum("recover.agent.zygote" in line for line in lines) == 3, (how, lines)
            with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
                events = rpc.ControlStub(channel).Events(pb.EventsRequest(), timeout=2).events
            workers[how] = [e.pid for e in events if e.kind == "replica-ready"]
            assert len(workers[how]) == 2, how
        for how in hows:
            proc = procs[how]
            if how == "SIGKILL":
                proc.kill()
            elif how == "SIGTERM":
                proc.terminate()
            else:
                proc.send_signal(signal.SIGINT)
                time.sleep(0.1)
                proc.send_signal(signal.SIGINT)
            proc.wait(timeout=30)
            wait_for(lambda how=how: not job_processes(str(outs[how]))
                     and not any(map(alive, workers[how])), 5,
                     f"{how}: every process of the job to end")
    finally:
        for how in hows:
            for line in job_processes(str(outs[how])):
                os.kill(int(line.split()[0]), signal.SIGKILL)
            if procs[how].poll() is None:
                procs[how].kill()
                procs[how].wait()
