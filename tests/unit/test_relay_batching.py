"""What crosses a relay's one stream (issue 25 item 5: at thousands of agents the leader's
core goes to gRPC's per-message path): the leader's messages to a rack batched, a message
sent to several agents in a row carried once, the relay detecting its agents' silence
itself. In-process."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from recover.controller.gate import SerializedOnce
from recover.controller.relayed import Deliveries, RelayDownEncoder, RelayOutbox
from recover.proto import pb
from recover.relay.server import Relay, RelayConfig
from recover.relay.upstream import LeaderStream


def _flushed(outbox: RelayOutbox) -> pb.RelayDown:
    """The one batch sent, as the relay parses it off the wire."""
    down = outbox.down.get_nowait()
    assert down is not None and outbox.down.empty()
    return pb.RelayDown.FromString(RelayDownEncoder(SerializedOnce())(down))


def test_a_broadcast_crosses_once_and_each_agent_keeps_its_order() -> None:
    async def scenario() -> pb.RelayDown:
        outbox = RelayOutbox()
        plan = pb.ControllerMessage(generation=pb.GenerationView(generation=4), term=2)
        commit = pb.ControllerMessage(commit=pb.Commit(step=7, generation=4), term=2)
        for agent in ("a", "b", "c"):  # transitions.broadcast: one object, agent after agent
            outbox.deliver(agent, plan)
        outbox.deliver("b", commit)
        outbox.deliver("a", commit)
        outbox.deliver("c", None)  # its session ends
        outbox.deliver("d", None, (grpc.StatusCode.PERMISSION_DENIED, "an impostor"))
        assert outbox.down.empty()  # nothing sent before the loop is free
        await asyncio.sleep(0)
        return _flushed(outbox)

    down = asyncio.run(scenario())
    got = [(list(d.agent_ids), d.message.WhichOneof("kind"), d.end, d.code, d.reason)
           for d in down.deliveries]
    assert got == [
        (["a", "b", "c"], "generation", False, 0, ""),
        (["b", "a"], "commit", False, 0, ""),
        (["c"], None, True, 0, ""),
        (["d"], None, True, grpc.StatusCode.PERMISSION_DENIED.value[0], "an impostor"),
    ]
    assert down.deliveries[0].message.term == 2


def test_equal_but_distinct_messages_are_not_merged() -> None:
    """Only the very object sent to several agents travels once: two messages that merely
    look alike may be meant differently (and comparing them would cost a serialisation)."""
    async def scenario() -> pb.RelayDown:
        outbox = RelayOutbox()
        for agent in ("a", "b"):
            outbox.deliver(agent, pb.ControllerMessage(heartbeat=pb.Heartbeat(sent_at=1.0)))
        await asyncio.sleep(0)
        return _flushed(outbox)

    assert [list(d.agent_ids) for d in asyncio.run(scenario()).deliveries] == [["a"], ["b"]]


def test_a_view_for_many_relays_is_serialized_once_and_reads_as_its_copy_would() -> None:
    # A plan of 3,000 replicas: lengths of two and three varint bytes on the way.
    plan = pb.Plan(step=2, generation=3, assignments=[
        pb.Assignment(replica=r, microbatch_ids=[r, r + 3000]) for r in range(3000)])
    view = pb.ControllerMessage(term=5, generation=pb.GenerationView(
        generation=3, members=range(3000), plan=plan))
    refused = (grpc.StatusCode.PERMISSION_DENIED, "an impostor")
    batches = [Deliveries([(["a", "b"], view, None), (["c"], None, refused)]),
               Deliveries([(["d"], view, None), (["e"], None, None)])]
    once = SerializedOnce()
    got = [pb.RelayDown.FromString(RelayDownEncoder(once)(batch)) for batch in batches]

    def copied(batch: Deliveries) -> pb.RelayDown:  # what the leader sent before: a copy each
        down = pb.RelayDown()
        for agent_ids, message, why in batch.items:
            delivery = down.deliveries.add(agent_ids=agent_ids, end=message is None)
            if message is not None:
                delivery.message.CopyFrom(message)
            elif why is not None:
                delivery.code, delivery.reason = why[0].value[0], why[1]
        return down

    assert got == [copied(batch) for batch in batches]
    assert got[1].deliveries[0].message.generation.plan.assignments[2999].microbatch_ids == [
        2999, 5999]
    assert (once.serialized, once.reused) == (1, 1)
    welcome = pb.RelayDown(term=4, agent_timeout_s=3.0)  # not a batch: as it is
    assert RelayDownEncoder(once)(welcome) == welcome.SerializeToString()


def test_messages_go_up_at_once_and_a_keepalive_when_there_is_nothing() -> None:
    async def scenario() -> list[pb.RelayUp]:
        leader = LeaderStream(term=1)
        leader.forward(pb.RelayedMessage(agent_id="a", message=pb.AgentMessage(
            report=pb.WorkerReport(replica=0, progress=pb.Progress(step=1)))))
        leader.forward(pb.RelayedMessage(agent_id="b", closed=True, reason="no heartbeat"))
        await asyncio.sleep(0)        # both in one batch
        leader.flush(keepalive_s=60)  # nothing new and the stream spoke just now: nothing
        leader.flush(keepalive_s=0)   # silent for longer than the keepalive: an empty one
        ups = []
        while not leader.up.empty():
            up = leader.up.get_nowait()
            assert up is not None
            ups.append(up)
        return ups

    first, keepalive = asyncio.run(scenario())
    assert [(m.agent_id, m.closed, m.reason) for m in first.messages] == [
        ("a", False, ""), ("b", True, "no heartbeat")]
    assert not keepalive.messages


@pytest.mark.parametrize("silent_s, ended", [(5.0, True), (2.9, False), (0.0, False)])
def test_the_relay_ends_the_session_of_an_agent_silent_for_the_timeout(silent_s: float,
                                                                         ended: bool) -> None:
    """The relay is its agents' failure detector (the leader hears the relay, not their
    beats): an agent silent for the job's agent timeout has its session ended, and why is
    what the leader's event will say."""
    relay = Relay(RelayConfig(controllers=["127.0.0.1:1"], relay_id="rack-9",
                              agent_timeout_s=3.0))
    queue: asyncio.Queue[object] = asyncio.Queue()
    relay.agents["a"] = queue  # type: ignore[assignment]
    relay._heard_at["a"] = time.monotonic() - silent_s
    relay._detect_silence()
    assert (not queue.empty() and queue.get_nowait() is None) is ended
    if ended:
        assert relay._ended[queue].startswith("no heartbeat for 5.0s (relay rack-9)")  # type: ignore[index]
    else:
        assert not relay._ended


