"""In-step recovery end to end: real controller, agents, workers and SIGKILLs."""

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

from recover.proto import pb, rpc
from tests.integration.conftest import (
    BASE_ARGS,
    assert_same_training,
    recover_cmd,
    run_recover,
    wait_for,
)

pytestmark = pytest.mark.slow


def test_failure_free_run(reference: dict[str, Any]) -> None:
    assert reference["state"] == "succeeded"
    assert reference["failures"] == [] and reference["recovery_phases_s"] == []
    assert reference["steps_committed"] == 6
    assert reference["microbatches_per_step"] == [12] * 6
    assert len(set(reference["sample_digest_per_step"])) == 6  # every step reads new samples
    assert reference["loss_per_step"][-1] < reference["loss_per_step"][0]
    assert reference["tokens"] == 6 * 12 * 4 * 32
    for by_replica in reference["param_sha256_by_replica_per_step"]:
        assert sorted(by_replica) == ["0", "1", "2", "3"]
        assert len(set(by_replica.values())) == 1


# In-step recovery alone: a restarted worker rejoins (test_rejoin.py) only when the machine
# is slow enough for it to be ready before the last step, so who is live at the end would
# depend on timing.
NO_RESTARTS = ("--max-restarts", "0")


PHASE_KILLS = [(1, 1, "forward"), (2, 2, "backward"), (3, 3, "reduce"), (4, 4, "commit")]


def test_a_kill_in_each_phase_of_a_step(tmp_path: Path, reference: dict[str, Any]) -> None:
    """One job, one kill in each phase of a step, at steps of their own (5 replicas: replica
    0 survives them all). Each recovery is checked as if it were the only one; the bitwise
    guarantee under the same kills is tests/integration/test_exact.py's, and the executor's
    handling of each phase is unit-tested on a fake group (tests/unit/test_executor_fake.py).
    Its gradient is reduced in pieces of 64 KB, started during each step's last backward
    (trainer/overlap.py; a model this small has none at the default 25 MB): so the real
    gloo group starts collectives on the reducing thread while a peer dies in each phase,
    and the controller's abort cuts those in flight."""
    kills = [a for step, replica, phase in PHASE_KILLS
             for a in ("--kill", f"step={step},replica={replica},phase={phase}")]
    assert BASE_ARGS[:2] == ["--replicas", "4"]
    result = run_recover(tmp_path, "--replicas", "5", *BASE_ARGS[2:], *NO_RESTARTS, *kills,
                         "--overlap-piece-kb", "64", plot=True, agents=2)
    assert result.returncode == 0, result.stderr
    summary = result.summary
    assert summary["workload"]["reduce_pieces"] > 1
    # The run against wall time, drawn at the end (cli/timeline.py's figure is unit-tested).
    assert (tmp_path / "plot.png").read_bytes()[:4] == b"\x89PNG"
    assert f"plot: {tmp_path / 'plot.png'}" in result.stdout
    assert_same_training(summary, reference)
    failures = sorted(summary["failures"], key=lambda f: f["step"])
    assert [(f["step"], f["replica"], f["phase"]) for f in failures] == PHASE_KILLS
    for failure in failures:
        assert failure["recovered_s"] is not None and failure["recovered_s"] < 5, failure
    # The controller's own split of each recovery; an injected kill is timed from the kill.
    timings = summary["recovery_phases_s"]
    assert len(timings) == len(PHASE_KILLS)
    for timing in timings:
        assert sorted(timing) == ["commit", "detect", "plan", "rebuild", "recompute"]
        assert all(0 <= seconds < 5 for seconds in timing.values()), timing
        assert timing["detect"] > 0 and timing["rebuild"] > 0 and timing["commit"] > 0, timing
    assert summary["live_replicas"] == [0]
    # One generation per loss: after the last, replica 0 alone carries all M microbatches.
    assert summary["generation_per_step"][-1] == 1 + len(PHASE_KILLS)
    # OUT/events.jsonl: every event of the job, the end included (recover bench recovery
    # splits recoveries with it; polled events alone lost a short job's last ones).
    events = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert [e["seq"] for e in events] == list(range(1, len(events) + 1))
    assert events[-1]["kind"] == "succeeded"
    assert [e["generation"] for e in events if e["kind"] == "generation"] == \
        list(range(1, 2 + len(PHASE_KILLS)))


