"""The coordinator's transitions as pure functions: (view, event) -> (view, effects).

No coordinator, no store, no asyncio: each test builds a `JobView`, runs one transition
on a `Draft` and checks the new view and the effects it asks for, in order.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable
from typing import Any

import pytest

from recover.controller import commits, effects, joinflow, losses, membership, operations, takeover
from recover.controller.jobstate import JobState
from recover.controller.policy import RecoverPolicy
from recover.controller.records import PersistedJob
from recover.controller.transitions import maybe_finish
from recover.controller.view import Draft, Facts, JobView, Replica, ReplicaState, ReplicaTally
from recover.proto import pb

NOW = 1000.0
WORKLOAD = pb.WorkloadInfo(parameters=10, determinism_sha256="same")


def facts(**overrides: Any) -> Facts:
    counter = itertools.count()
    values: dict[str, Any] = dict(now=NOW, policy=RecoverPolicy(),
                                  token=lambda: f"t{next(counter)}", rendezvous="r:1")
    values.update(overrides)
    return Facts(**values)


def run(view: JobView, transition: Callable[..., Any], *args: Any,
        **fact_overrides: Any) -> tuple[JobView, tuple[effects.Effect, ...], Any]:
    draft = Draft(view, facts(**fact_overrides))
    result = transition(draft, *args)
    new_view, todo = draft.freeze()
    # Every transition of this file keeps the counts the Draft maintains as they would be
    # counted from scratch.
    assert new_view.counts == ReplicaTally.of(new_view.replicas)
    return new_view, todo, result


def job(replicas: int = 2, steps: int = 3, m: int = 4, spares: int = 0,
        reduce: str = "fast") -> pb.JobConfig:
    return pb.JobConfig(job_id="j", replicas=replicas, steps=steps, global_microbatches=m,
                        spares=spares, reduce=reduce)


def running(replicas: int = 2, spares: int = 0, m: int = 4, reduce: str = "fast") -> JobView:
    """A started job: one agent per replica ("a0", "a1", ...), every replica ready."""
    view = JobView(job=job(replicas=replicas, m=m, spares=spares, reduce=reduce))
    for i in range(replicas + spares):
        view, _, _ = run(view, membership.register_agent, f"a{i}", f"h{i}", 1)
    for r in range(replicas + spares):
        view, _, _ = run(view, membership.worker_ready, r,
                         pb.Ready(pid=r, transfer_address=f"10.0.0.{r}:1", workload=WORKLOAD),
                         10.0)
    assert view.state is JobState.RUNNING
    return view


def sends(todo: tuple[effects.Effect, ...]) -> list[tuple[str, pb.ControllerMessage]]:
    """(agent, message) of every message sent, in order; a broadcast's to each of its agents."""
    return [(a, e.message) for e in todo
            if isinstance(e, effects.Send | effects.Broadcast)
            for a in ((e.agent_id,) if isinstance(e, effects.Send) else e.agent_ids)]


def kinds(todo: tuple[effects.Effect, ...]) -> list[str]:
    """Effects by name, a message by its kind: ["StartGeneration", "Send:generation", ...]
    (a broadcast is named once for each of its agents)."""
    named = []
    for e in todo:
        if isinstance(e, effects.Send | effects.Broadcast):
            named += [f"Send:{message.WhichOneof('kind')}" for _, message in sends((e,))]
        else:
            named.append(f"Emit:{e.kind}" if isinstance(e, effects.Emit) else type(e).__name__)
    return named


def reduced(view: JobView, replica: int) -> pb.Reduced:
    ids = view.plan[replica]
    return pb.Reduced(generation=view.generation, step=view.step, microbatch_ids=ids,
                      sample_ids=list(ids), loss=2.5, compute_s=0.1, tokens=len(ids))


