"""Heartbeats only where nothing else was said (issue 25 item 5: at thousands of agents every
message costs the leader's one core): the leader beats an agent that heard nothing from it
for BEAT_EVERY_S, an agent beats when it sent nothing for its period. In-process."""

from __future__ import annotations

import asyncio
import math

import pytest

from recover.agent.beats import beat_in
from recover.controller.service import BEAT_EVERY_S, AgentSessions, due_for_beat
from recover.proto import pb


@pytest.mark.parametrize("last_sent,now,expected", [
    ({}, 10.0, ["a", "b"]),                       # never sent anything: both due
    ({"a": 9.9}, 10.0, ["b"]),                    # a heard something 0.1 s ago
    ({"a": 9.5, "b": 9.6}, 10.0, ["a"]),          # exactly every_s ago is due
    ({"a": 10.0, "b": 10.0}, 10.0, []),
    ({"a": 11.0}, 10.0, ["b"]),                   # a clock that went back: not due early
])
def test_who_is_due_for_a_beat(last_sent: dict[str, float], now: float, expected: list[str]
                               ) -> None:
    assert due_for_beat(["a", "b"], last_sent, now, 0.5) == expected


@pytest.mark.parametrize("last_sent,now,expected", [
    (0.0, 100.0, -99.5),    # silent for long: beat now
    (99.8, 100.0, 0.3),     # a report 0.2 s ago: the beat waits until 0.5 s after it
    (100.0, 100.0, 0.5),
    (105.0, 100.0, 0.5),    # never longer than a period
])
def test_when_an_agent_beats(last_sent: float, now: float, expected: float) -> None:
    assert math.isclose(beat_in(last_sent, now, 0.5), expected)


class _Lease:
    term = 3

    def holds(self) -> bool:
        return True


def test_the_leader_beats_only_agents_it_sent_nothing_lately() -> None:
    sessions = AgentSessions()
    sessions.election = _Lease()  # type: ignore[assignment]
    queues: dict[str, asyncio.Queue[pb.ControllerMessage | None]] = {
        a: asyncio.Queue() for a in ("busy", "idle")}
    sessions._queues.update(queues)  # what two open sessions install
    sessions.send("busy", pb.ControllerMessage(commit=pb.Commit(step=4, generation=1)))
    sessions.beat()
    assert [m.WhichOneof("kind") for m in _drain(queues["busy"])] == ["commit"]
    beats = _drain(queues["idle"])
    assert [m.WhichOneof("kind") for m in beats] == ["heartbeat"] and beats[0].term == 3
    sessions.beat()  # the idle one was just beaten, the busy one just sent to
    assert not _drain(queues["busy"]) and not _drain(queues["idle"])
    sessions.beat(every_s=0.0)  # BEAT_EVERY_S later, both are due
    assert len(_drain(queues["busy"])) == len(_drain(queues["idle"])) == 1
    assert 0 < BEAT_EVERY_S <= 0.5  # a quarter of the agents' default leader timeout, or less


def _drain(queue: asyncio.Queue[pb.ControllerMessage | None]) -> list[pb.ControllerMessage]:
    out = []
    while not queue.empty():
        item = queue.get_nowait()
        assert item is not None
        out.append(item)
    return out
