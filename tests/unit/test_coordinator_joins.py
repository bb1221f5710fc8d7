"""The coordinator bringing capacity back (membership.py, joinflow.py): restarts get fresh
replica ids, joiners get a donor, enter at a step boundary, spares wait caught up, and a
worker lost during startup no longer fails the job."""

from __future__ import annotations

from recover.controller.jobstate import JobState
from recover.controller.joins import MAX_ATTEMPTS
from recover.proto import pb
from tests.unit.coordinator_harness import Harness, make_job, plan_dict, scenario, with_a_spare


def ready(replica: int) -> pb.Ready:
    return pb.Ready(pid=100 + replica, transfer_address=f"10.0.0.{replica}:7000")


async def commit(h: Harness) -> None:
    step = h.coord.step
    await h.reduce()
    await h.apply(step)


async def restart(h: Harness, agent: str, slot: int = 0) -> int:
    before = len(h.messages("replica_assigned"))
    await h.coord.replica_request(agent, pb.ReplicaRequest(slot=slot, reason="exited"))
    assigned = h.messages("replica_assigned")[before:]
    assert len(assigned) == 1 and assigned[0][0] == agent and not assigned[0][1].refused
    return assigned[0][1].replica


@scenario
async def test_a_restarted_worker_gets_a_fresh_id_joins_and_enters_at_a_commit():
    h = Harness(make_job(replicas=3, steps=10, m=6))
    await h.start()
    await commit(h)
    await h.coord.worker_exited(pb.WorkerExited(replica=1, signal=9))
    assert h.coord.members == [0, 2]
    replica = await restart(h, "a1")
    assert replica == 3 and h.coord.agents["a1"].replicas == (1, 3)
    stored = pb.AgentRecord.FromString(await h.store.get("/recover/job-unit/agents/a1"))
    assert list(stored.replica_ids) == [1, 3]  # a new leader knows who hosts it
    await h.coord.worker_ready(3, ready(3))
    (donor_agent, donate), = h.messages("donate")
    (joiner_agent, join), = h.messages("join")
    assert (donate.joiner, donate.address, joiner_agent) == (3, "10.0.0.3:7000", "a1")
    assert donate.tls_sha256 == ""  # a plaintext control plane: a plain TCP transfer
    assert donate.token == join.token and len(join.token) == 32 and donate.donor == join.donor
    assert h.coord.replicas[donate.donor].agent_id == donor_agent
    assert h.coord.joins.joins[3].phase == "transferring"
    # The joiner loaded a snapshot of step 1 and applied nothing since: step 1 is in flight.
    h.coord.joins.progress(3, pb.JoinProgress(step=1, snapshot_bytes=4096, snapshot_s=0.01,
                                              donor=join.donor, attempt=join.attempt))
    assert h.events("state-transfer") and "4096 bytes" in h.events("state-transfer")[0].message
    generation = h.coord.generation
    await commit(h)  # commits step 1: the joiner needs only step 1's gradient now
    last_commit = h.messages("commit")[-1][1]
    assert last_commit.step == 1 and not last_commit.HasField("next_plan")
    view = h.messages("generation")[-1][1]
    assert view.generation == generation + 1 and list(view.members) == [0, 2, 3]
    assert view.plan.step == 2 and plan_dict(view.plan) == {0: (0, 1), 2: (2, 3), 3: (4, 5)}
    assert "a1" in [a for a, m in h.messages("generation") if m.generation == view.generation]
    assert h.events("replica-joined") and not h.coord.joins.joins


@scenario
async def test_a_joiner_behind_the_commit_waits_and_one_beyond_capacity_is_a_spare():
    h, join = await with_a_spare()
    await commit(h)  # the job has its 2 members: the caught-up joiner stays a spare
    assert h.coord.members == [0, 1] and h.messages("commit")[-1][1].HasField("next_plan")
    h.coord.joins.progress(2, pb.JoinProgress(step=1, donor=join.donor, attempt=join.attempt))
    assert h.coord.joins.spares == [2]
    plan = plan_dict(h.messages("commit")[-1][1].next_plan)
    await h.coord.worker_exited(pb.WorkerExited(replica=0, signal=9))
    # The spare holds step 1's state: it enters the recovery generation itself (one group
    # rebuild, not two), sharing the lost replica's microbatches with the survivor.
    view = h.messages("generation")[-1][1]
    assert h.coord.members == [1, 2] and list(view.members) == [1, 2]
    assert view.plan.step == 1
    assert plan_dict(view.plan) == {1: (*plan[1], plan[0][1]), 2: (plan[0][0],)}
    assert [e.step for e in h.events("spare-promoted")] == [1]
    await commit(h)
    assert h.coord.members == [1, 2] and h.coord.step == 2