def test_registering_and_readying_read_counts_not_every_replica(monkeypatch) -> None:
    # A job's start registers every agent and readies every replica: counting the replicas
    # in each made it quadratic (2,000 agents stalled the controller: BENCHMARKS.md 5).
    view = JobView(job=job(replicas=2002))  # one more to come: the job does not start yet
    replicas = {r: Replica(r, f"a{r}", state=ReplicaState.READY) for r in range(2000)}
    view = dataclasses.replace(view, replicas=replicas, tally=ReplicaTally.of(replicas))
    looked_at = 0
    alive = Replica.alive

    def counted(self: Replica) -> bool:
        nonlocal looked_at
        looked_at += 1
        return alive.fget(self)  # type: ignore[attr-defined]

    monkeypatch.setattr(Replica, "alive", property(counted))
    view, _, ids = run(view, membership.register_agent, "new", "h", 1)
    registered = looked_at
    view, _, _ = run(view, membership.worker_ready, ids[0], pb.Ready(pid=1, workload=WORKLOAD), 10.0)
    assert ids == [2000] and view.counts.ready == 2001 and view.state is JobState.WAITING
    # `run` itself recounts from scratch (the check above): leave those out.
    assert registered - 2001 < 20 and looked_at - registered - 2001 < 20


def test_a_member_lost_mid_step_makes_the_next_generation_and_leaves_the_old_view_alone():
    before = running(replicas=3, m=6)
    after, todo, _ = run(before, losses.worker_exited, pb.WorkerExited(replica=1, signal=9))
    assert before.replicas[1].state is ReplicaState.MEMBER and before.generation == 1
    assert after.replicas[1].state is ReplicaState.LOST and not after.replicas[1].alive
    assert (after.generation, after.members, after.recoveries) == (2, (0, 2), 1)
    assert sorted(mb for ids in after.plan.values() for mb in ids) == list(range(6))
    assert after.plan[0][:2] == before.plan[0] and after.plan[2][:2] == before.plan[2]
    assert kinds(todo) == ["RecordFailure", "StartGeneration", "Emit:generation",
                           "Send:generation", "Send:generation"]
    assert [agent for agent, _ in sends(todo)] == ["a0", "a2"]
    assert after.agents is before.agents  # maps nobody wrote are shared, not copied


def test_the_commit_is_stored_before_it_is_sent_and_a_drain_takes_effect_at_the_boundary():
    view = running(replicas=3, m=6)
    view, _, decision = run(view, operations.request_drain, "a2", "ops", "maintenance")
    assert decision.accepted and view.draining == {"a2"}
    after, todo, _ = run(view, commits.commit, [reduced(view, m) for m in view.members])
    assert kinds(todo) == [
        "CommitStep",  # durable first
        "Send:commit", "Send:commit", "Send:commit",  # the drained member gets it too
        "Send:shutdown", "Emit:drained",
        "StartGeneration", "Emit:generation", "Send:generation", "Send:generation"]
    commit = next(e for e in todo if isinstance(e, effects.CommitStep))
    assert commit.next_plan is None  # the membership changes: the next generation plans
    assert after.step == 1 and after.members == (0, 1) and not after.draining
    assert after.replicas[2].state is ReplicaState.RETIRED and not after.agents["a2"].alive


def test_a_commit_without_membership_change_stores_the_next_plan_with_the_record():
    view = running(replicas=2, m=4)
    after, todo, _ = run(view, commits.commit, [reduced(view, m) for m in view.members])
    commit = next(e for e in todo if isinstance(e, effects.CommitStep))
    assert commit.next_plan is not None and commit.next_plan.step == 1
    sent = [message.commit for _, message in sends(todo)]
    assert all(c.next_plan == commit.next_plan for c in sent) and len(sent) == 2
    assert (after.step, after.generation) == (1, 1)


