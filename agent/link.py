"""Finding the leading controller and opening the agent's session with it.

An agent knows a list of controller addresses. A standby refuses a session
(UNAVAILABLE) and names the leader it sees in the store; the agent tries
that address first, then the rest of the list, until a leader answers with
`registered` or the time runs out. gRPC keepalive pings make a stopped or
cut-off leader visible within ~2 s (a killed one closes the stream at once).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import grpc

from recover.agent.fencing import leader_hint
from recover.common.explain import explain_transport
from recover.common.security import PLAINTEXT, Security, aio_channel
from recover.proto import pb, rpc

log = logging.getLogger("recover.agent")

KEEPALIVE_OPTIONS = [
    ("grpc.keepalive_time_ms", 1000),
    ("grpc.keepalive_timeout_ms", 1000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
]


SILENT_S = 3.0
"""How long a standby's hint to an address that failed to answer is ignored (> a lease TTL)."""


class LinkError(Exception):
    """No leader could be reached, or the leader refused this agent; the message says why."""


@dataclass
class Session:
    channel: grpc.aio.Channel
    call: grpc.aio.StreamStreamCall
    upstream: asyncio.Queue[pb.AgentMessage | None]
    registered: pb.Registered
    address: str
    term: int


async def _requests(queue: asyncio.Queue[pb.AgentMessage | None]) -> AsyncIterator[pb.AgentMessage]:
    while (message := await queue.get()) is not None:
        yield message


async def _close(channel: grpc.aio.Channel, queue: asyncio.Queue[pb.AgentMessage | None]) -> None:
    """End our request stream, then close the channel. A request generator left
    suspended in `queue.get()` is finalized later and logs "aclose(): asynchronous
    generator is already running" (seen after every leader change)."""
    queue.put_nowait(None)
    await asyncio.sleep(0)  # let gRPC's request consumer see the end
    await channel.close()


async def close_session(session: Session) -> None:
    await _close(session.channel, session.upstream)


async def _first_non_heartbeat(call: grpc.aio.StreamStreamCall) -> Any:
    """The leader heartbeats every session it holds, and ours is in its table while
    its registration waits for the store: a heartbeat may come before `registered`."""
    while True:
        reply = await call.read()
        if reply is grpc.aio.EOF or reply.WhichOneof("kind") != "heartbeat":
            return reply


async def connected(channel: grpc.aio.Channel, timeout_s: float) -> bool:
    """True once the channel is connected; False when the connection fails or time runs out.

    Not `channel_ready()`: that waits through gRPC's reconnect backoff (1 s at first),
    so one try at the address of a controller that just died (refused at once) cost
    the whole attempt, and a standby's stale hint sends agents there first (measured:
    ~1 s added to most failovers).
    """
    deadline = time.monotonic() + timeout_s
    state = channel.get_state(try_to_connect=True)
    while state is not grpc.ChannelConnectivity.READY:
        remaining = deadline - time.monotonic()
        if state is grpc.ChannelConnectivity.TRANSIENT_FAILURE or remaining <= 0:
            return False
        try:
            await asyncio.wait_for(channel.wait_for_state_change(state), remaining)
        except TimeoutError:
            return False
        state = channel.get_state(try_to_connect=True)
    return True


async def _attempt(address: str, first: list[pb.AgentMessage], attempt_s: float,
                   reply_s: float, security: Security) -> Session | str:
    """One try at one address: the session, or why not (a leader hint, or a reason)."""
    channel = aio_channel(address, security, options=KEEPALIVE_OPTIONS)
    if not await connected(channel, attempt_s):
        why = await _transport_error(channel, security.tls)
        await channel.close()
        return f"{address}: nothing answered" + (f" ({why})" if why else "")
    queue: asyncio.Queue[pb.AgentMessage | None] = asyncio.Queue()
    for message in first:
        queue.put_nowait(message)
    call = rpc.AgentSessionStub(channel).Session(_requests(queue))
    try:
        # Generous: a leader that answered the connect is alive, maybe busy (a
        # registration waits for a durable store write); giving up on it would
        # leave a half-registered agent behind.
        reply = await asyncio.wait_for(_first_non_heartbeat(call), reply_s)
    except grpc.aio.AioRpcError as exc:
        await _close(channel, queue)
        if exc.code() in (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.PERMISSION_DENIED,
                          grpc.StatusCode.UNAUTHENTICATED):
            raise LinkError(f"the controller at {address} refused this agent: {exc.details()}"
                            ) from None
        return exc.details() or exc.code().name
    except TimeoutError:
        await _close(channel, queue)
        return f"{address}: no answer to the session"
    if reply is grpc.aio.EOF or reply.WhichOneof("kind") != "registered":
        await _close(channel, queue)
        return f"{address}: closed the session before registering us"
    return Session(channel, call, queue, reply.registered, address, reply.term)


async def _transport_error(channel: grpc.aio.Channel, tls: bool) -> str:
    """What gRPC says of a connection that did not come up (a failed TLS handshake...).
    Asked only of one that failed (not one still connecting: an unreachable leader must not
    cost a failover more time)."""
    if channel.get_state() is not grpc.ChannelConnectivity.TRANSIENT_FAILURE:
        return ""
    try:
        await rpc.ControlStub(channel).Status(pb.StatusRequest(), timeout=0.2)
    except grpc.aio.AioRpcError as exc:
        if exc.code() is grpc.StatusCode.UNAVAILABLE:
            return explain_transport(exc.details() or "", tls)
    return ""


async def open_session(addresses: list[str], first: list[pb.AgentMessage], timeout_s: float,
                       attempt_s: float = 1.0, lost: str | None = None,
                       reply_s: float = 10.0, security: Security = PLAINTEXT) -> Session:
    """Try the addresses (a standby's leader hint first, the leader just `lost` last)
    until a leader registers us."""
    if lost in addresses:
        addresses = [a for a in addresses if a != lost] + [lost]
    deadline = time.monotonic() + timeout_s
    hint: str | None = None
    reasons: list[str] = []
    silent: dict[str, float] = {}
    """Address -> when it last failed to answer: hints to it are not followed for a while."""
    while True:
        order = ([hint] if hint else []) + [a for a in addresses if a != hint]
        hint = None
        for address in order:
            outcome = await _attempt(address, first, min(attempt_s, max(deadline - time.monotonic(),
                                                                       0.1)), reply_s, security)
            if isinstance(outcome, Session):
                log.info("session with the leader at %s (term %d)", address, outcome.term)
                return outcome
            reasons.append(outcome)
            if "nothing answered" in outcome:
                silent[address] = time.monotonic()
            named = leader_hint(outcome)
            # Until a dead leader's lease runs out, standbys still name it: follow a
            # hint only to an address that has not failed to answer lately (it is
            # still tried in its turn, so a leader that comes back there is found).
            if named and (named not in silent or time.monotonic() - silent[named] >= SILENT_S):
                hint = named
                break
        if time.monotonic() >= deadline:
            if all("nothing answered" in r for r in reasons):
                why = next((r.split("nothing answered (", 1)[1][:-1]
                            for r in reversed(reasons) if "nothing answered (" in r), "")
                raise LinkError(f"cannot reach the controller at {','.join(addresses)} "
                                f"(nothing answered within {timeout_s:.0f}s)"
                                + (f": {why}" if why else ""))
            raise LinkError(f"no leading controller among {','.join(addresses)} within "
                            f"{timeout_s:.0f}s (last: {reasons[-1]})")
        if not hint:
            await asyncio.sleep(0.1)
