"""Controller failover on real etcd: kill -9, SIGTERM and SIGSTOP/SIGCONT of the leader.

Each run trains with --reduce exact and two controllers; the leader is hit
mid-training; the run must finish with the same samples and bitwise the same
parameters after every step as a failure-free run on the memory store.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import grpc
import pytest

from recover.cli.verify import compare
from tests.etcd_cluster import EtcdCluster
from tests.integration.conftest import recover_cmd, run_recover

pytestmark = [pytest.mark.slow, pytest.mark.timeout(150)]

ARGS = ["--replicas", "4", "--steps", "30", "-M", "8", "-B", "2", "--seed", "11", "--quiet",
        "--reduce", "exact", "--agents", "2"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    result = run_recover(tmp_path_factory.mktemp("failover-reference"), *ARGS)
    assert result.returncode == 0, result.stderr
    return result.summary


def status(port_file: Path) -> Any:
    from recover.proto import pb, rpc

    with grpc.insecure_channel(f"127.0.0.1:{port_file.read_text()}") as channel:
        return rpc.ControlStub(channel).Status(pb.StatusRequest(), timeout=2)


def controller_pid(out_dir: Path, name: str) -> int:
    out = subprocess.run(["pgrep", "-f", "--", f"--port-file {out_dir}/{name}.port "],
                         capture_output=True, text=True).stdout.split()
    assert len(out) == 1, out
    return int(out[0])


def run_with_leader_hit(tmp_path: Path, sig: int, at_step: int | None = 8,
                        extra: tuple[str, ...] = ()) -> tuple[dict[str, Any], float, Path]:
    """Start a 2-controller run, hit the leader with `sig` at step `at_step` (None: while
    the job is still starting); return the summary, the seconds from the hit until the
    standby led, and the logs folder."""
    cluster = EtcdCluster(tmp_path / "etcd", 1).start()
    out = tmp_path / "run"
    proc = subprocess.Popen(recover_cmd("run", *ARGS, "--store", cluster.url, "--controllers", "2",
                                        "--job-id", "failover", "--out", str(out), *extra),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    names = ("controller", "controller-1")
    follower: subprocess.Popen[str] | None = None
    try:
        deadline = time.monotonic() + 90
        leader = None
        while leader is None:
            if proc.poll() is not None:
                raise AssertionError(f"the run ended before the hit: {proc.communicate()[1]}")
            assert time.monotonic() < deadline, "training did not start"
            try:
                states = {n: status(out / f"{n}.port") for n in names}
                leader = next((n for n, s in states.items() if s.role == "leader" and (
                    s.state == "waiting" if at_step is None else s.steps_committed >= at_step)),
                               None)
            except (grpc.RpcError, FileNotFoundError, ValueError):
                pass
            time.sleep(0.05)
        standby = next(n for n in names if n != leader)
        # `recover events --follow` over both controllers, as an operator would watch an HA
        # job: it finds the new leader, and repeats and misses nothing (checked at the end).
        addresses = ",".join(f"127.0.0.1:{(out / f'{n}.port').read_text()}" for n in names)
        followed = out / "followed.jsonl"
        with open(followed, "w") as sink:
            follower = subprocess.Popen(recover_cmd("events", "--controller", addresses, "--json",
                                                    "--follow", "--timeout", "10"),
                                        stdout=sink, stderr=subprocess.DEVNULL, text=True)
        pid = controller_pid(out, leader)
        hit = time.monotonic()
        os.kill(pid, sig)
        while status(out / f"{standby}.port").role != "leader":
            assert time.monotonic() - hit < 15, "the standby never took over"
            time.sleep(0.02)
        takeover_s = time.monotonic() - hit
        if sig == signal.SIGSTOP:
            time.sleep(1.0)  # the old leader sleeps through its lease and the takeover
            os.kill(pid, signal.SIGCONT)
        _, stderr = proc.communicate(timeout=120)
        assert proc.returncode == 0, stderr
        # The launcher's OUT/events.jsonl across the change of leader: each event once, in
        # time order, the end included (cli/inspect.py EventCursor, unit-tested).
        events = [json.loads(line) for line in (out / "events.jsonl").read_text().splitlines()]
        assert events[-1]["kind"] == "succeeded"
        assert len({(e["seq"], e["at"]) for e in events}) == len(events)
        assert [e["at"] for e in events] == sorted(e["at"] for e in events)
        # What the follower printed, up to where it was stopped, is the same. (It polls every
        # 0.5 s, and the controllers exit with the job: how far it got is timing's, so only
        # what it printed is checked, whole lines, as far as they go.)
        follower.kill()
        follower.wait()
        lines = followed.read_text().split("\n")[:-1]
        assert [json.loads(line) for line in lines] == events[:len(lines)]
        return json.loads((out / "summary.json").read_text()), takeover_s, out / "logs"
    finally:
        if follower is not None and follower.poll() is None:
            follower.kill()
            follower.wait()
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)  # the launcher stops its controllers and agents
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
        cluster.stop()


def assert_exact(summary: dict[str, Any], reference: dict[str, Any]) -> None:
    verdict = compare(reference, summary)
    assert verdict.identical, verdict.message
    assert summary["param_sha256"] == reference["param_sha256"]
    assert summary["failures"] == []  # no worker restarted or lost
    assert max(summary["generation_per_step"]) >= 2  # the new leader made a generation


def test_kill9_leader_standby_takes_over_and_result_is_exact(
        tmp_path: Path, reference: dict[str, Any]) -> None:
    summary, takeover_s, logs = run_with_leader_hit(tmp_path, signal.SIGKILL)
    assert takeover_s < 3.5, takeover_s  # lease TTL 2 s + etcd's expiry tick
    assert_exact(summary, reference)
    agent_log = (logs / "agent-0.log").read_text()
    assert "spawned worker" in agent_log and agent_log.count("spawned worker") == 2  # not restarted


def test_sigterm_leader_hands_over_fast(tmp_path: Path, reference: dict[str, Any]) -> None:
    summary, takeover_s, _ = run_with_leader_hit(tmp_path, signal.SIGTERM)
    assert takeover_s < 1.0, takeover_s  # the lease is revoked: no TTL to wait for
    assert_exact(summary, reference)


def test_stopped_leader_wakes_up_deposed_and_changes_nothing(
        tmp_path: Path, reference: dict[str, Any]) -> None:
    summary, takeover_s, logs = run_with_leader_hit(tmp_path, signal.SIGSTOP)
    assert takeover_s < 3.5, takeover_s
    assert_exact(summary, reference)
    controller_logs = (logs / "controller.log").read_text() + (logs / "controller-1.log").read_text()
    # The woken leader noticed it lost the lease and stood down instead of acting.
    assert "standing down from term 1" in controller_logs


def test_leader_and_a_worker_killed_during_startup_the_job_still_completes(
        tmp_path: Path, reference: dict[str, Any]) -> None:
    """Startup is when clusters fail most: the leading controller SIGKILLed before the job
    starts fails over like mid-run, and a worker killed while starting is restarted."""
    summary, takeover_s, _ = run_with_leader_hit(
        tmp_path, signal.SIGKILL, at_step=None, extra=("--kill", "step=0,replica=1,phase=startup"))
    assert takeover_s < 3.5, takeover_s
    verdict = compare(reference, summary)
    assert verdict.identical, verdict.message
    assert [(f["replica"], f["phase"]) for f in summary["failures"]] == [(1, "startup")]
    assert len(summary["live_replicas"]) == 4  # the restarted worker is a member


def test_agents_behind_a_relay_follow_a_killed_leader_and_the_result_is_exact(
        tmp_path: Path, reference: dict[str, Any]) -> None:
    """Why one more job: behind a rack relay (`--relays 1`) the agents see no leader of their
    own; the relay must lose the killed one, find the standby that takes over, and carry the
    agents' rejoin (workers kept) to it, bitwise as without the relay."""
    summary, takeover_s, logs = run_with_leader_hit(tmp_path, signal.SIGKILL,
                                                    extra=("--relays", "1"))
    assert takeover_s < 3.5, takeover_s
    assert_exact(summary, reference)
    relay_log = (logs / "rack0.log").read_text()
    assert relay_log.count("relaying to the leader") == 2, relay_log  # the old one, the new one
    for agent in ("agent-0", "agent-1"):
        agent_log = (logs / f"{agent}.log").read_text()
        assert agent_log.count("spawned worker") == 2  # its workers kept: none restarted


