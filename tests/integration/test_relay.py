"""Agents behind a rack's relay (`recover relay`): the leader handles one stream for the rack,
and neither the job nor the agents can tell. Real processes: controller, relay, agents."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import grpc
import pytest

from recover.agent.link import LinkError, close_session, open_session
from recover.cli.certs import init_ca, issue
from recover.cli.inspect import format_status, to_json
from recover.common.security import Role, Security, aio_channel
from recover.proto import pb, rpc
from tests.etcd_cluster import free_port
from tests.integration.conftest import (
    BASE_ARGS,
    Processes,
    assert_same_training,
    control_events,
    wait_for,
)
from tests.integration.test_hosts import job_state

pytestmark = pytest.mark.slow


def _relay(processes: Processes, folder: Path, controller: str, name: str, *extra: str) -> str:
    port_file = folder / f"{name}.port"
    processes.start(name, "relay", "--controller", controller, "--listen", "127.0.0.1:0",
                    "--port-file", str(port_file), "--relay-id", name, *extra)
    port = wait_for(lambda: port_file.exists() and port_file.read_text().strip(), 30,
                    f"{name} to listen")
    return f"127.0.0.1:{port}"


def _controller(tmp_path: Path, job_id: str, replicas: int, *credentials: str
                ) -> tuple[Processes, str]:
    """A controller process for a job of `replicas` (one microbatch each), and its address."""
    port = free_port()
    processes = Processes(tmp_path / "logs")
    processes.start("controller", "controller", "--port", str(port), "--replicas", str(replicas),
                    "-M", str(replicas), "--steps", "5", "--job-id", job_id, *credentials)
    return processes, f"127.0.0.1:{port}"


def _tls_call(address: str, reader: tuple[Path, Path, Path], method: str, request: Any) -> Any:
    """A Control RPC over mutual TLS with `reader`'s certificate (cert, key, CA)."""
    cert, key, ca = (p.read_bytes() for p in reader)
    with grpc.secure_channel(address, grpc.ssl_channel_credentials(ca, key, cert)) as channel:
        return getattr(rpc.ControlStub(channel), method)(request, timeout=5)


def _events(address: str, kind: str, reader: tuple[Path, Path, Path] | None = None
            ) -> list[dict[str, Any]]:
    """The controller's events of one kind; over mutual TLS with `reader` (cert, key, CA)."""
    events = (control_events(address) if reader is None
              else _tls_call(address, reader, "Events", pb.EventsRequest()).events)
    return [json.loads(to_json(e)) for e in events if e.kind == kind]


def test_a_job_through_a_relay_trains_as_it_would_directly(tmp_path: Path,
                                                           reference: dict[str, Any]) -> None:
    """Why several processes: the relay carries every kind of message a real job sends
    between real agents and the leader (registration, readiness with the check of a
    newcomer's transfer address against its session's host, reduced reports with applied
    ones folded in, a worker's exit, the restarted worker's join and state transfer,
    commits and the end). One job checks them all against the failure-free reference."""
    port = free_port()
    address = f"127.0.0.1:{port}"
    processes = Processes(tmp_path / "logs")
    job = [a for a in BASE_ARGS if a != "--quiet"]
    try:
        processes.start("controller", "controller", "--port", str(port), *job,
                        "--job-id", "relayed", "--kill", "step=1,replica=1,phase=backward",
                        # Emulated compute (the trajectory is the reference's): steps long
                        # enough for the killed worker's restart to rejoin before the end.
                        "--compute-ms", "150",
                        "--summary-out", str(tmp_path / "ctl"), "--linger", "30")
        relay = _relay(processes, tmp_path, address, "rack-a")
        for name in ("a", "b"):
            processes.start(f"agent-{name}", "agent", "--controller", relay, "--slots", "2",
                            "--agent-id", name, "--log-dir", str(tmp_path / "logs"),
                            "--connect-timeout", "30")
        wait_for(lambda: job_state(address) in ("succeeded", "failed"), 150, "the job to end")
        summary_file = tmp_path / "ctl" / "summary.json"
        wait_for(summary_file.exists, 10, "the controller's summary.json")
        summary = json.loads(summary_file.read_text())
        assert_same_training(summary, reference)
        assert summary["recoveries"] >= 1
        # The killed worker came back through the relay: its restart joined the job again.
        assert _events(address, "replica-joined"), "the restarted worker never rejoined"
        assert {e["message"].split()[1] for e in _events(address, "agent-registered")} == {
            "a", "b"}
        relay_log = (tmp_path / "logs" / "rack-a.log").read_text()
        assert "relaying to the leader" in relay_log
    finally:
        processes.stop()


