"""A new leader taking over a running job (controller/takeover.py): joins in flight start
over, the re-sent commit carries its ledger entry, a resumed job keeps its step numbers."""

from __future__ import annotations

import pytest

from recover.controller.coordinator import Coordinator
from recover.controller.jobstate import JobState, RejoinUnexpected
from recover.controller.policy import PlanDecision, RecoverPolicy
from recover.controller.records import Records
from recover.proto import pb
from tests.unit.coordinator_harness import RENDEZVOUS, Harness, make_job, plan_dict, scenario


async def commit(h: Harness) -> None:
    step = h.coord.step
    await h.reduce()
    await h.apply(step)


async def new_leader(h: Harness, resumed_from: pb.CheckpointMeta | None = None) -> Harness:
    """A second coordinator over the same store, as the next term's leader builds it."""
    successor = Harness(h.job)
    successor.store, successor.clock = h.store, h.clock
    successor.coord = Coordinator(h.job, h.store, successor.send, RENDEZVOUS,
                                  agent_timeout_s=3.0, clock=h.clock)
    persisted = await Records(h.store, h.job.job_id).load()
    successor.coord.restore(persisted, resumed_from)
    return successor


PIN = "ab" * 32
"""The joiner's transfer certificate: a donor streams only to it, whichever leader sends it."""


async def joining_when_the_leader_dies() -> Harness:
    """Two members, and a spare host's replica 2 joining."""
    h = Harness(make_job(replicas=2, steps=10, m=4))
    h.job.spares = 1
    await h.start()
    await h.coord.register_agent("late", "host-late", 1)
    await h.coord.worker_ready(2, pb.Ready(pid=7, transfer_address="10.0.0.2:7000",
                                           transfer_tls_sha256=PIN))
    return h


@scenario
async def test_a_join_in_flight_starts_over_with_the_new_leader():
    h = await joining_when_the_leader_dies()
    assert h.messages("join")  # the old leader started the join, then died
    assert [d.tls_sha256 for _, d in h.messages("donate")] == [PIN]
    await commit(h)

    h2 = await new_leader(h)
    for agent, replicas in (("a0", [0]), ("a1", [1]), ("late", [2])):
        await h2.coord.register_agent(agent, "host-" + agent, 1, resume=replicas)
    assert h2.coord.takeover is None and h2.coord.state is JobState.RUNNING
    resent = h2.messages("commit")[0][1]  # broadcast: one per agent
    assert resent.step == 0 and resent.record.step == 0  # workers keep it in their ledger
    (_, join), = h2.messages("join")
    (_, donate), = h2.messages("donate")
    assert join.joiner == 2 and donate.address == "10.0.0.2:7000" and join.attempt == 1
    assert donate.tls_sha256 == PIN  # kept with the joiner's address in its agent's record
    assert h2.coord.members == [0, 1] and 2 in h2.coord.joins.joins


@scenario
async def test_a_joiner_whose_agent_died_with_the_leader_is_lost_at_the_deadline():
    h = await joining_when_the_leader_dies()

    h2 = await new_leader(h)
    for agent, replicas in (("a0", [0]), ("a1", [1])):
        await h2.coord.register_agent(agent, "host-" + agent, 1, resume=replicas)
    assert h2.coord.takeover is not None  # it waits for the joiner's agent too, but not forever
    h.clock.now += 2 * 3.0
    for agent in ("a0", "a1"):
        h2.coord.heartbeat(agent)
    await h2.coord.check_liveness()
    assert h2.coord.takeover is None and h2.coord.state is JobState.RUNNING
    assert not h2.messages("join") and not h2.coord.replicas[2].alive
    assert h2.coord.recoveries == 0  # a lost joiner costs the step nothing


@scenario
async def test_a_resumed_job_keeps_its_step_numbers_across_a_takeover():
    h = Harness(make_job(replicas=2, steps=10, m=4))
    before = [pb.StepRecord(step=s, generation=1, loss=3.0 - s) for s in range(5)]
    checkpoint = pb.CheckpointMeta(step=5, ledger=before)
    h.coord.resume_from(checkpoint)
    await h.start()
    await commit(h)  # step 5
    assert h.coord.step == 6

    h2 = await new_leader(h, resumed_from=checkpoint)
    for agent, replicas in (("a0", [0]), ("a1", [1])):
        await h2.coord.register_agent(agent, "host-" + agent, 1, resume=replicas)
    assert h2.coord.step == 6 and [r.step for r in h2.coord.steps] == list(range(6))
    assert h2.messages("commit")[0][1].step == 5
    assert h2.messages("generation")[-1][1].plan.step == 6