@scenario
async def test_a_spare_still_catching_up_at_a_loss_enters_at_the_next_boundary():
    h, join = await with_a_spare()
    await commit(h)  # a spare; step 0's gradient is still on its way to it
    await h.coord.worker_exited(pb.WorkerExited(replica=0, signal=9))
    assert h.coord.members == [1]  # it lacks step 0: it cannot compute step 1 yet
    h.coord.joins.progress(2, pb.JoinProgress(step=1, donor=join.donor, attempt=join.attempt))
    await commit(h)  # caught up to step 1: it enters at step 2
    assert h.coord.members == [1, 2] and h.coord.step == 2
    assert [e.step for e in h.events("spare-promoted")] == [2]


@scenario
async def test_a_spare_holding_this_steps_state_carries_on_when_every_member_is_lost():
    h = Harness(make_job(replicas=1, steps=10, m=4))
    h.job.spares = 1
    await h.start([("a0", 2)])
    assert h.coord.members == [0] and 1 in h.coord.joins.joins
    join = h.messages("join")[-1][1]
    h.coord.joins.progress(1, pb.JoinProgress(step=0, donor=join.donor, attempt=join.attempt))
    await h.coord.worker_exited(pb.WorkerExited(replica=0, signal=9))
    assert h.coord.state is JobState.RUNNING and h.coord.members == [1]
    assert plan_dict(h.messages("generation")[-1][1].plan) == {1: (0, 1, 2, 3)}


async def restarted_and_ready() -> tuple[Harness, int]:
    """Three members; replica 2 dies and its restart is ready to join."""
    h = Harness(make_job(replicas=3, steps=10, m=6))
    await h.start()
    await h.coord.worker_exited(pb.WorkerExited(replica=2, signal=9))
    replica = await restart(h, "a2")
    await h.coord.worker_ready(replica, ready(replica))
    return h, replica


@scenario
async def test_a_failed_transfer_tries_another_donor_later_then_gives_up():
    h, replica = await restarted_and_ready()
    first = h.messages("join")[-1][1]
    await h.coord.joins.failed(replica, pb.JoinFailed(donor=first.donor, reason="peer closed",
                                                      attempt=first.attempt, step=-1))
    assert len(h.messages("join")) == 1  # not at once: the donor may be dying
    h.clock.now += 1.0
    h.coord.joins.retry_waiting()
    second = h.messages("join")[-1][1]
    assert second.donor != first.donor and second.token != first.token
    assert second.attempt == first.attempt + 1
    await h.coord.joins.failed(replica, pb.JoinFailed(donor=first.donor, reason="late news",
                                                      attempt=first.attempt))
    assert h.coord.stale_reports == 1  # a report about the replaced attempt
    for _ in range(MAX_ATTEMPTS - 1):
        last = h.messages("join")[-1][1]
        await h.coord.joins.failed(replica, pb.JoinFailed(donor=last.donor, reason="closed",
                                                          attempt=last.attempt))
        h.clock.now += 1.0
        h.coord.joins.retry_waiting()
    assert replica not in h.coord.joins.joins and h.events("join-abandoned")
    (agent, stop), = h.messages("stop_replica")  # its slot is freed for a new worker
    assert stop.replica == replica and agent == "a2"


@scenario
async def test_a_spare_whose_donor_died_first_still_replaces_the_lost_members():
    """The spare's stream breaks before the controller learns its donor (the only member)
    died: its state is still good, and it carries the job."""
    h = Harness(make_job(replicas=1, steps=10, m=4))
    h.job.spares = 1
    await h.start([("a0", 2)])
    join = h.messages("join")[-1][1]
    h.coord.joins.progress(1, pb.JoinProgress(step=0, donor=join.donor, attempt=join.attempt))
    await h.coord.joins.failed(1, pb.JoinFailed(donor=join.donor, reason="peer closed",
                                                attempt=join.attempt, step=0))
    await h.coord.worker_exited(pb.WorkerExited(replica=0, signal=9))
    assert h.coord.state is JobState.RUNNING and h.coord.members == [1]