def test_a_relay_over_mutual_tls_refuses_impostors_and_its_death_detaches_its_agents(
        tmp_path: Path) -> None:
    """Over mutual TLS, as on a cluster: the relay serves its agents with a certificate of the
    relay role and shows it to the controller, which lets no other role speak for agents.
    When it dies, its agents are detached, not lost: one comes back through a second relay
    and stays in the job (its workers would have trained on); the other does not and is
    lost at the agent timeout. The agents are the real agent's session code
    (`agent.link.open_session`) without workers, so the test costs three processes without
    torch: the controller and two relays."""
    certs = tmp_path / "certs"
    init_ca(certs, "test CA", 1)
    credentials = {}
    for name, roles in (("controller", [Role.CONTROLLER]), ("rack-b", [Role.RELAY]),
                        ("host", [Role.AGENT]), ("ops", [Role.READER])):
        cert, key = issue(certs, name, roles, ["127.0.0.1", "localhost"]
                          if name in ("controller", "rack-b") else [], 1)
        credentials[name] = ["--tls-cert", str(cert), "--tls-key", str(key),
                             "--tls-ca", str(certs / "ca.pem")]
    processes, address = _controller(tmp_path, "relay-death", 2, *credentials["controller"])
    try:
        relay = _relay(processes, tmp_path, address, "rack-b", *credentials["rack-b"])
        relay_process = processes.started[-1]
        spare_relay = _relay(processes, tmp_path, address, "rack-c", *credentials["rack-b"])
        agent = Security(cert=credentials["host"][1], key=credentials["host"][3],
                         ca=credentials["host"][5])
        reader = (certs / "ops.pem", certs / "ops-key.pem", certs / "ca.pem")

        def through_the_relay() -> None:  # `recover status` counts the relay and its agents
            status = _tls_call(address, reader, "Status", pb.StatusRequest())
            assert (status.relays, status.agents_via_relays, status.agents) == (2, 2, 2)
            assert "relays      2, carrying 2 agents' sessions" in format_status(status)
            assert _events(address, "relay-connected", reader)

        def outcome() -> None:  # while x, back through the other relay, keeps beating
            lost = wait_for(lambda: _events(address, "agent-lost", reader), 15,
                            "the agent that did not come back declared lost")
            assert len(lost) == 1 and "agent y: no heartbeat for" in lost[0]["message"], lost
            back = _events(address, "agent-reattached", reader)
            assert len(back) == 1 and "agent x" in back[0]["message"], back
            gone = _events(address, "relay-gone", reader)
            # x may have come back before the leader saw the relay's stream end: then only y
            # was still the dead relay's.
            assert gone and re.search(r"agents detached: [12] ", gone[0]["message"]), gone
            status = _tls_call(address, reader, "Status", pb.StatusRequest())
            assert (status.agents, status.relays, status.agents_via_relays) == (1, 1, 1)

        asyncio.run(_agents_then_relay_death(address, relay, relay_process.pid, agent,
                                             through_the_relay, spare_relay, outcome))
    finally:
        processes.stop()