@pytest.mark.parametrize("events, state", [
    # (transitions after registering agent "a0" with one slot, replica 0's state)
    ([], ReplicaState.ASSIGNED),
    (["ready"], ReplicaState.READY),
    (["ready", "exit"], ReplicaState.LOST),
])
def test_a_replica_before_the_start(events: list[str], state: ReplicaState):
    view = JobView(job=job(replicas=2))
    view, _, _ = run(view, membership.register_agent, "a0", "h0", 1)
    for event in events:
        if event == "ready":
            view, _, _ = run(view, membership.worker_ready, 0, pb.Ready(pid=1), 10.0)
        else:
            view, _, _ = run(view, losses.worker_exited, pb.WorkerExited(replica=0, signal=9))
    assert view.replicas[0].state is state and view.state is JobState.WAITING


def test_a_newcomer_joins_becomes_a_spare_then_takes_a_lost_members_place():
    view = running(replicas=2, m=4)
    view = dataclasses.replace(view, job=job(spares=1))  # room for one more
    view, _, _ = run(view, membership.register_agent, "spare", "hs", 1)
    assert view.replicas[2].state is ReplicaState.ASSIGNED
    view, todo, _ = run(view, membership.worker_ready, 2, pb.Ready(pid=2, transfer_address="x:1"),
                        10.0)
    assert view.replicas[2].state is ReplicaState.JOINING
    assert kinds(todo)[-3:] == ["Send:donate", "Send:join", "Emit:join-started"]
    join = view.joins[2]
    view, _, _ = run(view, joinflow.progress, 2,
                     pb.JoinProgress(step=0, attempt=join.attempts, snapshot_bytes=10,
                                     snapshot_s=0.1))
    assert view.replicas[2].state is ReplicaState.SPARE and view.spares == [2]
    view, todo, _ = run(view, losses.worker_exited, pb.WorkerExited(replica=0, signal=9))
    assert view.members == (1, 2) and view.replicas[2].state is ReplicaState.MEMBER
    assert not view.joins and view.joined == 1 and "Emit:replica-joined" in kinds(todo)


def test_a_newcomer_with_another_determinism_digest_is_retired_and_the_job_goes_on():
    view = running(replicas=2, m=4, reduce="exact")
    view = dataclasses.replace(view, job=job(spares=1, reduce="exact"))  # room for one more
    view, _, _ = run(view, membership.register_agent, "b", "hb", 1)
    view, todo, _ = run(view, membership.worker_ready, 2, pb.Ready(
        pid=2, workload=pb.WorkloadInfo(parameters=10, determinism_sha256="other")), 10.0)
    assert view.replicas[2].state is ReplicaState.RETIRED and view.state is JobState.RUNNING
    assert kinds(todo) == ["Emit:replica-ready", "Emit:replica-refused", "Send:stop_replica"]


def test_losing_every_member_fails_the_job_and_tells_the_live_agents():
    view = running(replicas=2, m=4)
    view, _, _ = run(view, losses.agent_lost, "a0", "silent")
    view, todo, _ = run(view, losses.agent_lost, "a1", "silent")
    assert view.state is JobState.FAILED and "all replicas lost" in view.reason
    end = todo[-1]
    assert isinstance(end, effects.End) and end.agents == () and not end.result.success
    assert view.finished_at == NOW


def test_the_last_step_ends_the_job_once_every_member_applied_it():
    view = running(replicas=2, m=4)
    view = dataclasses.replace(view, step=view.job.steps)  # every step committed
    record = pb.StepRecord(step=2, param_sha256=[pb.ReplicaDigest(replica=0)])
    waiting, todo, _ = run(view, maybe_finish, last_record=record, ledger_len=3)
    assert waiting.state is JobState.RUNNING and todo == ()
    record.param_sha256.append(pb.ReplicaDigest(replica=1))
    done, todo, _ = run(view, maybe_finish, last_record=record, ledger_len=3)
    assert done.state is JobState.SUCCEEDED and done.reason == "3 steps committed"
    # The event first: a reader who sees the state succeeded finds it (the store write of
    # the last step is awaited after the state is the coordinator's).
    assert kinds(todo) == ["Emit:succeeded", "SaveLastStep", "End"]