class SkewedPolicy(RecoverPolicy):
    """Stands for a quota policy (throughput-proportional): the first member computes all
    but one microbatch. A successor cannot re-derive that (it has no measurements)."""

    def plan(self, members, global_microbatches):
        first, *rest = members
        assignment = {first: tuple(range(global_microbatches - len(rest)))}
        assignment |= {r: (global_microbatches - len(rest) + i,) for i, r in enumerate(rest)}
        return PlanDecision(assignment, "skewed for the test")


@scenario
async def test_a_new_leader_keeps_the_plan_the_workers_hold():
    """Issue 19: the plan a commit hands the workers is stored with it; a failover after
    that commit resumes the step with exactly that plan, not one the successor re-derives."""
    h = Harness(make_job(replicas=2, steps=10, m=6))
    h.coord.policy = SkewedPolicy()
    await h.start()
    await commit(h)
    held = plan_dict(h.messages("commit")[-1][1].next_plan)
    assert held == {0: (0, 1, 2, 3, 4), 1: (5,)}  # what the workers now hold for step 1

    h2 = await new_leader(h)  # its own policy is the default, uniform one
    for agent, replicas in (("a0", [0]), ("a1", [1])):
        await h2.coord.register_agent(agent, "host-" + agent, 1, resume=replicas)
    (_, view), = h2.messages("generation")[:1]
    assert view.plan.step == 1 and plan_dict(view.plan) == held
    assert "stored with the last commit" in view.plan.reason
    assert h2.coord.plan == held


@scenario
async def test_a_new_leader_reassigns_a_lost_members_share_of_the_stored_plan():
    h = Harness(make_job(replicas=3, steps=10, m=6))
    h.coord.policy = SkewedPolicy()
    await h.start()
    await commit(h)
    h2 = await new_leader(h)
    for agent, replicas in (("a0", [0]), ("a2", [2])):  # a1 never comes back
        await h2.coord.register_agent(agent, "host-" + agent, 1, resume=replicas)
    h.clock.now += 2 * 3.0
    for agent in ("a0", "a2"):
        h2.coord.heartbeat(agent)
    await h2.coord.check_liveness()
    (_, view), = h2.messages("generation")[:1]
    # Survivors keep the stored quotas (0: four, 2: one); the lost member's one goes on.
    assert plan_dict(view.plan) == {0: (0, 1, 2, 3), 2: (5, 4)}


@scenario
async def test_reports_of_the_step_in_flight_count_while_the_agents_rejoin():
    """A new leader knows the plan the members work on before their agents are back: a
    member's report of the step in flight is its plan's, not a stranger's (found by the
    SIGTERM failover test: the members were dropped as 'refused')."""
    h = Harness(make_job(replicas=2, steps=10, m=4))
    await h.start()
    await commit(h)
    h2 = await new_leader(h)
    assert h2.coord.takeover is not None and h2.coord.plan == {0: (0, 1), 1: (2, 3)}
    await h2.coord.register_agent("a0", "host-a0", 1, resume=[0])
    await h2.coord.reduced(0, h2.reduced_msg(0))  # replica 0 reduced step 1 in generation 1
    assert h2.coord.failures == [] and h2.coord.replicas[0].alive


async def running_with_a_commit() -> Harness:
    h = Harness(make_job(replicas=2, steps=10, m=4))
    await h.start()
    await commit(h)
    return h


