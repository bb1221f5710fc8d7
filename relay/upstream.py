"""The relay's stream to the leader: finding the leader as an agent would, and what goes up."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator

import grpc

from recover.agent.fencing import leader_hint
from recover.agent.link import KEEPALIVE_OPTIONS
from recover.common.security import Security, aio_channel
from recover.proto import pb, rpc

log = logging.getLogger("recover.relay")


class LeaderStream:
    """The relay's stream to the leader: what goes up in batches, the term it leads in."""

    def __init__(self, term: int = 0, channel: grpc.aio.Channel | None = None) -> None:
        self.term = term
        self.agent_timeout_s = 0.0
        """The job's agent timeout, from the leader's welcome (0: not said)."""
        self.channel = channel
        self.call: grpc.aio.StreamStreamCall | None = None
        self.up: asyncio.Queue[pb.RelayUp | None] = asyncio.Queue()
        self.heard_at = time.monotonic()
        self.sent_at = time.monotonic()
        self._pending: list[pb.RelayedMessage] = []
        self._scheduled = False

    def forward(self, message: pb.RelayedMessage) -> None:
        self._pending.append(message)
        if not self._scheduled:
            self._scheduled = True
            asyncio.get_running_loop().call_soon(self.flush)

    def flush(self, keepalive_s: float | None = None) -> None:
        """Send what is pending; with `keepalive_s`, an empty message if nothing went up for
        that long (the leader counts the relay's agents alive while it hears the relay)."""
        self._scheduled = False
        now = time.monotonic()
        if not self._pending and (keepalive_s is None or now - self.sent_at < keepalive_s):
            return
        self.up.put_nowait(pb.RelayUp(messages=self._pending))
        self._pending = []
        self.sent_at = now


async def _requests(queue: asyncio.Queue[pb.RelayUp | None]) -> AsyncIterator[pb.RelayUp]:
    while (up := await queue.get()) is not None:
        yield up


async def find_leader(controllers: list[str], security: Security, relay_id: str,
                      attempt_s: float, said: set[str]) -> LeaderStream | None:
    """One round over the controller addresses, following a standby's hint to the leader:
    the stream to the leader, welcomed, or None. Each failure is logged once until a leader
    is found (`said`), not at every round of a failover."""
    order = list(controllers)
    tried: set[str] = set()
    while order:
        target = order.pop(0)
        if target in tried:
            continue
        tried.add(target)
        leader = LeaderStream(channel=aio_channel(target, security, options=KEEPALIVE_OPTIONS))
        assert leader.channel is not None
        leader.up.put_nowait(pb.RelayUp(relay_id=relay_id))
        leader.call = rpc.RelayLinkStub(leader.channel).Relay(_requests(leader.up))
        try:
            welcome = await asyncio.wait_for(leader.call.read(), attempt_s)
        except grpc.aio.AioRpcError as exc:
            why = f"controller at {target}: {exc.details() or exc.code().name}"
            if why not in said:
                said.add(why)
                log.info("%s", why)
            hint = leader_hint(exc.details() or "")
            if hint is not None:
                order.insert(0, hint)
            welcome = None
        except TimeoutError:
            welcome = None
        if welcome is None or welcome is grpc.aio.EOF:
            leader.up.put_nowait(None)
            await leader.channel.close()
            continue
        leader.term, leader.agent_timeout_s = welcome.term, welcome.agent_timeout_s
        said.clear()
        log.info("relaying to the leader at %s (term %d)", target, leader.term)
        return leader
    return None
