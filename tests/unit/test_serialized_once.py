"""The agents' sessions' response serializer (controller/gate.py, `SerializedOnce`): a
message the leader sends to many agents in a row is serialized once; anything else is
serialized as gRPC would."""

from __future__ import annotations

from recover.controller.gate import SerializedOnce
from recover.proto import pb


def view(members: int, term: int = 3) -> pb.ControllerMessage:
    return pb.ControllerMessage(term=term, generation=pb.GenerationView(
        generation=7, members=list(range(members))))


def test_a_broadcast_is_serialized_once_for_every_agent():
    serialize = SerializedOnce()
    message = view(1000)
    copies = [serialize(message) for _ in range(500)]
    assert (serialize.serialized, serialize.reused) == (1, 499)
    assert all(c == message.SerializeToString() for c in copies)
    assert pb.ControllerMessage.FromString(copies[0]) == message


def test_another_message_or_another_term_is_serialized_anew():
    serialize = SerializedOnce()
    first, second = view(3), view(3)  # equal, but not the same object
    assert serialize(first) == serialize(second)
    assert serialize.serialized == 2
    first.term = 4  # `send` sets the term on each message it sends
    assert pb.ControllerMessage.FromString(serialize(first)).term == 4
    assert serialize.serialized == 3


def test_only_the_most_recent_are_kept():
    serialize = SerializedOnce(keep=2)
    messages = [view(1, term=t) for t in range(3)]
    for message in messages:
        serialize(message)
    serialize(messages[0])  # pushed out by the later two: serialized again
    serialize(messages[2])
    assert (serialize.serialized, serialize.reused) == (4, 1)
