"""`recover relay`: one rack's agent sessions, carried to the leader over one stream.

Agents name the relay as their controller (`recover agent --controller RELAY,CTL1,...`);
they speak the same protocol as to a leader and cannot tell the difference. The relay
authenticates them as a controller would (the same gate, the same credentials) and
forwards their messages to the leader in batches (controller/relayed.py); the leader's
messages come back once per group of agents they are for. So the leader handles messages
per rack, not per agent.

Liveness: the relay is its agents' failure detector. It ends the session of an agent it
heard nothing from for the job's agent timeout (the leader names it in its welcome), and
the leader loses that agent; its own stream, never silent for more than `keepalive_s`,
keeps the others alive at the leader. Its checks and its agents' beats run on one event
loop, so a relay that falls behind (a busy host) delays both alike, and a check that was
itself late by more than its period judges no one. The other way, the leader beats the
relay while it sends it nothing, and the relay beats each agent that heard nothing for
`beat_every_s` while the leader is heard. When the leader's stream ends or falls silent for
`leader_timeout_s` (up to three times that when the relay's own loop stalled meanwhile, for
the same reason as above), the relay ends every agent's session (they look for a leader again:
this relay, once it has found the new one, or another address they know) and the leader
loses them as it would lose their direct sessions.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import math
import signal
import socket
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import grpc

from recover.common.netaddr import write_port_file
from recover.common.security import PLAINTEXT, Authenticator, Security, server_credentials
from recover.controller import authz
from recover.controller.gate import Gate, Malformed, SerializedOnce, add_service
from recover.controller.service import KEEPALIVE_SERVER_OPTIONS
from recover.proto import pb, rpc
from recover.relay.upstream import LeaderStream, find_leader

log = logging.getLogger("recover.relay")


@dataclass(frozen=True)
class RelayConfig:
    """One relay."""

    controllers: list[str]
    """HOST:PORT of every controller of the job (the relay follows the leader)."""
    host: str = "127.0.0.1"
    """Address the relay listens on for its agents."""
    port: int = 0
    """Port for its agents (0: any free one; see `port_file`)."""
    relay_id: str = field(default_factory=lambda: f"relay-{socket.gethostname()}")
    """The relay's name in the leader's log."""
    security: Security = PLAINTEXT
    """Credentials: served to agents (a certificate with the relay role, the agents' CA) and
    shown to the controller (the same certificate, or a token with the relay role)."""
    beat_every_s: float = 0.5
    """Longest an agent goes without a message (the leader's own beat period)."""
    keepalive_s: float = 0.5
    """The relay's stream to the leader is never silent longer (it vouches for its agents)."""
    agent_timeout_s: float = 3.0
    """An agent silent this long is lost, until the leader's welcome names the job's."""
    leader_timeout_s: float = 2.0
    """A leader silent this long is presumed stopped or cut off (the agents' default)."""
    connect_attempt_s: float = 1.0
    """Time for one try at one controller address."""
    port_file: str | None = None
    """Write the listening port here once serving."""
    agents_by_token: bool = False
    """Agents prove themselves with tokens only (the Kubernetes recipe's): `security`'s CA
    checks the controllers, but no client certificate is asked of the agents."""

    @property
    def agents_security(self) -> Security:
        """What the relay serves and asks of its agents."""
        return dataclasses.replace(self.security, ca=None) if self.agents_by_token \
            else self.security


class _Refused:
    """Ends an agent's session with a status (the leader refused its registration)."""

    def __init__(self, code: grpc.StatusCode, reason: str) -> None:
        self.code, self.reason = code, reason


Downstream = asyncio.Queue[pb.ControllerMessage | _Refused | None]
_CODES = {code.value[0]: code for code in grpc.StatusCode}


class Relay(rpc.AgentSessionServicer):
    """Serves agents' sessions and keeps one stream to the leader for them all."""

    def __init__(self, config: RelayConfig) -> None:
        self.config = config
        security = config.agents_security
        self.gate = Gate(Authenticator(security) if security.enabled else None)
        self.gate.reject = lambda verdict: log.warning("refused: %s", verdict.reason)
        self.leader: LeaderStream | None = None
        self.agents: dict[str, Downstream] = {}
        self._sent_at: dict[str, float] = {}
        self._heard_at: dict[str, float] = {}
        """Agent -> when it last said anything, or was registered (monotonic): the failure
        detector's input (an agent not registered yet is not judged)."""
        self._ended: dict[Downstream, str] = {}
        """Sessions (by their queue) the relay ended for their agent's silence, and why."""
        self.agent_timeout_s = config.agent_timeout_s
        self._said: set[str] = set()
        self._stalled_at = -math.inf
        """When this relay's event loop was last seen late by more than a beat period."""
        """What looking for the leader has logged since it was last found."""

    # ------------------------------------------------------------ agents' side

    async def Session(  # noqa: N802 (gRPC method name)
        self, request_iterator: AsyncIterator[pb.AgentMessage], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.ControllerMessage]:
        identity = await self.gate.admit(context, "Session")
        subject = identity.subject if identity.proof != "none" else ""
        peer = authz.peer_host(context.peer() or "") or ""
        leader = self.leader
        if leader is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE,
                                f"relay {self.config.relay_id}: no leader right now; try again")
            return
        queue: Downstream = asyncio.Queue()
        agent_id: str | None = None
        refused: list[tuple[grpc.StatusCode, str]] = []

        async def read() -> None:
            nonlocal agent_id
            try:
                async for message in request_iterator:
                    if isinstance(message, Malformed):
                        refused.append((grpc.StatusCode.INVALID_ARGUMENT,
                                        f"not a valid {message.expected} message"))
                        return
                    kind = message.WhichOneof("kind")
                    if agent_id is not None:
                        self._heard_at[agent_id] = time.monotonic()
                    if agent_id is None:
                        if kind != "register":
                            refused.append((grpc.StatusCode.FAILED_PRECONDITION,
                                            "the first message of a session must be `register`"))
                            return
                        claimed = message.register.agent_id
                        if claimed in self.agents:
                            refused.append((grpc.StatusCode.PERMISSION_DENIED,
                                            f"agent id {claimed!r} has a live session; "
                                            "refusing a second one"))
                            return
                        agent_id = claimed
                        self.agents[agent_id] = queue
                        leader.forward(pb.RelayedMessage(agent_id=agent_id, message=message,
                                                         subject=subject, peer=peer))
                    elif kind != "heartbeat":  # a beat only proves it alive (above)
                        leader.forward(pb.RelayedMessage(agent_id=agent_id, message=message,
                                                         peer=peer))
            except (grpc.aio.AioRpcError, asyncio.CancelledError):
                pass
            finally:
                queue.put_nowait(None)

        reader = asyncio.create_task(read())
        try:
            while (out := await queue.get()) is not None:
                if isinstance(out, _Refused):
                    refused.append((out.code, out.reason))
                    break
                yield out
                if out.WhichOneof("kind") == "shutdown":
                    break
            if refused:
                await context.abort(*refused[0])
        finally:
            reader.cancel()
            why = self._ended.pop(queue, "")
            if agent_id is not None and self.agents.get(agent_id) is queue:
                del self.agents[agent_id]
                self._sent_at.pop(agent_id, None)
                self._heard_at.pop(agent_id, None)
                if self.leader is leader:
                    leader.forward(pb.RelayedMessage(agent_id=agent_id, closed=True,
                                                     reason=why))

    def _to_agent(self, agent_id: str, item: pb.ControllerMessage | _Refused | None) -> None:
        queue = self.agents.get(agent_id)
        if queue is not None:
            queue.put_nowait(item)
            now = self._sent_at[agent_id] = time.monotonic()
            if isinstance(item, pb.ControllerMessage) and item.WhichOneof("kind") == "registered":
                # Its silence counts from here, as at the leader: until its registration is
                # answered (seconds, in a burst of thousands) an agent has nothing to say.
                self._heard_at[agent_id] = now

    def _beat_agents(self, leader: LeaderStream) -> None:
        """Beat the agents that heard nothing lately, while the leader is heard."""
        now = time.monotonic()
        if now - leader.heard_at > self.config.leader_timeout_s:
            return
        beat = pb.ControllerMessage(heartbeat=pb.Heartbeat(sent_at=time.time()), term=leader.term)
        for agent_id in list(self.agents):
            if now - self._sent_at.get(agent_id, 0.0) >= self.config.beat_every_s:
                self._to_agent(agent_id, beat)

    def _detect_silence(self) -> None:
        """End the session of every agent silent for the agent timeout (the leader then loses
        it, as it would a direct agent silent that long)."""
        now = time.monotonic()
        for agent_id, queue in list(self.agents.items()):
            silent = now - self._heard_at.get(agent_id, now)
            if silent > self.agent_timeout_s and queue not in self._ended:
                self._ended[queue] = (f"no heartbeat for {silent:.1f}s (relay "
                                      f"{self.config.relay_id})")
                queue.put_nowait(None)

    def end_sessions(self, why: str) -> None:
        """Every agent looks for a leader again (they rejoin as after a leader's loss)."""
        if self.agents:
            log.warning("ending %d agents' sessions: %s", len(self.agents), why)
        for queue in self.agents.values():
            queue.put_nowait(None)
        self.agents.clear()
        self._sent_at.clear()
        self._heard_at.clear()

    # ------------------------------------------------------------ the leader's side

    async def _serve_leader(self, call: grpc.aio.StreamStreamCall, leader: LeaderStream) -> str:
        """Pass the leader's deliveries on until its stream ends or it falls silent (why)."""
        timeout = self.config.leader_timeout_s
        try:
            while (down := await self._read_leader(call, leader)) is not grpc.aio.EOF:
                leader.heard_at = time.monotonic()
                leader.term = max(leader.term, down.term)
                for delivery in down.deliveries:
                    if delivery.end:
                        item: pb.ControllerMessage | _Refused | None = (
                            _Refused(_CODES.get(delivery.code, grpc.StatusCode.UNKNOWN),
                                     delivery.reason) if delivery.code else None)
                    else:
                        item = delivery.message
                    for agent_id in delivery.agent_ids:
                        self._to_agent(agent_id, item)
                        if item is None or isinstance(item, _Refused):  # the leader ended it
                            self.agents.pop(agent_id, None)
                            self._sent_at.pop(agent_id, None)
                            self._heard_at.pop(agent_id, None)
            return "the leader ended the stream"
        except grpc.aio.AioRpcError as exc:
            return f"the leader's stream failed: {exc.details() or exc.code().name}"
        except TimeoutError:
            return f"the leader was silent for {timeout:.1f}s"

    async def _read_leader(self, call: grpc.aio.StreamStreamCall, leader: LeaderStream) -> Any:
        """The leader's next message; TimeoutError once it has been silent for the leader
        timeout, unless this relay's own loop stalled since it last heard the leader (a busy
        host): what the leader said meanwhile may not have been read yet, and blaming the
        leader for our lateness would end every agent's session. At most three timeouts of
        silence in all."""
        timeout = self.config.leader_timeout_s
        # One read, never cancelled while we wait on (a cancelled read would end the RPC).
        read = asyncio.ensure_future(call.read())
        while True:
            done, _ = await asyncio.wait({read}, timeout=timeout)
            if done:
                return read.result()
            silent = time.monotonic() - leader.heard_at
            if self._stalled_at < leader.heard_at or silent > 3 * timeout:
                read.cancel()
                raise TimeoutError

    async def run_upstream(self) -> None:
        """Find the leader, relay for it until it is lost, and again, forever."""
        while True:
            cfg = self.config
            leader = await find_leader(cfg.controllers, cfg.security, cfg.relay_id,
                                       cfg.connect_attempt_s, self._said)
            if leader is None:
                await asyncio.sleep(0.2)
                continue
            if leader.agent_timeout_s > 0:
                self.agent_timeout_s = leader.agent_timeout_s
            channel, call = leader.channel, leader.call
            assert channel is not None and call is not None
            self.leader = leader
            beats = asyncio.create_task(self._beat_loop(leader))
            try:
                why = await self._serve_leader(call, leader)
            finally:
                beats.cancel()
                self.leader = None
                leader.up.put_nowait(None)
                call.cancel()
                await channel.close()
            log.warning("lost the leader (%s); looking for it", why)
            self.end_sessions(why)

    async def _beat_loop(self, leader: LeaderStream) -> None:
        """Beats to agents, the keepalive to the leader, and the failure detector."""
        period = min(self.config.beat_every_s, self.config.keepalive_s) / 4
        skipped = False
        while True:
            before = time.monotonic()
            await asyncio.sleep(period)
            self._beat_agents(leader)
            leader.flush(keepalive_s=self.config.keepalive_s)
            # A loop that was itself stalled (a busy host) may not have read what its agents
            # sent meanwhile: judging their silence at once would blame them for its own.
            # One round later it has (never two skips in a row: a loop always late still
            # detects, a round later).
            stalled = time.monotonic() - before > 2 * period
            if stalled:
                self._stalled_at = time.monotonic()
            if stalled and not skipped:
                skipped = True
                continue
            skipped = False
            self._detect_silence()


@dataclass
class RunningRelay:
    """A relay serving: its port, and how to stop it."""

    relay: Relay
    server: grpc.aio.Server
    port: int
    upstream: asyncio.Task[None]

    async def stop(self) -> None:
        self.upstream.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self.upstream
        self.relay.end_sessions("the relay is stopping")
        await self.server.stop(grace=0.5)


async def start(config: RelayConfig) -> RunningRelay:
    """Listen for agents and start looking for the leader."""
    relay = Relay(config)
    server = grpc.aio.server(options=[("grpc.so_reuseport", 0), *KEEPALIVE_SERVER_OPTIONS])
    # A delivery for several of its agents is one message object: serialized once for all.
    add_service(server, relay, "AgentSession", {"Session": SerializedOnce()})
    listen = f"{config.host}:{config.port}"
    try:
        port = (server.add_secure_port(listen, server_credentials(config.agents_security))
                if config.security.tls else server.add_insecure_port(listen))
    except RuntimeError as exc:
        raise OSError(f"cannot listen on {listen}: {exc}") from None
    await server.start()
    if config.port_file:
        write_port_file(config.port_file, port)
    log.info("relay %s listening on %s:%d for agents; controllers %s", config.relay_id,
             config.host, port, ",".join(config.controllers))
    return RunningRelay(relay, server, port, asyncio.create_task(relay.run_upstream()))


async def serve(config: RelayConfig) -> int:
    """Serve until SIGINT or SIGTERM."""
    running = await start(config)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        await running.stop()
    return 0
