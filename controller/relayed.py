"""The leader's side of rack relays: one stream per relay, carrying the sessions of its agents.

At thousands of agents the leader's one core goes to gRPC's per-message path (BENCHMARKS.md
section 5): one message in per agent beat, one out per beat, plan and commit. A relay
(`recover relay`, relay/) holds its rack's agent sessions and speaks for them over one
stream, so the leader handles messages per rack, not per agent:

* up, the agents' messages in batches (whatever arrived meanwhile); not their heartbeats:
  the relay is its agents' failure detector (it ends the session of an agent silent for
  the job's agent timeout, which the leader tells it), and the relay's own stream, never
  silent for more than 0.5 s, keeps its agents alive at the leader. So a relay that falls
  behind (a busy host) delays its agents' beats and the checks of their silence alike, as
  a busy leader does for direct sessions, instead of making them look silent;
* down, one `RelayDelivery` for a message the leader sends to several of the relay's
  agents in a row (a new plan, a commit: `transitions.broadcast`), and one beat per relay
  instead of one per agent (the relay beats its agents while it hears the leader).

Every agent behind a relay is handled as if its session were direct: `AgentSessions`
registers it, authorizes its reports and loses it when its session with the relay ends,
or when the relay's stream does (a relay is a failure domain, like a rack's switch). The
relay proved the relay role (gate.py); the identities it names for its agents are what
the agents proved to it.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import grpc

from recover.controller import authz
from recover.controller.coordinator import Coordinator
from recover.controller.gate import Malformed
from recover.controller.leader import LostLeadership
from recover.controller.service import BEAT_EVERY_S, AgentSessions
from recover.proto import pb, rpc

log = logging.getLogger("recover.controller")

VOUCH_EVERY_S = 0.25
"""A relay's stream refreshes its agents' liveness at most this often (it is O(its agents))."""


Delivery = tuple[list[str], pb.ControllerMessage | None, tuple[grpc.StatusCode, str] | None]
"""Agents, the message for them (None: end their sessions) and why they were refused."""


@dataclass(frozen=True)
class Deliveries:
    """A batch for one relay, sent as a `RelayDown` of one `RelayDelivery` each."""

    items: list[Delivery]


def _field(number: int, payload: bytes) -> bytes:
    """A length-delimited protobuf field: its key, its length, its bytes."""
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def _varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


class RelayDownEncoder:
    """The relay streams' response serializer. A new generation's view goes to every relay,
    and at 12,500 agents copying it into each relay's `RelayDown` and serializing each copy
    took ~55 ms of a loss's reaction for 50 relays (BENCHMARKS.md 5). Here each message is
    serialized once for all relays (`serialize`: the sessions' `SerializedOnce`, the same
    object with the same term) and spliced into each relay's `RelayDown` as the delivery's
    `message` field: the bytes are those `RelayDown.SerializeToString` would give with the
    message copied in (fields in another order, which protobuf's parsers take as equal)."""

    def __init__(self, serialize: Callable[[pb.ControllerMessage], bytes]) -> None:
        self._serialize = serialize

    def __call__(self, down: pb.RelayDown | Deliveries) -> bytes:
        if isinstance(down, pb.RelayDown):
            return down.SerializeToString()
        out = []
        for agent_ids, message, refused in down.items:
            delivery = pb.RelayDelivery(agent_ids=agent_ids, end=message is None)
            if refused is not None:
                delivery.code, delivery.reason = refused[0].value[0], refused[1]
            body = delivery.SerializeToString()
            if message is not None:
                body += _field(pb.RelayDelivery.MESSAGE_FIELD_NUMBER, self._serialize(message))
            out.append(_field(pb.RelayDown.DELIVERIES_FIELD_NUMBER, body))
        return b"".join(out)


class RelayOutbox:
    """What the leader sends the agents of one relay, batched until the loop is free."""

    def __init__(self) -> None:
        self.down: asyncio.Queue[pb.RelayDown | Deliveries | None] = asyncio.Queue()
        self._pending: list[Delivery] = []
        self._scheduled = False
        self.last_sent = time.monotonic()
        self.agents: dict[str, _AgentViaRelay] = {}
        """The agents registered through this relay now, and their outboxes."""

    def deliver(self, agent_id: str, message: pb.ControllerMessage | None,
                refused: tuple[grpc.StatusCode, str] | None = None) -> None:
        """`message` for `agent_id` (None: end its session, with `refused` if refused). The
        same message object sent to several agents in a row travels once."""
        last = self._pending[-1] if self._pending else None
        if last is not None and message is not None and last[1] is message:
            last[0].append(agent_id)
        else:
            self._pending.append(([agent_id], message, refused))
        if not self._scheduled:
            self._scheduled = True
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        self._scheduled = False
        pending, self._pending = self._pending, []
        self.send(Deliveries(pending))

    def send(self, down: pb.RelayDown | Deliveries) -> None:
        self.down.put_nowait(down)
        self.last_sent = time.monotonic()

    def close(self) -> None:
        self.down.put_nowait(None)


class _AgentViaRelay:
    """An agent's outbox in `AgentSessions`: its messages go to its relay."""

    def __init__(self, relay: RelayOutbox, agent_id: str) -> None:
        self._relay, self._agent_id = relay, agent_id

    def put_nowait(self, message: pb.ControllerMessage | None) -> None:
        self._relay.deliver(self._agent_id, message)


class RelayHub(rpc.RelayLinkServicer):
    """The leader's relay streams, each feeding its agents' messages into `AgentSessions`."""

    def __init__(self, sessions: AgentSessions) -> None:
        self.sessions = sessions
        self.encoder = RelayDownEncoder(sessions.serializer)
        """The Relay method's response serializer (a view serialized once for all)."""
        self._relays: set[RelayOutbox] = set()
        sessions.release_hooks.append(self._release)

    def counts(self) -> tuple[int, int]:
        """(relays connected, agents reached through them): for `recover status`."""
        return len(self._relays), sum(len(relay.agents) for relay in self._relays)

    def _release(self) -> None:
        """We stopped leading: every relay looks for the new leader."""
        for relay in self._relays:
            relay.close()
        self._relays.clear()

    def beat(self, term: int, every_s: float = BEAT_EVERY_S) -> None:
        """A relay that heard nothing from us for `every_s` hears that we still lead."""
        now = time.monotonic()
        for relay in self._relays:
            if now - relay.last_sent >= every_s:
                relay.send(pb.RelayDown(term=term))

    async def Relay(self, request_iterator: AsyncIterator[pb.RelayUp],  # noqa: N802
                    context: grpc.aio.ServicerContext
                    ) -> AsyncIterator[pb.RelayDown | Deliveries]:
        sessions = self.sessions
        await sessions.gate.admit(context, "Relay")
        coordinator = sessions.coordinator
        election = sessions.election
        if coordinator is None or election is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, await sessions.leader_hint())
            return
        relay = RelayOutbox()
        agents = relay.agents
        name = "?"

        work: asyncio.Queue[pb.RelayUp | None] = asyncio.Queue()
        vouched_at = -math.inf

        async def read() -> None:
            """The relay's word for its agents counts the moment it arrives: behind a burst
            of registrations (each a store write) it would come too late, and agents be lost
            for their relay's backlog. The messages are handled in order by `handle`."""
            nonlocal name, vouched_at
            try:
                async for up in request_iterator:
                    if isinstance(up, Malformed):
                        sessions.reject(coordinator, authz.Verdict(
                            False, f"relay {name}: not a valid {up.expected} message",
                            authz.Reason.MALFORMED))
                        return
                    if up.relay_id:
                        name = up.relay_id
                        coordinator.events.emit("relay-connected", f"relay {name} carries "
                                                "its rack's agents' sessions")
                    if time.monotonic() - vouched_at >= VOUCH_EVERY_S:
                        vouched_at = time.monotonic()
                        for agent_id in agents:
                            coordinator.heartbeat(agent_id)
                    if up.messages:
                        work.put_nowait(up)
            except (grpc.aio.AioRpcError, asyncio.CancelledError):
                pass
            finally:
                work.put_nowait(None)

        async def handle() -> None:
            try:
                while (up := await work.get()) is not None:
                    await self._relayed(coordinator, relay, up)
            except LostLeadership:
                sessions.deposed.set()
            finally:
                relay.close()

        self._relays.add(relay)
        # The welcome: the relay takes agents now, and detects their silence.
        relay.send(pb.RelayDown(term=election.term, agent_timeout_s=coordinator.agent_timeout_s))
        reader, handler = asyncio.create_task(read()), asyncio.create_task(handle())
        try:
            while (down := await relay.down.get()) is not None:
                yield down
        finally:
            reader.cancel()
            handler.cancel()
            self._relays.discard(relay)
            detached = sessions.sessions_detached(list(agents.items()))
            coordinator.events.emit(
                "relay-gone", f"relay {name}: agents detached: {len(detached)} (each is lost "
                "unless it comes back, through another relay or directly, within "
                f"{coordinator.agent_timeout_s:.1f}s)", level=logging.WARNING)

    async def _relayed(self, coordinator: Coordinator, relay: RelayOutbox,
                       up: pb.RelayUp) -> None:
        """One batch from a relay, in order, each message as its agent's session would have it."""
        sessions, agents = self.sessions, relay.agents
        ended: list[tuple[str, Any, str]] = []  # closed in a row: lost in one generation
        for relayed in up.messages:
            agent_id = relayed.agent_id
            outbox = agents.get(agent_id)
            if relayed.closed:
                if outbox is not None:
                    del agents[agent_id]
                    ended.append((agent_id, outbox, relayed.reason or "session closed"))
                continue
            await sessions.sessions_over(coordinator, ended)
            ended = []
            kind = relayed.message.WhichOneof("kind")
            if outbox is not None:
                if kind != "register":
                    await sessions.dispatch(coordinator, agent_id, kind, relayed.message,
                                            relayed.peer or None)
                continue
            if kind != "register":
                relay.deliver(agent_id, None, (grpc.StatusCode.FAILED_PRECONDITION,
                                               "the first message of a session must be "
                                               "`register`"))
                continue
            outbox = _AgentViaRelay(relay, agent_id)
            refusal = await sessions.register(coordinator, relayed.message.register, outbox,
                                              relayed.subject, via_relay=True,
                                              peer=relayed.peer)
            if refusal is not None:
                relay.deliver(agent_id, None, refusal)
            else:
                agents[agent_id] = outbox
        await sessions.sessions_over(coordinator, ended)
