"""Replicas spanning agents (more ranks per replica than an agent has slots): formed from
waiting agents, every part told its first rank and where the replica's store is, commands
sent to every part, the replica lost as a unit whichever part fails (a worker, an agent),
drained whole, rebuilt by a new leader. On the coordinator, without processes; the real
job is in tests/integration/test_sharded.py."""

from __future__ import annotations

import pytest

from recover.agent.workers import store_from_here
from recover.cli.jobargs import UsageError
from recover.cli.launcher import slots_per_agent
from recover.common.netaddr import interface_with
from recover.controller import authz
from recover.controller.jobstate import JobState
from recover.proto import pb
from tests.unit.coordinator_harness import Harness, make_job, scenario
from tests.unit.test_takeover import new_leader


def spanning_job(replicas: int = 2, ranks: int = 4) -> pb.JobConfig:
    job = make_job(replicas=replicas, steps=10, m=4)
    job.ranks_per_replica = ranks
    return job


async def register(h: Harness, agent_id: str, slots: int = 2) -> list[int]:
    return await h.coord.register_agent(agent_id, "host-" + agent_id, slots,
                                        peer=f"10.0.0.{ord(agent_id[-1]) - 96}",
                                        store_port=4000 + ord(agent_id[-1]))


async def started() -> Harness:
    """Two replicas of 4 ranks over four agents of 2 slots: a+b hold replica 0, c+d 1."""
    h = Harness(spanning_job())
    for agent_id in "abcd":
        assert await register(h, agent_id) == []  # no agent holds a whole replica
    for replica in (0, 1):
        await h.coord.worker_ready(replica, pb.Ready(pid=100 + replica))
    assert h.coord.state is JobState.RUNNING
    return h


def stops(h: Harness) -> list[tuple[str, int]]:
    return [(a, m.replica) for a, m in h.messages("stop_replica")]


@scenario
async def test_waiting_agents_form_a_replica_and_each_part_learns_its_ranks_and_store():
    h = Harness(spanning_job())
    await register(h, "a")
    assert h.coord.agents["a"].waiting == (0,) and not h.coord.replicas
    assert not h.messages("replica_assigned")  # one part is no replica
    await register(h, "b")
    assigned = [(a, m.slot, m.replica, m.first_rank, m.replica_store)
                for a, m in h.messages("replica_assigned")]
    # The first agent holds rank 0 and serves the store, at the address its session came
    # from and the port it registered.
    assert assigned == [("a", 0, 0, 0, "10.0.0.1:4097"), ("b", 0, 0, 2, "10.0.0.1:4097")]
    replica = h.coord.replicas[0]
    assert replica.agent_id == "a" and replica.satellites == ("b",)
    assert h.coord.agents["a"].waiting == h.coord.agents["b"].waiting == ()
    assert "agents a, b: new replica 0 spanning them" in h.events("slot-filled")[0].message
    # A new leader knows which part each agent holds from its record.
    stored = pb.AgentRecord.FromString(await h.store.get("/recover/job-unit/agents/b"))
    assert dict(stored.first_ranks) == {0: 2} and stored.peer == "10.0.0.2"


@scenario
async def test_every_part_gets_the_replicas_commands():
    h = await started()
    # The generation goes to every agent of every member.
    assert sorted(a for a, _ in h.messages("generation")) == ["a", "b", "c", "d"]
    await h.reduce()
    assert sorted(a for a, _ in h.messages("commit")) == ["a", "b", "c", "d"]


@scenario
async def test_a_part_lost_stops_the_replicas_other_parts_and_its_agents_form_a_new_one():
    h = await started()
    # The rank on agent b died: b reports the replica's exit (its own part).
    await h.coord.worker_exited(pb.WorkerExited(replica=0, signal=9))
    assert not h.coord.replicas[0].alive and h.coord.members == [1]
    assert ("a", 0) in stops(h)  # rank 0's part may be hung: stopped, not waited for
    # Both agents ask for a replica for their slots (their workers ended): only when both
    # wait is a new replica formed; ids are never reused.
    await h.coord.replica_request("b", pb.ReplicaRequest(slot=0, reason="restart"))
    assert h.messages("replica_assigned")[-1][1].waiting
    await h.coord.replica_request("a", pb.ReplicaRequest(slot=0, reason="restart"))
    replica = h.coord.replicas[2]
    assert replica.agents == ("a", "b")  # agents in the order they registered
    assigned = [(a, m.first_rank, m.replica_store) for a, m in h.messages("replica_assigned")
                if m.replica == 2]
    assert assigned == [("a", 0, "10.0.0.1:4097"), ("b", 2, "10.0.0.1:4097")]