async def _agents_then_relay_death(controller: str, relay: str, relay_pid: int,
                                   security: Security, check: Callable[[], None],
                                   spare_relay: str, outcome: Callable[[], None]) -> None:
    def register(agent_id: str) -> pb.AgentMessage:
        return pb.AgentMessage(register=pb.RegisterAgent(agent_id=agent_id, host="h", slots=1))

    first = await open_session([relay], [register("x")], timeout_s=30, security=security)
    second = await open_session([relay], [register("y")], timeout_s=30, security=security)
    assert sorted([*first.registered.replica_ids, *second.registered.replica_ids]) == [0, 1]
    # (The controller answers by now: the relay registered them there.) An agent's
    # certificate may not speak for other agents at the controller itself.
    channel = aio_channel(controller, security)

    async def silent() -> AsyncIterator[pb.RelayUp]:
        # Sends nothing: the refusal comes at the call itself, and a request in flight
        # when it does would make the client report its failed send instead (INTERNAL).
        await asyncio.Event().wait()
        yield pb.RelayUp()

    call = rpc.RelayLinkStub(channel).Relay(silent())
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await asyncio.wait_for(call.read(), 10)
    assert refused.value.code() is grpc.StatusCode.PERMISSION_DENIED
    assert "needs relay" in (refused.value.details() or "")
    await channel.close()
    # A second session claiming a live agent's id is refused, and the live one keeps going.
    with pytest.raises(LinkError, match="has a live session"):
        await open_session([relay], [register("x")], timeout_s=10, security=security)
    # The leader's beats reach agents through the relay: well within an agent's 2 s timeout.
    beat = await asyncio.wait_for(first.call.read(), 2.0)
    assert beat.WhichOneof("kind") == "heartbeat" and beat.term >= 1
    check()
    os.kill(relay_pid, signal.SIGKILL)
    for session in (first, second):
        assert await _until_broken(session.call, 10.0) in ("ended", "failed")
        await close_session(session)
    # x comes back through the other relay, as an agent does on losing its session: a
    # resume, with the replicas its workers run.
    back = await open_session([spare_relay], [pb.AgentMessage(register=pb.RegisterAgent(
        agent_id="x", host="h", slots=1, resume=True,
        replica_ids=first.registered.replica_ids, term=first.term))],
        timeout_s=30, security=security)
    assert list(back.registered.replica_ids) == list(first.registered.replica_ids)

    async def beat() -> None:
        while True:
            back.upstream.put_nowait(pb.AgentMessage(heartbeat=pb.Heartbeat(sent_at=time.time())))
            await asyncio.sleep(0.3)

    beating = asyncio.create_task(beat())
    try:
        await asyncio.to_thread(outcome)
    finally:
        beating.cancel()
        await close_session(back)


async def _until_broken(call: grpc.aio.StreamStreamCall, within_s: float) -> str:
    """Read a session (beats) until it ends ("ended") or fails ("failed"); "open" if neither
    happens within `within_s`."""
    deadline = time.monotonic() + within_s
    try:
        while (left := deadline - time.monotonic()) > 0:
            if await asyncio.wait_for(call.read(), left) is grpc.aio.EOF:
                return "ended"
    except grpc.aio.AioRpcError:
        return "failed"
    except TimeoutError:
        pass
    return "open"


def test_a_relay_takes_agents_by_token_while_it_checks_the_controller_with_the_ca(
        tmp_path: Path) -> None:
    """The Kubernetes recipe's layout: the controller serves TLS and takes tokens (no client
    certificates), agents hold a token and the CA only. A relay there needs the CA to check
    the controllers, but must not ask its agents for certificates (`--agents-by-token`; without
    it the agents' TLS handshake fails); it proves itself upstream with a relay token. Two
    processes without torch."""
    certs = tmp_path / "certs"
    init_ca(certs, "test CA", 1)
    for name, roles in (("controller", [Role.CONTROLLER]), ("relay", [Role.RELAY])):
        issue(certs, name, roles, ["127.0.0.1", "localhost"], 1)
    tokens, relay_tokens, agent_token = (tmp_path / n for n in ("tokens", "relay-tokens",
                                                                   "agent-token"))
    tokens.write_text("tok-relay relay rack\ntok-agent agent hosts\n")  # the controller's
    relay_tokens.write_text("tok-relay\ntok-agent agent hosts\n")  # its own, then the agents'
    agent_token.write_text("tok-agent\n")
    for path in (tokens, relay_tokens, agent_token):
        path.chmod(0o600)
    processes, address = _controller(tmp_path, "relay-tokens", 1,
                                     "--tls-cert", str(certs / "controller.pem"),
                                     "--tls-key", str(certs / "controller-key.pem"),
                                     "--token-file", str(tokens))
    try:
        relay = _relay(processes, tmp_path, address, "rack", "--agents-by-token",
                       "--tls-cert", str(certs / "relay.pem"),
                       "--tls-key", str(certs / "relay-key.pem"),
                       "--tls-ca", str(certs / "ca.pem"), "--token-file", str(relay_tokens))
        agent = Security(ca=str(certs / "ca.pem"), token_file=str(agent_token))

        async def register() -> None:
            session = await open_session([relay], [pb.AgentMessage(register=pb.RegisterAgent(
                agent_id="x", host="h", slots=1))], timeout_s=30, security=agent)
            assert list(session.registered.replica_ids) == [0]
            await close_session(session)
            stranger = Security(ca=str(certs / "ca.pem"))  # the CA, but no token
            with pytest.raises(LinkError, match="token"):
                await open_session([relay], [pb.AgentMessage(register=pb.RegisterAgent(
                    agent_id="y", host="h", slots=1))], timeout_s=10, security=stranger)

        asyncio.run(register())
        assert "relay-connected" in (tmp_path / "logs" / "controller.log").read_text()
    finally:
        processes.stop()
