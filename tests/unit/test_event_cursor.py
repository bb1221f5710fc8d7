"""`recover run` follows the job's events across leaders (cli/inspect.py EventCursor)."""

from __future__ import annotations

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


def test_a_new_leader_that_stored_fewer_than_were_sent():
    # The old leader sent 1-4 but stored 1-2; its successor numbers on from 3.
    cursor = EventCursor()
    seen(cursor, events((1, 10.0), (2, 11.0), (3, 12.0), (4, 13.0)))
    cursor.reread = True
    assert cursor.request().after_seq == 0
    answer = events((1, 10.0), (2, 11.0), (3, 20.0), (4, 21.0), (5, 22.0))
    assert seen(cursor, answer) == [(3, 20.0), (4, 21.0), (5, 22.0)]
    assert cursor.request().after_seq == 5
    assert seen(cursor, events((6, 23.0))) == [(6, 23.0)]


def test_a_new_leader_that_stored_more_than_was_read():
    # The reader had seen 1-2; the old leader stored 1-3 before it died.
    cursor = EventCursor()
    seen(cursor, events((1, 10.0), (2, 11.0)))
    cursor.reread = True
    assert seen(cursor, events((1, 10.0), (2, 11.0), (3, 12.0), (4, 30.0))) == [(3, 12.0),
                                                                               (4, 30.0)]


def test_a_new_leader_with_no_events_yet_is_read_from_its_first():
    cursor = EventCursor()
    seen(cursor, events((1, 10.0), (2, 11.0), (3, 12.0)))
    cursor.reread = True
    assert seen(cursor, []) == []
    assert cursor.request().after_seq == 0
    assert seen(cursor, events((1, 40.0))) == [(1, 40.0)]


def test_the_same_leader_after_a_lost_connection_repeats_nothing():
    cursor = EventCursor()
    seen(cursor, events((1, 10.0), (2, 11.0)))
    cursor.reread = True
    assert seen(cursor, events((1, 10.0), (2, 11.0), (3, 12.0))) == [(3, 12.0)]
