"""Admission policy (controller/admission.py): the decision and its reason, table-style."""

from __future__ import annotations

import pytest

from recover.controller.admission import admit_agent
from recover.controller.jobstate import JobState

BASE = dict(job_id="j", job_state=JobState.WAITING, taking_over=False, known_agents=(),
            wanted_replicas=4, hosted_replicas=0)

ROWS = [
    pytest.param("a", 2, {}, (0, 1), "agent a on h: replicas [0, 1]", id="first-agent"),
    pytest.param("b", 2, {"known_agents": ("a",), "hosted_replicas": 2}, (2, 3),
                 "agent b on h: replicas [2, 3]", id="ids-continue-after-earlier-agents"),
    pytest.param("b", 1, {"hosted_replicas": 3}, (3,), "replicas [3]", id="exactly-fills"),
    pytest.param("b", 2, {"hosted_replicas": 3}, (),
                 "job needs 4 replicas and has 3; 2 more slots do not fit", id="too-many-slots"),
    pytest.param("b", 1, {"hosted_replicas": 4}, (),
                 "job needs 4 replicas and has 4; 1 more slots do not fit", id="job-full"),
    pytest.param("a", 0, {}, (), "an agent needs at least one slot, got 0", id="zero-slots"),
    pytest.param("a", 1, {"known_agents": ("a",)}, (), "agent id 'a' is already registered",
                 id="duplicate-id"),
    pytest.param("a", 1, {"job_state": JobState.RUNNING}, (),
                 "job j is running; replicas cannot join a started job yet", id="started"),
    pytest.param("a", 1, {"job_state": JobState.FAILED}, (), "job j is failed", id="ended"),
    pytest.param("a", 1, {"taking_over": True, "job_state": JobState.RUNNING}, (),
                 "job j is taking over after a leader change", id="takeover-wins-over-state"),
]


@pytest.mark.parametrize(("agent_id", "slots", "overrides", "ids", "reason"), ROWS)
def test_admit_agent(agent_id, slots, overrides, ids, reason):
    admission = admit_agent(agent_id, "h", slots, **{**BASE, **overrides})
    assert admission.replica_ids == ids
    assert admission.admitted is bool(ids)
    assert reason in admission.reason, admission.reason