@scenario
async def test_an_agent_lost_loses_the_replica_it_holds_part_of():
    h = await started()
    h.clock.now += 10
    for agent_id in "abc":
        h.coord.heartbeat(agent_id)
    await h.coord.check_liveness()  # d is silent
    assert not h.coord.replicas[1].alive and h.coord.members == [0]
    assert ("c", 1) in stops(h)  # the part on the live agent stops


@scenario
async def test_draining_an_agent_takes_its_whole_replica_out():
    h = await started()
    decision = await h.coord.request_drain("b", "operator", "maintenance")
    assert decision.accepted, decision.reason
    await h.reduce()
    await h.apply(0)
    assert not h.coord.replicas[0].alive and h.coord.members == [1]
    assert ("a", 0) in stops(h)
    assert [a for a, m in h.messages("shutdown") if m.state == "drained"] == ["b"]


@scenario
async def test_a_new_leader_rebuilds_which_agents_hold_each_replica():
    h = await started()
    await h.reduce()
    await h.apply(0)
    h2 = await new_leader(h)
    assert h2.coord.replicas[0].agents == ("a", "b")
    assert h2.coord.replicas[1].agents == ("c", "d")
    assert h2.coord.agents["b"].peer == "10.0.0.2"
    for agent_id, replica in (("a", 0), ("b", 0), ("c", 1), ("d", 1)):
        await h2.coord.register_agent(agent_id, "host-" + agent_id, 2, resume=[replica])
    assert h2.coord.takeover is None and h2.coord.members == [0, 1]
    assert sorted(a for a, _ in h2.messages("generation")) == ["a", "b", "c", "d"]


def test_transfer_addresses_are_checked_on_the_host_of_each_ranks_agent():
    def loopback(host: str) -> bool:
        return host.startswith("127.")
    peers = ["10.0.0.1", "10.0.0.1", "10.0.0.2", "10.0.0.2"]
    good = "10.0.0.1:7000,10.0.0.1:7001,10.0.0.2:7000,10.0.0.2:7001"
    assert authz.may_name_transfer(good, "10.0.0.1", loopback, peers).allowed
    forged = "10.0.0.1:7000,10.0.0.1:7001,10.0.0.9:7000,10.0.0.2:7001"
    verdict = authz.may_name_transfer(forged, "10.0.0.1", loopback, peers)
    assert not verdict.allowed and "10.0.0.9:7000" in verdict.reason
    assert "(10.0.0.2)" in verdict.reason  # the host of the agent holding that rank


@pytest.mark.parametrize(("agents", "replicas", "ranks", "slots"), [
    (2, 3, 1, [2, 1]),           # whole replicas spread over the agents
    (2, 2, 2, [2, 2]),           # a replica of 2 ranks on each
    (4, 2, 2, [1, 1, 1, 1]),     # each replica spans 2 agents of 1 slot
    (4, 2, 4, [2, 2, 2, 2]),     # 4 ranks: 2 on each of 2 agents
    (8, 2, 4, [1] * 8),          # 4 ranks over 4 agents
])
def test_a_local_job_spreads_replicas_or_spans_them(agents, replicas, ranks, slots):
    assert slots_per_agent(agents, replicas, ranks) == slots


@pytest.mark.parametrize(("agents", "replicas", "ranks"), [
    (3, 2, 2),   # not a multiple of the replicas
    (6, 2, 2),   # 3 agents per replica cannot share 2 ranks
    (4, 2, 1),   # one rank cannot span agents
    (0, 2, 1),
])
def test_a_local_layout_that_neither_spreads_nor_spans_is_refused(agents, replicas, ranks):
    with pytest.raises(UsageError, match="a replica spanning agents"):
        slots_per_agent(agents, replicas, ranks)


@pytest.mark.parametrize(("store", "control_host", "reached"), [
    ("10.0.0.1:4097", "10.0.0.9", "10.0.0.1:4097"),      # the address the controller saw
    ("127.0.0.1:4097", "10.0.0.9", "10.0.0.9:4097"),     # its agent beside the controller
    ("127.0.0.1:4097", "127.0.0.1", "127.0.0.1:4097"),   # all on one host
    ("[::1]:4097", "10.0.0.9", "10.0.0.9:4097"),
    ("", "10.0.0.9", ""),                                 # not a spanning replica
])
def test_a_spanning_replicas_store_as_each_agent_reaches_it(store, control_host, reached):
    assert store_from_here(store, control_host) == reached


def test_the_interface_of_an_address():
    assert interface_with("127.0.0.1") == "lo"
    assert interface_with("203.0.113.9") is None  # TEST-NET-3: on no interface here