def test_an_agent_waiting_for_its_registration_is_not_judged() -> None:
    """In a burst of thousands of registrations the leader answers some seconds late; the
    agent says nothing until then. Its silence counts from the answer, as at the leader (a
    first version counted from the request and lost agents in a burst of 2,000)."""
    relay = Relay(RelayConfig(controllers=["127.0.0.1:1"], agent_timeout_s=0.0))
    queue: asyncio.Queue[object] = asyncio.Queue()
    relay.agents["a"] = queue  # type: ignore[assignment]
    relay._detect_silence()
    assert queue.empty()  # registering: not judged
    relay._to_agent("a", pb.ControllerMessage(registered=pb.Registered(replica_ids=[3])))
    time.sleep(0.01)
    relay._detect_silence()  # registered, then silent for longer than the (zero) timeout
    assert queue.get_nowait().WhichOneof("kind") == "registered"  # type: ignore[attr-defined]
    assert queue.get_nowait() is None


class _SlowCall:
    """A leader's stream whose next message comes `after_s` after it is first read (never:
    None)."""

    def __init__(self, after_s: float | None) -> None:
        self.after_s = after_s

    async def read(self) -> object:
        if self.after_s is None:
            await asyncio.Event().wait()
        await asyncio.sleep(self.after_s or 0.0)
        return pb.RelayDown(term=1)


@pytest.mark.parametrize("stalled, answer_after, outcome", [
    (False, None, "silent"),   # the leader said nothing for the timeout: it is lost
    (False, 0.15, "silent"),   # ... even if it speaks later
    (True, 0.15, "heard"),     # our own loop was late just now: the leader gets more time
    (True, None, "silent"),    # but not for ever: three timeouts of silence in all
])
def test_a_stalled_relay_does_not_blame_the_leader_for_its_own_lateness(
        stalled: bool, answer_after: float | None, outcome: str) -> None:
    relay = Relay(RelayConfig(controllers=["127.0.0.1:1"], leader_timeout_s=0.1))
    leader = LeaderStream(term=1)

    async def scenario() -> str:
        leader.heard_at = time.monotonic()
        if stalled:
            relay._stalled_at = time.monotonic()
        try:
            await relay._read_leader(_SlowCall(answer_after), leader)  # type: ignore[arg-type]
        except TimeoutError:
            return "silent"
        return "heard"

    assert asyncio.run(scenario()) == outcome
