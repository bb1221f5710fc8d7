"""agent/link.py: reading the registration reply of a session."""

from __future__ import annotations

import asyncio

import grpc

from recover.agent.link import _first_non_heartbeat
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