@scenario
async def test_an_agent_back_on_a_new_session_keeps_its_workers_and_the_step_is_reported_anew():
    # Its relay died (or its link broke) while the leader lived: it was not given up yet.
    # Its replica's report of the step in flight may have died with the relay: member 0 has
    # reported, member 1's report never arrived. Were the leader to wait for it, the step
    # would never commit; a new generation has every member report the step again.
    h = await running_with_a_commit()
    await h.reduce([0])
    generation, plan, sent = h.coord.generation, dict(h.coord.plan), len(h.sent)
    assert await h.coord.register_agent("a1", "host-a1", 1, resume=[1], peer="10.0.0.7",
                                        seen_generation=generation) == [1]
    assert h.coord.agents["a1"].alive and h.coord.agents["a1"].peer == "10.0.0.7"
    again = [(a, m.WhichOneof("kind")) for a, m in h.sent[sent:]]
    assert again[:2] == [("a1", "registered"), ("a1", "commit")]  # dropped if applied
    assert sorted(a for a, kind in again[2:] if kind == "generation") == ["a0", "a1"]
    # Nothing lost: the same members and plan, no recovery; both report the step anew.
    assert h.coord.generation == generation + 1 and h.coord.members == [0, 1]
    assert dict(h.coord.plan) == plan and h.coord.recoveries == 0
    assert "replicas [1] kept running" in h.events("agent-reattached")[0].message
    step = h.coord.step
    await h.reduce()
    await h.apply(step)
    assert h.coord.step == step + 1  # the step committed


@scenario
async def test_an_agent_back_after_the_last_commit_needs_no_generation():
    h = Harness(make_job(replicas=2, steps=1, m=4))
    await h.start()
    await h.reduce()  # the last step commits; the job waits for the members' acknowledgements
    generation = h.coord.generation
    await h.coord.register_agent("a1", "host-a1", 1, resume=[1], seen_generation=generation)
    assert h.coord.generation == generation
    await h.apply(0)
    assert h.coord.state is JobState.SUCCEEDED


@scenario
async def test_an_agent_back_without_a_replica_loses_only_that_replica():
    h = await running_with_a_commit()
    await h.coord.register_agent("a1", "host-a1", 1, resume=[], seen_generation=h.coord.generation)
    assert not h.coord.replicas[1].alive and h.coord.members == [0]
    assert h.coord.agents["a1"].alive  # the agent itself is in the job: its slot may restart


@scenario
async def test_an_agent_given_up_cannot_come_back_on_the_same_leader():
    h = await running_with_a_commit()
    await h.coord.agent_lost("a1", "no heartbeat for 3.1s")
    with pytest.raises(RejoinUnexpected):
        await h.coord.register_agent("a1", "host-a1", 1, resume=[1])


@scenario
async def test_an_assignment_lost_with_a_session_is_not_a_replica_twice():
    # A worker's restart: its agent asks for a replica; the answer is lost with its session
    # (its relay died). Back on a new session it does not list the replica (it never heard
    # of it) and asks again: the unheard-of replica is lost, never started, and the slot
    # gets a new one; no slot holds two.
    h = await running_with_a_commit()
    await h.coord.worker_exited(pb.WorkerExited(replica=1, signal=9))
    await h.coord.replica_request("a1", pb.ReplicaRequest(slot=0, reason="restart"))
    (_, lost_answer), = h.messages("replica_assigned")
    await h.coord.register_agent("a1", "host-a1", 1, resume=[], seen_generation=0)
    assert not h.coord.replicas[lost_answer.replica].alive
    await h.coord.replica_request("a1", pb.ReplicaRequest(slot=0, reason="restart"))
    again = h.messages("replica_assigned")[-1][1]
    assert again.replica != lost_answer.replica and not again.refused
    live_on_a1 = [r for r in h.coord.agents["a1"].replicas if h.coord.replicas[r].alive]
    assert live_on_a1 == [again.replica]


@scenario
async def test_an_agent_back_without_its_spare_still_has_its_member_report_anew():
    # Losing a spare makes no generation; the agent's member may still have lost a report.
    h = Harness(make_job(replicas=2, steps=10, m=4))
    h.job.spares = 1
    await h.start([("a0", 1), ("a1", 2)])  # a1: member 1 and spare 2
    await commit(h)
    generation = h.coord.generation
    await h.coord.register_agent("a1", "host-a1", 2, resume=[1], seen_generation=generation)
    assert not h.coord.replicas[2].alive and h.coord.members == [0, 1]
    assert h.coord.generation == generation + 1