async def admitted_one_step_short() -> tuple[Harness, int, pb.Join]:
    """Replica 2's restart is admitted at step 1 holding step 0's state, step 0's gradient
    still to come from its donor."""
    h, replica = await restarted_and_ready()
    join = h.messages("join")[-1][1]
    h.coord.joins.progress(replica, pb.JoinProgress(step=0, donor=join.donor,
                                                    attempt=join.attempt))
    await commit(h)
    assert replica in h.coord.members and h.coord.step == 1
    return h, replica, join


@scenario
async def test_an_admitted_joiner_whose_donor_died_a_step_short_leaves_the_step_and_joins_again():
    """Its process and its state are good: it is not stopped and restarted (a new process,
    a whole new transfer) but taken out of the step and fed by another member."""
    h, replica, join = await admitted_one_step_short()
    plan = plan_dict(h.messages("generation")[-1][1].plan)
    await h.coord.worker_exited(pb.WorkerExited(replica=join.donor, signal=9))
    assert replica in h.coord.members  # the controller cannot know yet what it lacks
    await h.coord.joins.failed(replica, pb.JoinFailed(donor=join.donor, reason="peer closed",
                                                      attempt=join.attempt, step=0))
    view = h.messages("generation")[-1][1]
    (survivor,) = {0, 1} - {join.donor}
    assert h.coord.members == [survivor] and list(view.members) == [survivor]
    assert sorted(plan_dict(view.plan)[survivor]) == sorted(m for ms in plan.values() for m in ms)
    assert not h.messages("stop_replica") and h.coord.replicas[replica].state == "joining"
    assert "joins again" in h.events("join-demoted")[0].message
    assert len(h.messages("join")) == 1  # after the retry pause, as any failed attempt
    h.clock.now += 1.0
    h.coord.joins.retry_waiting()
    (_, donate), (_, again) = h.messages("donate")[-1], h.messages("join")[-1]
    assert again.attempt == join.attempt + 1 and again.donor == donate.donor == survivor
    assert donate.joiner == replica
    # The new attempt streams from the survivor's state before step 1: it enters at step 2.
    h.coord.joins.progress(replica, pb.JoinProgress(step=1, donor=survivor,
                                                    attempt=again.attempt))
    await commit(h)
    assert h.coord.members == [survivor, replica] and h.coord.step == 2


@scenario
async def test_an_admitted_joiner_whose_report_comes_first_leaves_the_step_at_once():
    """Its stream broke before the controller learned that its donor died: it leaves the
    step with the donor still a member; the donor's loss then is an ordinary recovery."""
    h, replica, join = await admitted_one_step_short()
    generation = h.coord.generation
    await h.coord.joins.failed(replica, pb.JoinFailed(donor=join.donor, reason="peer closed",
                                                      attempt=join.attempt, step=0))
    assert h.coord.generation == generation + 1 and h.coord.members == [0, 1]
    await h.coord.joins.failed(replica, pb.JoinFailed(donor=join.donor, reason="again",
                                                      attempt=join.attempt, step=0))
    assert h.coord.generation == generation + 1  # the same report twice: stale, no change
    await h.coord.worker_exited(pb.WorkerExited(replica=join.donor, signal=9))
    assert h.coord.members == [({0, 1} - {join.donor}).pop()]
    h.clock.now += 1.0
    h.coord.joins.retry_waiting()
    assert h.messages("join")[-1][1].donor != join.donor and not h.messages("stop_replica")


@scenario
async def test_an_admitted_joiner_short_on_its_last_attempt_is_stopped():
    h, replica, join = await admitted_one_step_short()
    await h.coord.joins.failed(replica, pb.JoinFailed(donor=join.donor, reason="peer closed",
                                                      attempt=MAX_ATTEMPTS, step=0))
    assert replica not in h.coord.members and h.events("join-abandoned")
    assert h.messages("stop_replica")[-1][1].replica == replica


@scenario
async def test_a_joiner_whose_donor_is_lost_after_its_snapshot_enters_in_its_place():
    """Replica 0 donates step 1's state and dies; the joiner holds that state, so it enters the
    recovery of step 1 itself, and its broken stream (the donor is gone) changes nothing."""
    h = Harness(make_job(replicas=2, steps=10, m=4))
    await h.start()
    await commit(h)
    await h.coord.worker_exited(pb.WorkerExited(replica=1, signal=9))
    replica = await restart(h, "a1")
    await h.coord.worker_ready(replica, ready(replica))
    join = h.messages("join")[-1][1]
    h.coord.joins.progress(replica, pb.JoinProgress(step=1, donor=join.donor,
                                                    attempt=join.attempt))
    await h.coord.worker_exited(pb.WorkerExited(replica=join.donor, signal=9))
    assert h.coord.members == [replica] and h.coord.step == 1
    await h.coord.joins.failed(replica, pb.JoinFailed(donor=join.donor, reason="peer closed",
                                                      attempt=join.attempt, step=1))
    assert h.coord.members == [replica] and not h.messages("stop_replica")
    await commit(h)
    assert h.coord.step == 2