def test_agents_of_a_killed_relay_come_back_through_another_and_nothing_is_lost(
        tmp_path: Path, reference: dict[str, Any]) -> None:
    """Why one more job: a rack relay SIGKILLed mid-run (`--relays 2`, each agent given both,
    its own first). Its agent's workers train on (their collectives do not pass through it);
    the agent comes back through the other relay before the agent timeout, and the leader,
    which had only detached it, takes it back (a new generation: the step is reported anew,
    whatever reports died in the relay): no failure, no restart, bitwise."""
    out = tmp_path / "run"
    proc = subprocess.Popen(recover_cmd("run", *ARGS, "--relays", "2", "--compute-ms", "30",
                                        "--job-id", "relay-death", "--out", str(out)),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 90
        while True:
            assert proc.poll() is None, proc.communicate()[1]
            assert time.monotonic() < deadline, "training did not start"
            try:
                if status(out / "controller.port").steps_committed >= 6:
                    break
            except (grpc.RpcError, FileNotFoundError, ValueError):
                pass
            time.sleep(0.05)
        relay = subprocess.run(["pgrep", "-f", "--", "--relay-id rack0"], capture_output=True,
                               text=True).stdout.split()
        assert len(relay) == 1, relay
        os.kill(int(relay[0]), signal.SIGKILL)
        _, stderr = proc.communicate(timeout=120)
        assert proc.returncode == 0, stderr
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            proc.wait(timeout=20)
    summary = json.loads((out / "summary.json").read_text())
    verdict = compare(reference, summary)
    assert verdict.identical, verdict.message
    assert summary["failures"] == []
    log = (out / "logs" / "controller.log").read_text()
    assert "relay-gone: relay rack0" in log and "agent-reattached: agent host0" in log, log[-3000:]
    agent_log = (out / "logs" / "agent-0.log").read_text()
    assert agent_log.count("spawned worker") == 2  # its two workers kept: none restarted
