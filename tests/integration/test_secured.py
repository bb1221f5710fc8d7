"""A secured control plane, end to end (issue 14): real controllers serving mutual TLS and
tokens, refused credentials with clear messages on both sides, roles per RPC, and an
operator draining a host and stopping a job that then resumes bitwise."""

from __future__ import annotations

import datetime
import subprocess
from pathlib import Path

import grpc
import pytest

from recover.cli.certs import init_ca, issue
from recover.common.security import Role, Security
from recover.common.security import channel as secure_channel
from recover.proto import pb, rpc
from tests.etcd_cluster import free_port
from tests.integration.conftest import (
    Processes,
    assert_bitwise_identical,
    recover_cmd,
    run_recover,
    wait_for,
)

pytestmark = [pytest.mark.timeout(240)]


def recover(*args: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    return subprocess.run(recover_cmd(*args), capture_output=True, text=True, timeout=timeout)


def creds(ca: Path, name: str) -> list[str]:
    return ["--tls-ca", str(ca / "ca.pem"), "--tls-cert", str(ca / f"{name}.pem"),
            "--tls-key", str(ca / f"{name}-key.pem")]


def test_credentials_are_checked_with_clear_messages_on_both_sides(tmp_path: Path) -> None:
    ca, other = tmp_path / "ca", tmp_path / "other"
    assert recover("certs", "init", str(ca)).returncode == 0
    for name, role in (("controller", "controller"), ("alice", "operator"), ("bob", "reader")):
        made = recover("certs", "issue", str(ca), name, "--role", role)
        assert made.returncode == 0, made.stderr
    init_ca(other, "someone else's CA", 1)
    issue(other, "mallory", [Role.OPERATOR], [], 1)
    past = datetime.datetime.now(datetime.UTC) - datetime.timedelta(days=3)
    issue(ca, "expired", [Role.OPERATOR], [], 1, not_before=past,
          not_after=past + datetime.timedelta(days=1))
    tokens, alice_token, bob_token, wrong = (tmp_path / n for n in (
        "tokens", "alice-token", "bob-token", "wrong-token"))
    tokens.write_text("tok-alice operator alice\ntok-bob reader bob\n")  # the controller's
    alice_token.write_text("tok-alice\n")
    bob_token.write_text("tok-bob\n")
    wrong.write_text("tok-guess\n")

    port = free_port()
    address = f"127.0.0.1:{port}"
    processes = Processes(tmp_path / "logs")
    try:
        processes.start("controller", "controller", "--port", str(port), "--replicas", "1",
                        "--steps", "5", *creds(ca, "controller"), "--token-file", str(tokens))
        ok = ["--controller", address, "--timeout", "20"]

        def status(*extra: str) -> subprocess.CompletedProcess[str]:
            return recover("status", *ok, *extra)

        bob = [*creds(ca, "bob"), "--token-file", str(bob_token)]
        wait_for(lambda: status(*bob).returncode == 0 or None, 60, "the controller")
        assert "state       waiting" in status(*bob).stdout
        # Each credential limits: bob's reader certificate with alice's operator token holds
        # the roles both grant (none).
        mixed = status(*creds(ca, "bob"), "--token-file", str(alice_token))
        assert mixed.returncode == 1 and "bob (no role) may not call Status" in mixed.stderr
        plaintext = status("--timeout", "3")
        assert plaintext.returncode == 1 and "does it serve TLS?" in plaintext.stderr
        foreign = status("--tls-ca", str(other / "ca.pem"), "--timeout", "3")
        assert foreign.returncode == 1 and "TLS handshake failed" in foreign.stderr
        no_cert = status("--tls-ca", str(ca / "ca.pem"), "--timeout", "3")
        assert no_cert.returncode == 1 and "client certificate" in no_cert.stderr
        expired = status(*creds(ca, "expired"))
        assert expired.returncode == 2 and "expired on" in expired.stderr  # checked first
        no_token = status(*creds(ca, "bob"))
        assert no_token.returncode == 1 and "UNAUTHENTICATED" in no_token.stderr
        assert "no bearer token" in no_token.stderr
        guessed = status(*creds(ca, "bob"), "--token-file", str(wrong))
        assert "not one this controller accepts" in guessed.stderr
        # The controller refuses an expired certificate itself too (not only our own check).
        expired_security = Security(cert=str(ca / "expired.pem"), key=str(ca / "expired-key.pem"),
                                    ca=str(ca / "ca.pem"), token_file=str(alice_token))
        with secure_channel(address, expired_security) as channel, \
                pytest.raises(grpc.RpcError) as refused:
            rpc.ControlStub(channel).Status(pb.StatusRequest(), timeout=5)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        # Roles: a reader may not stop the job; an operator may.
        stop = recover("stop", *ok, *bob)
        assert stop.returncode == 1 and "bob (reader) may not call Stop" in stop.stderr
        alice = [*creds(ca, "alice"), "--token-file", str(alice_token)]
        # Bytes that are not a protobuf message: INVALID_ARGUMENT, no internal text.
        alice_security = Security(cert=str(ca / "alice.pem"), key=str(ca / "alice-key.pem"),
                                  ca=str(ca / "ca.pem"), token_file=str(alice_token))
        with secure_channel(address, alice_security) as channel:
            raw = channel.unary_unary("/recover.v1.Control/Drain")
            with pytest.raises(grpc.RpcError) as garbage:
                raw(b"\xff\xff\xff\xff", timeout=5)
        assert garbage.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert garbage.value.details() == "Drain: the request is not a valid DrainRequest message"
        stopped = recover("stop", *ok, *alice, "--reason", "maintenance window")
        assert stopped.returncode == 0, stopped.stderr
        assert "had not started: it stops now" in stopped.stdout
        assert "state       stopped (stopped by alice: maintenance window)" in status(*bob).stdout
    finally:
        processes.stop()
    log = (tmp_path / "logs" / "controller.log").read_text()
    # The controller's side: gRPC names each failed handshake, ReCoVer each refused call.
    assert "WRONG_VERSION_NUMBER" in log and "PEER_DID_NOT_RETURN_A_CERTIFICATE" in log
    assert "rejected: unauthenticated: Status: no bearer token" in log
    assert "rejected: forbidden: bob (reader) may not call Stop" in log
    assert "rejected: malformed: Drain: the request is not a valid DrainRequest" in log


ARGS = ["--replicas", "3", "--steps", "40", "-M", "6", "-B", "4", "--seed", "11", "--quiet",
        "--reduce", "exact", "--compute-ms", "20"]


@pytest.mark.slow
def test_an_operator_drains_a_host_then_stops_the_job_which_resumes_bitwise(
        tmp_path: Path) -> None:
    """Under mutual TLS (`recover run --tls`): strangers and impostors refused, a host drained
    without a failure, the job stopped at a step boundary with a checkpoint, then resumed:
    every step equals the uninterrupted run's."""
    reference = run_recover(tmp_path / "reference", *ARGS, timeout=150)
    assert reference.returncode == 0, reference.stderr
    out, checkpoints = tmp_path / "secured", tmp_path / "checkpoints"
    proc = subprocess.Popen(recover_cmd("run", "--tls", "--out", str(out), "--agents", "3",
                                        "--checkpoint-dir", str(checkpoints),
                                        "--checkpoint-every", "1000", *ARGS),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    tls = out / "tls"
    try:
        port = wait_for(lambda: (out / "controller.port").exists()
                        and (out / "controller.port").read_text(), 60, "the controller")
        address = f"127.0.0.1:{port}"
        operator = Security(cert=str(tls / "launcher.pem"), key=str(tls / "launcher-key.pem"),
                            ca=str(tls / "ca.pem"))
        with secure_channel(address, operator) as channel:
            control = rpc.ControlStub(channel)

            def status() -> pb.JobStatus | None:
                try:
                    return control.Status(pb.StatusRequest(), timeout=2)
                except grpc.RpcError:
                    return None

            wait_for(lambda: (s := status()) is not None and s.steps_committed >= 3, 90, "step 3")
            with grpc.insecure_channel(address) as stranger, pytest.raises(grpc.RpcError) as no:
                rpc.ControlStub(stranger).Status(pb.StatusRequest(), timeout=2)
            assert no.value.code() == grpc.StatusCode.UNAVAILABLE
            # host1's certificate cannot take host0's session, nor can a reader open one.
            host1 = Security(cert=str(tls / "host1.pem"), key=str(tls / "host1-key.pem"),
                             ca=str(tls / "ca.pem"))
            for who, agent_id, code in ((host1, "host0", grpc.StatusCode.PERMISSION_DENIED),
                                        (operator, "rogue", grpc.StatusCode.PERMISSION_DENIED)):
                with secure_channel(address, who) as channel2, \
                        pytest.raises(grpc.RpcError) as refused:
                    next(rpc.AgentSessionStub(channel2).Session(iter([pb.AgentMessage(
                        register=pb.RegisterAgent(agent_id=agent_id, host="evil", slots=1))])))
                assert refused.value.code() == code, refused.value.details()
            drained = recover("drain", "host1", "--controller", address, "--reason", "kernel",
                              *creds(tls, "launcher"))
            assert drained.returncode == 0 and "leaves at the next step boundary" in drained.stdout
            wait_for(lambda: (s := status()) is not None and len(s.live_replicas) == 2
                     and s.steps_committed >= 12, 60, "the drain and step 12")
            stop = control.Stop(pb.StopRequest(reason="end of the window"), timeout=10)
            assert stop.accepted, stop.reason
        _, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 3, stderr  # stopped by an operator
    assert "stopped by launcher: end of the window" in stderr
    written = sorted(checkpoints.glob("ckpt-*.rcv"))
    assert written, "the stop wrote no checkpoint"
    log = (out / "logs" / "controller.log").read_text()
    assert "drained: agent host1 left the job" in log and "replica-failed" not in log
    assert "rejected: impostor" in log and "rejected: forbidden" in log
    resumed = run_recover(tmp_path / "resumed", "--resume", str(checkpoints), "--tls", *ARGS,
                          timeout=150)
    assert resumed.returncode == 0, resumed.stderr
    assert_bitwise_identical(resumed.summary, reference.summary)
