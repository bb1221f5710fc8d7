"""Helpers for end-to-end tests: run `recover run` as a real subprocess."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import pytest

from recover.cli.verify import compare
from recover.proto import pb, rpc

REPO = Path(__file__).resolve().parents[2]

# Small enough for 2 cores, big enough that every replica holds several microbatches.
BASE_ARGS = ["--replicas", "4", "--steps", "6", "-M", "12", "-B", "4", "--seed", "7", "--quiet"]


@dataclass
class RunResult:
    returncode: int
    stdout: str
    stderr: str
    out: Path

    @property
    def summary(self) -> dict[str, Any]:
        return json.loads((self.out / "summary.json").read_text())


def recover_cmd(*args: str, plot: bool = False) -> list[str]:
    """`recover ARGS`; a `recover run` without its closing plot.png unless `plot` (drawing
    it costs about a second of CPU per run: minutes over the suite, for a picture nobody
    looks at; the tests that check it ask for it)."""
    extra = ["--no-plot"] if args[:1] == ("run",) and not plot else []
    return [sys.executable, "-m", "recover.cli.main", *args[:1], *extra, *args[1:]]


def run_recover(out: Path, *args: str, timeout: float = 120,
                env: dict[str, str] | None = None, plot: bool = False,
                agents: int = 1) -> RunResult:
    """`recover run --out OUT ARGS` to its end. On `agents` emulated hosts unless ARGS say
    `--agents`: one, unless a test is about several (the bitwise guards of test_exact.py
    and test_recovery.py run on two), because each agent's warm interpreter imports torch
    (~2.6 s of CPU): on the 4-replica reference job one agent instead of two took 9.1 instead
    of 12.7 s of CPU and 5.9 instead of 7.2 s, over a suite of ~200 jobs minutes."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", **(env or {}))
    hosts = [] if "--agents" in args else ["--agents", str(agents)]
    proc = subprocess.run(recover_cmd("run", "--out", str(out), *hosts, *args, plot=plot),
                          capture_output=True,
                          text=True, timeout=timeout, env=env)
    return RunResult(proc.returncode, proc.stdout, proc.stderr, out)


def without_emulated_compute(args: list[str]) -> list[str]:
    """The same job without `--compute-ms`: for a failure-free reference, whose result the
    emulated compute does not change, only its duration."""
    if "--compute-ms" not in args:
        return list(args)
    at = args.index("--compute-ms")
    return [*args[:at], *args[at + 2:]]


@pytest.fixture(scope="session")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The failure-free run every recovery test is compared with."""
    result = run_recover(tmp_path_factory.mktemp("reference"), *BASE_ARGS)
    assert result.returncode == 0, result.stderr
    return result.summary


def assert_same_training(summary: dict[str, Any], reference: dict[str, Any]) -> None:
    """The invariant: same steps, same M, same samples, same loss (fast reduction)."""
    assert summary["state"] == "succeeded", summary["reason"]
    steps = reference["steps_committed"]
    assert summary["steps_committed"] == steps
    assert summary["microbatches_per_step"] == [summary["global_microbatches"]] * steps
    assert summary["sample_digest_per_step"] == reference["sample_digest_per_step"]
    for got, want in zip(summary["loss_per_step"], reference["loss_per_step"], strict=True):
        assert abs(got - want) <= 1e-4 * abs(want), (got, want)
    # No survivor applied a step another live replica did not: after every
    # step, every replica that reported holds the same parameters.
    for step, by_replica in enumerate(summary["param_sha256_by_replica_per_step"]):
        assert len(set(by_replica.values())) == 1, f"replicas diverged after step {step}"
    assert all(summary["param_sha256_per_step"])


def assert_bitwise_identical(summary: dict[str, Any], reference: dict[str, Any]) -> None:
    """Exact mode's guarantee: same ledger, same loss, same parameters after every step."""
    verdict = compare(reference, summary)
    assert verdict.identical, verdict.message
    assert summary["param_sha256"] == reference["param_sha256"]
    # Every live replica agreed after every step (no split-brain apply).
    for by_replica in summary["param_sha256_by_replica_per_step"]:
        assert len(set(by_replica.values())) == 1


def alive(pid: int) -> bool:
    """Whether process `pid` exists (a zombie counts: not yet reaped by its parent)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def wait_for(predicate: Callable[[], Any], timeout_s: float, what: str) -> Any:
    """Poll `predicate` until it returns something true (returned), or fail saying what."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")


@dataclass
class Processes:
    """`recover` parts started by hand, each logging to LOGS/NAME.log; `stop()` kills what is
    left (use it in a finally)."""

    logs: Path
    started: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def start(self, name: str, *args: str) -> subprocess.Popen[bytes]:
        self.logs.mkdir(parents=True, exist_ok=True)
        with open(self.logs / f"{name}.log", "wb") as log:  # the child keeps its own descriptor
            process = subprocess.Popen(recover_cmd(*args), stdout=log, stderr=subprocess.STDOUT,
                                       start_new_session=True)
        self.started.append(process)
        return process

    def stop(self) -> None:
        for process in self.started:
            if process.poll() is None:
                process.kill()
                process.wait()


def control_status(address: str) -> pb.JobStatus | None:
    """The controller's Status, asked in this process (None while it does not answer yet): a
    poll loop of `recover status` processes would take the CPU the job under test needs."""
    try:
        with grpc.insecure_channel(address) as channel:
            return rpc.ControlStub(channel).Status(pb.StatusRequest(), timeout=2)
    except grpc.RpcError:
        return None


def control_events(address: str) -> list[pb.Event]:
    """The controller's events, asked in this process."""
    with grpc.insecure_channel(address) as channel:
        return list(rpc.ControlStub(channel).Events(pb.EventsRequest(), timeout=5).events)