def test_a_takeover_rebuilds_the_view_from_the_store_without_touching_anything():
    view = running(replicas=2, spares=1, m=4)
    generation = pb.GenerationView(generation=view.generation, members=view.members,
                                   plan=pb.Plan(step=0, assignments=[
                                       pb.Assignment(replica=r, microbatch_ids=ids)
                                       for r, ids in view.plan.items()]))
    agents = [pb.AgentRecord(agent_id="a0", host="h0", replica_ids=[0]),
              pb.AgentRecord(agent_id="a1", host="h1", replica_ids=[1, 3]),
              pb.AgentRecord(agent_id="a2", host="h2", replica_ids=[2],
                             join_addresses={2: "10.0.0.2:1"})]
    persisted = PersistedJob(job=view.job, view=generation, agents=agents)
    restored, todo, _ = run(JobView(job=view.job), takeover.restore, persisted, [], NOW + 6)
    states = {r: info.state for r, info in restored.replicas.items()}
    assert states == {0: ReplicaState.MEMBER, 1: ReplicaState.MEMBER, 2: ReplicaState.READY,
                      3: ReplicaState.LOST}
    assert not any(a.alive for a in restored.agents.values())
    assert restored.state is JobState.RUNNING and restored.plan == dict(view.plan)
    assert restored.takeover is not None and restored.takeover.expected == {"a0", "a1", "a2"}
    assert kinds(todo) == ["Emit:takeover"]
    # Agent a0 never comes back: at the deadline the step goes on without replica 0.
    rejoined, _, _ = run(restored, takeover.rejoin, "a1", "h1", [1])
    rejoined, _, _ = run(rejoined, takeover.rejoin, "a2", "h2", [2])
    assert not takeover.ready_to_finish(rejoined, NOW + 1)
    assert takeover.ready_to_finish(rejoined, NOW + 6)
    carried_on, todo, _ = run(rejoined, takeover.finish, now=NOW + 6)
    assert carried_on.members == (1,) and carried_on.generation == 2
    assert carried_on.plan == {1: (2, 3, 0, 1)} and carried_on.takeover is None
    assert carried_on.replicas[2].state is ReplicaState.JOINING
    assert kinds(todo)[:2] == ["RecordFailure", "Emit:agent-lost"]


def test_a_draft_copies_a_frozen_map_once_and_leaves_it_alone() -> None:
    """Copy-on-write of the view's maps (a frozen view holds read-only proxies of dicts):
    the copy is a dict of its own, equal, whatever kind of mapping it came from; the
    proxy's own `copy()` is used (one C pass: the O(replicas) of every transition that
    changes a replica, BENCHMARKS.md 5 "registration burst")."""
    from collections import UserDict
    from types import MappingProxyType

    from recover.controller.view import _copy

    underneath = {1: "a", 2: "b"}
    for mapping in (MappingProxyType(underneath), underneath, UserDict(underneath)):
        copied = _copy(mapping)
        assert type(copied) is dict and copied == underneath and copied is not underneath
        copied[3] = "c"
        assert 3 not in underneath


def test_agents_lost_together_make_one_generation_not_one_each():
    """A relay's death or one liveness check can lose many agents at once: one new
    generation without all of them (each generation is broadcast to every agent; a loss
    cascade at 3,000 agents kept the leader busy for seconds, BENCHMARKS.md 5)."""
    view = running(replicas=4, m=8)
    before = view.generation
    view, todo, _ = run(view, losses.agents_lost, [("a1", "silent"), ("a2", "relay gone"),
                                                   ("a9", "unknown"), ("a1", "again")])
    assert view.generation == before + 1 and view.members == (0, 3)
    assert not view.agents["a1"].alive and not view.agents["a2"].alive
    assert sorted(mb for r in (0, 3) for mb in view.plan[r]) == list(range(8))
    assert kinds(todo).count("Send:generation") == 2  # the two live agents, once each
    assert [e.message for e in todo if isinstance(e, effects.Emit)
            and e.kind == "agent-lost"] == ["agent a1: silent", "agent a2: relay gone"]
