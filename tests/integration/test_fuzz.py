"""A bounded gRPC fuzzer against a real running job (issue 14): random bytes and mutated
valid messages at every RPC of the controller, with an agent's credentials (so they pass
TLS and reach authorization and parsing). No crash, no internal error, no hang, bounded
memory, and the job's result bitwise its failure-free reference. The same job (mutual TLS)
has a hot spare, whose state transfer runs over TLS too (issue 22)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from recover.common.security import Security
from recover.common.security import channel as secure_channel
from recover.proto import pb, rpc
from tests.integration.conftest import (
    assert_bitwise_identical,
    recover_cmd,
    run_recover,
    wait_for,
    without_emulated_compute,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

# 150 steps of ~40 ms: the 300 fuzzed calls took 1.4 s here; the job must outlast them.
ARGS = ["--replicas", "2", "--steps", "150", "-M", "4", "-B", "2", "--seed", "3", "--quiet",
        "--reduce", "exact", "--compute-ms", "10"]
EXAMPLES = 300

VALID: dict[str, list[bytes]] = {
    "Status": [pb.StatusRequest().SerializeToString()],
    "Events": [pb.EventsRequest(after_seq=3).SerializeToString()],
    "Report": [pb.ReportRequest().SerializeToString()],
    "Stop": [pb.StopRequest(reason="fuzz").SerializeToString()],
    "Drain": [pb.DrainRequest(agent_id="host0").SerializeToString()],
    "SetSpares": [pb.SparesRequest(spares=3).SerializeToString()],
    "Session": [m.SerializeToString() for m in (
        pb.AgentMessage(register=pb.RegisterAgent(agent_id="host0", host="x", slots=1)),
        pb.AgentMessage(register=pb.RegisterAgent(agent_id="fuzz", host="x", slots=2,
                                                  resume=True, replica_ids=[0, 1])),
        pb.AgentMessage(report=pb.WorkerReport(replica=0, reduced=pb.Reduced(
            step=5, generation=1, microbatch_ids=[0, 1], loss=1.0))),
        pb.AgentMessage(worker_exited=pb.WorkerExited(replica=1, signal=9)),
        pb.AgentMessage(replica_request=pb.ReplicaRequest(slot=0)))],
}
ALLOWED = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.PERMISSION_DENIED,
           grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.FAILED_PRECONDITION}
"""What the controller may answer a fuzzed call (never UNKNOWN or INTERNAL: a crash)."""


def mutate(data: bytes, edits: list[tuple[int, int, int]]) -> bytes:
    """Flip, insert or delete bytes at positions (kind 0, 1, 2)."""
    out = bytearray(data)
    for kind, position, value in edits:
        at = position % (len(out) + 1)
        if kind == 0 and out:
            out[at % len(out)] ^= value or 1
        elif kind == 1:
            out.insert(at, value)
        elif out:
            del out[at % len(out)]
    return bytes(out)


payloads = st.one_of(
    st.binary(max_size=256),
    st.builds(mutate, st.sampled_from([v for vs in VALID.values() for v in vs]),
              st.lists(st.tuples(st.integers(0, 2), st.integers(0, 512), st.integers(0, 255)),
                       max_size=6)))


def controller_rss_kib(out: Path) -> int:
    found = subprocess.run(["pgrep", "-f", f"controller --port 0 --port-file {out}"],
                           capture_output=True, text=True).stdout.split()
    assert len(found) == 1, found
    status = Path(f"/proc/{found[0]}/status").read_text()
    return next(int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS"))


def test_fuzzed_calls_change_nothing(tmp_path: Path) -> None:
    reference = run_recover(tmp_path / "reference", *without_emulated_compute(ARGS), timeout=200)
    assert reference.returncode == 0, reference.stderr
    out = tmp_path / "fuzzed"
    proc = subprocess.Popen(recover_cmd("run", "--tls", "--spares", "1", "--out", str(out), *ARGS),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        port = wait_for(lambda: (out / "controller.port").exists()
                        and (out / "controller.port").read_text(), 60, "the controller")
        tls = out / "tls"
        agent = Security(cert=str(tls / "host1.pem"), key=str(tls / "host1-key.pem"),
                         ca=str(tls / "ca.pem"))
        channel = secure_channel(f"127.0.0.1:{port}", agent)
        control = rpc.ControlStub(channel)
        wait_for(lambda: control.Status(pb.StatusRequest(), timeout=5).steps_committed >= 3, 90,
                 "step 3")
        before = controller_rss_kib(out)
        answers: dict[str, set[grpc.StatusCode]] = {}

        @settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=True,
                  suppress_health_check=list(HealthCheck))
        @given(method=st.sampled_from(sorted(VALID)), payload=payloads,
               more=st.lists(payloads, max_size=2))
        def call(method: str, payload: bytes, more: list[bytes]) -> None:
            path = f"/recover.v1.{'AgentSession' if method == 'Session' else 'Control'}/{method}"
            try:
                if method == "Session":
                    replies = channel.stream_stream(path)(iter([payload, *more]), timeout=5)
                    for _ in replies:
                        pass
                else:
                    channel.unary_unary(path)(payload, timeout=5)
                code = grpc.StatusCode.OK
            except grpc.RpcError as exc:
                code = exc.code()  # type: ignore[attr-defined]
                assert code in ALLOWED, (method, payload, code, exc.details())  # type: ignore[attr-defined]
            answers.setdefault(method, set()).add(code)

        call()
        after = controller_rss_kib(out)
        status = control.Status(pb.StatusRequest(), timeout=5)
        assert status.state == "running", status  # the job went on under the fuzzer
        channel.close()
        _, stderr = proc.communicate(timeout=200)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, stderr
    assert set(answers) == set(VALID)  # every RPC was called
    assert grpc.StatusCode.INVALID_ARGUMENT in set().union(*answers.values())
    assert after - before < 64 * 1024, (before, after)  # KiB: no growth per call
    assert_bitwise_identical(json.loads((out / "summary.json").read_text()), reference.summary)
    # The spare's state came over TLS, pinned to the certificate it reported (a plaintext
    # or wrongly pinned transfer would have failed its join: trainer/transfer.py).
    log = (out / "logs" / "controller.log").read_text()
    assert "over TLS, state before step" in log and "over TCP" not in log, log[-3000:]