@scenario
async def test_a_joiner_that_dies_changes_no_generation():
    h = Harness(make_job(replicas=2, steps=10, m=4))
    await h.start()
    await h.coord.worker_exited(pb.WorkerExited(replica=1, signal=9))
    generation = h.coord.generation
    replica = await restart(h, "a1")
    await h.coord.worker_ready(replica, ready(replica))
    await h.coord.worker_exited(pb.WorkerExited(replica=replica, signal=9))
    assert h.coord.generation == generation and not h.coord.joins.joins
    assert h.coord.failures[-1].phase == "join"


@scenario
async def test_replacements_are_refused_when_the_job_is_full_or_over():
    h = Harness(make_job(replicas=2, steps=1, m=2))
    await h.start()
    await h.coord.replica_request("a0", pb.ReplicaRequest(slot=0))
    assert "has its 2 replicas" in h.messages("replica_assigned")[-1][1].refused
    await commit(h)
    assert h.coord.state is JobState.SUCCEEDED
    await h.coord.replica_request("a0", pb.ReplicaRequest(slot=0))
    assert "succeeded" in h.messages("replica_assigned")[-1][1].refused


@scenario
async def test_a_worker_killed_during_startup_is_replaced_and_the_job_starts():
    h = Harness(make_job(replicas=2, steps=4, m=4))
    await h.coord.register_agent("a", "h", 2)
    await h.coord.worker_ready(0, ready(0))
    await h.coord.worker_exited(pb.WorkerExited(replica=1, signal=9, attached=True))
    assert h.coord.state is JobState.WAITING
    replica = await restart(h, "a", slot=1)
    await h.coord.worker_ready(replica, ready(replica))
    assert h.coord.state is JobState.RUNNING and h.coord.members == [0, replica]


@scenario
async def test_without_a_replacement_the_job_starts_with_min_replicas_after_the_grace():
    h = Harness(make_job(replicas=3, steps=4, m=6))
    h.job.min_replicas = 2
    await h.coord.register_agent("a", "h", 3)
    await h.coord.worker_ready(0, ready(0))
    await h.coord.worker_ready(1, ready(1))
    await h.coord.worker_exited(pb.WorkerExited(replica=2, signal=9, attached=True))
    await h.coord.check_liveness()
    assert h.coord.state is JobState.WAITING
    h.clock.now += h.coord.start_grace_s + 0.5
    for agent_id in h.coord.agents:
        h.coord.heartbeat(agent_id)
    await h.coord.check_liveness()
    assert h.coord.state is JobState.RUNNING and h.coord.members == [0, 1]
    assert "starting with 2 of 3 replicas" in h.events("started")[0].message


@scenario
async def test_a_snapshot_that_differs_from_the_committed_parameters_is_refused():
    h = Harness(make_job(replicas=3, steps=10, m=6))
    await h.start()
    await commit(h)  # step 0 committed; the members' digest of it is "cd" * 32
    await h.coord.worker_exited(pb.WorkerExited(replica=2, signal=9))
    replica = await restart(h, "a2")
    await h.coord.worker_ready(replica, ready(replica))
    first = h.messages("join")[-1][1]
    h.coord.joins.progress(replica, pb.JoinProgress(
        step=1, snapshot_bytes=4096, snapshot_s=0.01, donor=first.donor, attempt=first.attempt,
        param_sha256="ee" * 32))  # what the joiner loaded is not what was committed
    refused, = h.events("snapshot-refused")
    assert f"the snapshot from replica {first.donor} holds other parameters than those " \
           "committed at step 0 (eeeeeeeeeeee against cdcdcdcdcdcd)" in refused.message
    assert not h.events("state-transfer")
    h.clock.now += 1.0
    h.coord.joins.retry_waiting()
    second = h.messages("join")[-1][1]
    assert second.donor != first.donor and second.attempt == first.attempt + 1
    # The next donor's snapshot holds the committed parameters: accepted.
    h.coord.joins.progress(replica, pb.JoinProgress(
        step=1, snapshot_bytes=4096, snapshot_s=0.01, donor=second.donor,
        attempt=second.attempt, param_sha256="cd" * 32))
    assert len(h.events("snapshot-refused")) == 1 and h.events("state-transfer")
