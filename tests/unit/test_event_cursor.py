"""`recover run` follows the job's events across leaders (cli/inspect.py EventCursor)."""

from __future__ import annotations

import pytest

from recover.cli.inspect import EventCursor
from recover.proto import pb


def events(*pairs: tuple[int, float]) -> list[pb.Event]:
    return [pb.Event(seq=seq, at=at, kind=f"k{seq}@{at}") for seq, at in pairs]


def seen(cursor: EventCursor, answer: list[pb.Event]) -> list[tuple[int, float]]:
    return [(e.seq, e.at) for e in cursor.fresh(answer)]


def test_one_leader_asks_after_the_last_seen():
    cursor = EventCursor()
    assert cursor.request().after_seq == 0
    assert seen(cursor, events((1, 10.0), (2, 11.0))) == [(1, 10.0), (2, 11.0)]
    assert cursor.request().after_seq == 2
    assert seen(cursor, []) == []
    assert cursor.request().after_seq == 2


REREAD_ROWS = [
    # (seen before the connection was lost, the first answer after it, fresh in it, next after)
    pytest.param([(1, 10.0), (2, 11.0), (3, 12.0), (4, 13.0)],
                 [(1, 10.0), (2, 11.0), (3, 20.0), (4, 21.0), (5, 22.0)],
                 [(3, 20.0), (4, 21.0), (5, 22.0)], 5,
                 id="a-new-leader-stored-fewer-than-were-sent"),
    pytest.param([(1, 10.0), (2, 11.0)],
                 [(1, 10.0), (2, 11.0), (3, 12.0), (4, 30.0)],
                 [(3, 12.0), (4, 30.0)], 4,
                 id="a-new-leader-stored-more-than-was-read"),
    pytest.param([(1, 10.0), (2, 11.0), (3, 12.0)], [], [], 0,
                 id="a-new-leader-with-none-yet-is-read-from-its-first"),
    pytest.param([(1, 10.0), (2, 11.0)], [(1, 10.0), (2, 11.0), (3, 12.0)], [(3, 12.0)], 3,
                 id="the-same-leader-repeats-nothing"),
]


@pytest.mark.parametrize(("before", "answer", "fresh", "after"), REREAD_ROWS)
def test_after_a_lost_connection_each_event_once(before, answer, fresh, after):
    cursor = EventCursor()
    seen(cursor, events(*before))
    cursor.reread = True
    assert cursor.request().after_seq == 0
    assert seen(cursor, events(*answer)) == fresh
    assert cursor.request().after_seq == after
    assert seen(cursor, events((after + 1, 99.0))) == [(after + 1, 99.0)]