def test_two_lost_at_once_and_failures_during_recovery(tmp_path: Path,
                                                       reference: dict[str, Any]) -> None:
    """One job (7 replicas): two replicas lost in one step; a second loss while the
    survivors rebuild the group; another while a survivor recomputes a lost microbatch.
    Replica 6 is slowed 3x: the plans follow measured speeds, and replica 5 must get one of
    replica 4's microbatches at step 5 for its kill there to fire (measured slower than 6
    under a busy machine's noise, it once got none and lived)."""
    result = run_recover(tmp_path, "--replicas", "7", *BASE_ARGS[2:], *NO_RESTARTS,
                         "--slowdown", "replica=6,factor=3",
                         "--kill", "step=1,replica=1,phase=backward",
                         "--kill", "step=1,replica=2,phase=forward",
                         "--kill", "step=3,replica=0,phase=backward",
                         "--kill", "step=3,replica=3,phase=rebuild",
                         "--kill", "step=5,replica=4,phase=backward",
                         "--kill", "step=5,replica=5,phase=recompute", timeout=180, agents=2)
    assert result.returncode == 0, result.stderr
    summary = result.summary
    assert_same_training(summary, reference)
    phases = {f["replica"]: (f["step"], f["phase"]) for f in summary["failures"]}
    assert phases == {1: (1, "backward"), 2: (1, "forward"), 0: (3, "backward"),
                      3: (3, "rebuild"), 4: (5, "backward"), 5: (5, "recompute")}
    assert summary["live_replicas"] == [6]


def test_external_kill_minus_nine(tmp_path: Path, reference: dict[str, Any]) -> None:
    """A worker killed from outside, with no cooperation, recovers like an injected one."""
    # More steps than the reference so there is time to aim; compare the common prefix.
    args = [a if a != "6" else "40" for a in BASE_ARGS]
    proc = subprocess.Popen(recover_cmd("run", *args, "--agents", "1", "--out", str(tmp_path)),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        port_file = tmp_path / "controller.port"
        port = int(wait_for(lambda: port_file.exists() and port_file.read_text(), 60, "port"))
        channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        stub = rpc.ControlStub(channel)

        def step_at_least_two() -> bool:
            try:
                return stub.Status(pb.StatusRequest(), timeout=2).steps_committed >= 2
            except grpc.RpcError:
                return False

        wait_for(step_at_least_two, 90, "training to reach step 2")
        events = stub.Events(pb.EventsRequest(), timeout=2).events
        pids = {e.replica: int(e.message.split()[1].rstrip(",")) for e in events
                if e.kind == "replica-ready"}
        os.kill(pids[2], signal.SIGKILL)
        channel.close()
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, stderr
    summary = json.loads((tmp_path / "summary.json").read_text())
    [failure] = summary["failures"]
    assert failure["replica"] == 2 and failure["cause"] == "external"
    assert failure["recovered_s"] is not None
    assert summary["steps_committed"] == 40
    assert summary["microbatches_per_step"] == [12] * 40
    assert summary["sample_digest_per_step"][:6] == reference["sample_digest_per_step"]
    for by_replica in summary["param_sha256_by_replica_per_step"]:
        assert len(set(by_replica.values())) == 1


def test_losing_every_replica_fails_cleanly(tmp_path: Path) -> None:
    started = time.monotonic()
    result = run_recover(tmp_path, "--replicas", "2", "--steps", "6", "-M", "4", "--quiet",
                         "--kill", "step=2,replica=0,phase=forward",
                         "--kill", "step=2,replica=1,phase=backward", timeout=90)
    assert result.returncode == 1
    assert "all replicas lost" in result.stderr
    assert "Traceback" not in result.stderr
    assert result.summary["state"] == "failed"
    assert result.summary["steps_committed"] == 2
    assert time.monotonic() - started < 60


def test_bad_input_is_one_line(tmp_path: Path) -> None:
    proc = subprocess.run(recover_cmd("run", "--replicas", "4", "-M", "2", "--out", str(tmp_path)),
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr
    assert "--global-microbatches" in proc.stderr
