"""agent/link.py: reading the registration reply of a session; connecting to an address."""

from __future__ import annotations

import asyncio
import socket
import time

import grpc

from recover.agent.link import _first_non_heartbeat, connected
from recover.proto import pb


class ScriptedCall:
    """A unit-test seam for a gRPC stream: read() returns the scripted messages in order."""

    def __init__(self, *messages: object) -> None:
        self.messages = list(messages)

    async def read(self) -> object:
        return self.messages.pop(0)


def test_heartbeats_before_registered_are_skipped():
    registered = pb.ControllerMessage(registered=pb.Registered(replica_ids=[0, 1]))
    call = ScriptedCall(pb.ControllerMessage(heartbeat=pb.Heartbeat()),
                        pb.ControllerMessage(heartbeat=pb.Heartbeat()), registered)
    assert asyncio.run(_first_non_heartbeat(call)) is registered  # type: ignore[arg-type]


def test_end_of_stream_and_other_messages_are_returned():
    assert asyncio.run(_first_non_heartbeat(ScriptedCall(grpc.aio.EOF))) is grpc.aio.EOF  # type: ignore[arg-type]
    shutdown = pb.ControllerMessage(shutdown=pb.Shutdown(reason="x"))
    assert asyncio.run(_first_non_heartbeat(ScriptedCall(shutdown))) is shutdown  # type: ignore[arg-type]


def test_a_refused_address_fails_at_once_and_a_listening_one_connects():
    async def scenario() -> None:
        server = grpc.aio.server()
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        with socket.socket() as s:  # a port nobody listens on: connect() is refused
            s.bind(("127.0.0.1", 0))
            refused = s.getsockname()[1]
        for _ in range(3):  # a fresh channel per try, as open_session makes
            channel = grpc.aio.insecure_channel(f"127.0.0.1:{refused}")
            started = time.monotonic()
            assert not await connected(channel, 5.0)
            assert time.monotonic() - started < 0.5  # not the whole attempt, not the backoff
            await channel.close()
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
        assert await connected(channel, 5.0)
        await channel.close()
        await server.stop(None)

    asyncio.run(scenario())
