"""Admission policy (controller/admission.py): the decision and its reason, table-style."""

from __future__ import annotations

import pytest

from recover.controller.admission import (
    Capacity,
    WaitingSlot,
    admit_agent,
    admit_replacement,
    fill_waiting,
    spans,
    start_decision,
)
from recover.controller.jobstate import JobState

BASE = dict(job_id="j", job_state=JobState.WAITING, taking_over=False, known_agents=(),
            capacity=Capacity(wanted=4, live=0, next_id=0))

ROWS = [  # agent, slots, overrides, granted ids, waiting slots, reason
    pytest.param("a", 2, {}, (0, 1), (), "agent a on h: replicas [0, 1]", id="first-agent"),
    pytest.param("b", 2, {"known_agents": ("a",), "capacity": Capacity(4, 2, 2)}, (2, 3), (),
                 "agent b on h: replicas [2, 3]", id="ids-continue-after-earlier-agents"),
    pytest.param("b", 1, {"capacity": Capacity(4, 3, 3)}, (3,), (), "replicas [3]",
                 id="exactly-fills"),
    pytest.param("b", 2, {"capacity": Capacity(4, 3, 3)}, (3,), (1,),
                 "agent b on h: replicas [3]; slots [1] wait for room (the job wants 4 "
                 "replicas and has 4)", id="more-slots-than-room-the-rest-wait"),
    pytest.param("b", 1, {"capacity": Capacity(4, 4, 4)}, (), (0,),
                 "agent b on h: no replica; slots [0] wait for room", id="job-full-all-wait"),
    pytest.param("c", 2, {"job_state": JobState.RUNNING, "capacity": Capacity(4, 2, 6)}, (6, 7),
                 (), "agent c on h: replicas [6, 7] (they join the running job)",
                 id="replacement-host-gets-fresh-ids"),
    pytest.param("c", 1, {"capacity": Capacity(6, 4, 4)}, (4,), (), "replicas [4]",
                 id="room-for-spares"),
    pytest.param("a", 0, {}, (), (), "an agent needs at least one slot, got 0", id="zero-slots"),
    pytest.param("a", 1, {"known_agents": ("a",)}, (), (), "agent id 'a' is already registered",
                 id="duplicate-id"),
    pytest.param("a", 1, {"job_state": JobState.FAILED}, (), (), "job j is failed", id="ended"),
    pytest.param("a", 1, {"taking_over": True, "job_state": JobState.RUNNING}, (), (),
                 "job j is taking over after a leader change", id="takeover-wins-over-state"),
    # Replicas of several ranks: an agent's slots hold whole replicas, one id per replica.
    pytest.param("a", 4, {"ranks_per_replica": 2}, (0, 1), (), "agent a on h: replicas [0, 1]",
                 id="sharded-one-id-per-replica"),
    pytest.param("a", 3, {"ranks_per_replica": 2}, (), (),
                 "3 slots do not hold whole replicas of 2 ranks", id="sharded-odd-slots"),
    # Fewer slots than a replica's ranks: part of a replica spanning agents, which waits for
    # the others (fill_waiting forms it); each part the same size, so a divisor of the ranks.
    pytest.param("a", 1, {"ranks_per_replica": 2}, (), (0,),
                 "agent a on h: its 1 slot holds part of a replica of 2 ranks spanning 2 "
                 "agents; it waits for the others", id="spanning-part-waits"),
    pytest.param("a", 2, {"ranks_per_replica": 8}, (), (0,), "spanning 4 agents",
                 id="spanning-four-agents"),
    pytest.param("a", 3, {"ranks_per_replica": 4}, (), (),
                 "3 slots do not hold a whole part of a replica of 4 ranks", id="spanning-uneven"),
    pytest.param("b", 4, {"ranks_per_replica": 2, "capacity": Capacity(4, 3, 3)}, (3,), (2,),
                 "replicas [3]; slots [2] wait for room", id="sharded-the-second-replica-waits"),
    pytest.param("c", 2, {"ranks_per_replica": 2, "job_state": JobState.RUNNING,
                          "capacity": Capacity(4, 2, 6)}, (6,), (),
                 "agent c on h: replicas [6] (they join the running job)",
                 id="sharded-replacement-host"),
]


@pytest.mark.parametrize(("agent_id", "slots", "overrides", "ids", "waiting", "reason"), ROWS)
def test_admit_agent(agent_id, slots, overrides, ids, waiting, reason):
    admission = admit_agent(agent_id, "h", slots, **{**BASE, **overrides})
    assert (admission.replica_ids, admission.waiting_slots) == (ids, waiting)
    assert admission.admitted is bool(ids or waiting)  # else refused: the agent is told why
    assert reason in admission.reason, admission.reason


REPLACEMENT_ROWS = [
    pytest.param({}, (5,), "agent a slot 1: new replica 5", id="room"),
    pytest.param({"capacity": Capacity(4, 4, 5)}, (), "job has its 4 replicas; slot 1 waits "
                 "for room", id="full-the-slot-waits"),
    pytest.param({"agent_alive": False}, (), "not part of the job", id="agent-lost"),
    pytest.param({"job_state": JobState.SUCCEEDED}, (), "job j is succeeded", id="over"),
    pytest.param({"taking_over": True}, (), "taking over", id="takeover"),
    pytest.param({"job_state": JobState.WAITING}, (5,), "new replica 5", id="during-startup"),
    pytest.param({"span": 2}, (), "its slots wait for the other agents of a replica spanning 2",
                 id="spanning-part-waits-for-the-others"),
    pytest.param({"span": 2, "agent_alive": False}, (), "not part of the job",
                 id="spanning-agent-lost"),
]


@pytest.mark.parametrize(("overrides", "ids", "reason"), REPLACEMENT_ROWS)
def test_admit_replacement(overrides, ids, reason):
    args = dict(agent_alive=True, job_id="j", job_state=JobState.RUNNING, taking_over=False,
                capacity=Capacity(4, 3, 5))
    admission = admit_replacement("a", 1, **{**args, **overrides})
    assert admission.replica_ids == ids
    assert admission.waiting_slots == ((1,) if "wait" in reason else ())
    assert reason in admission.reason, admission.reason


FILL_ROWS = [
    pytest.param(Capacity(4, 3, 9), [("a", 1), ("b", 0)], [("a", 1, 9)],
                 "agent a slot 1: new replica 9 (replica 2 lost; the job wants 4 and had 3)",
                 id="one-room-first-waiting-slot"),
    pytest.param(Capacity(4, 2, 9), [("a", 1), ("b", 0), ("b", 1)], [("a", 1, 9), ("b", 0, 10)],
                 "agent b slot 0: new replica 10", id="two-rooms-in-order"),
    pytest.param(Capacity(4, 4, 9), [("a", 1)], [], "", id="no-room"),
    pytest.param(Capacity(4, 1, 9), [("a", 1)], [("a", 1, 9)], "new replica 9",
                 id="fewer-waiting-than-room"),
    # Parts of replicas spanning agents (the third field: how many agents one spans).
    pytest.param(Capacity(4, 2, 9), [("a", 0, 2)], [], "", id="spanning-one-part-waits"),
    pytest.param(Capacity(4, 2, 9), [("a", 0, 2), ("b", 0, 2)], [("a", 0, 9, ("b",))],
                 "agents a, b: new replica 9 spanning them", id="spanning-two-parts-form-one"),
    pytest.param(Capacity(4, 3, 9), [("a", 0, 2), ("b", 0, 2), ("c", 0, 2), ("d", 0, 2)],
                 [("a", 0, 9, ("b",))], "new replica 9", id="spanning-room-for-one"),
    pytest.param(Capacity(4, 0, 9), [("a", 0, 4), ("b", 0, 2), ("c", 0, 2), ("d", 0, 4)],
                 [("b", 0, 9, ("c",))], "agents b, c", id="spanning-parts-of-one-size-together"),
    pytest.param(Capacity(4, 2, 9), [("a", 0, 2), ("x", 1), ("b", 0, 2)],
                 [("x", 1, 9), ("a", 0, 10, ("b",))], "new replica 10 spanning them",
                 id="spanning-beside-a-whole-replica"),
]


@pytest.mark.parametrize(("capacity", "waiting", "filled", "reason"), FILL_ROWS)
def test_fill_waiting(capacity, waiting, filled, reason):
    decisions = fill_waiting([WaitingSlot(*w) for w in waiting], capacity, "replica 2 lost")
    assert [(f.agent_id, f.slot, f.replica, *((f.satellites,) if f.satellites else ()))
            for f in decisions] == filled
    assert not decisions or reason in decisions[-1].reason, decisions[-1].reason


@pytest.mark.parametrize(("slots", "ranks", "span"), [
    (4, 2, 1), (2, 2, 1), (1, 2, 2), (2, 8, 4), (3, 4, 1), (1, 1, 1), (0, 2, 1)])
def test_spans(slots, ranks, span):
    assert spans(slots, ranks) == span


START_ROWS = [
    pytest.param(dict(ready=4, live=4), True, "4 replicas ready", id="all-ready"),
    pytest.param(dict(ready=3, live=4), False, "3 of 4 replicas ready", id="one-still-building"),
    pytest.param(dict(ready=3, live=3), False, "3 of 4 replicas ready",
                 id="an-agent-not-registered-yet"),
    pytest.param(dict(ready=3, live=3, failed_for=2.0), False, "waiting up to 10s",
                 id="failed-worker-replacement-may-come"),
    pytest.param(dict(ready=3, live=3, failed_for=11.0), True, "starting with 3 of 4 replicas",
                 id="grace-over-start-with-what-is-there"),
    pytest.param(dict(ready=1, live=1, failed_for=11.0, min_replicas=2), False,
                 "at least 2 needed", id="below-min-replicas"),
    pytest.param(dict(ready=6, live=6), True, "6 replicas ready", id="spares-ready-too"),
]


@pytest.mark.parametrize(("case", "start", "reason"), START_ROWS)
def test_start_decision(case, start, reason):
    decision = start_decision(ready=case["ready"], live=case["live"], target=4,
                              min_replicas=case.get("min_replicas", 1),
                              startup_failure_for_s=case.get("failed_for"), grace_s=10.0)
    assert decision.start is start
    assert reason in decision.reason, decision.reason
