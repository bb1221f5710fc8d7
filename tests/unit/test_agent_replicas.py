"""The agent's side of a replica of several ranks: lost as a unit, reported once, with the
cause the rank that noted it. Real processes (`sleep`) and real signals; no controller: the
agent's upstream queue is read directly."""

from __future__ import annotations

import asyncio
import signal

from recover.agent.config import AgentConfig
from recover.agent.daemon import Agent
from recover.agent.workers import WorkerProcess, every_process
from recover.proto import pb

WAIT_S = 10.0
"""A bound for a hang, not a timing claim: the kill is expected in milliseconds."""


async def sleeper(replica: int, slot: int, rank: int) -> WorkerProcess:
    process = await asyncio.create_subprocess_exec("sleep", "600", start_new_session=True)
    return WorkerProcess(replica, slot, process, rank=rank)


async def replica_of(ranks: int, replica: int = 5) -> WorkerProcess:
    leader = await sleeper(replica, 0, 0)
    leader.siblings = [await sleeper(replica, rank, rank) for rank in range(1, ranks)]
    return leader


def exits(agent: Agent) -> list[pb.WorkerExited]:
    found = []
    while not agent._upstream.empty():
        message = agent._upstream.get_nowait()
        if message is not None and message.WhichOneof("kind") == "worker_exited":
            found.append(message.worker_exited)
    return found


async def lose_one_rank(victim: int, noted_by: int | None, stop_first: bool) -> tuple[
        WorkerProcess, list[pb.WorkerExited]]:
    agent = Agent(AgentConfig(controller="127.0.0.1:1", slots=3, max_restarts=0))
    leader = await replica_of(3)
    agent.workers[leader.replica] = leader
    if noted_by is not None:
        leader.ranks[noted_by].fault = pb.FaultNote(step=4, phase="stop")
    watches = [asyncio.create_task(agent._watch(p, leader)) for p in leader.ranks]
    target = leader.ranks[victim].process
    if stop_first:  # a hung rank: stopped, then killed (as the watchdog does)
        target.send_signal(signal.SIGSTOP)
    target.send_signal(signal.SIGKILL)
    await asyncio.wait_for(asyncio.gather(*watches), WAIT_S)
    return leader, exits(agent)


def test_a_killed_rank_loses_its_whole_replica_reported_once() -> None:
    leader, reports = asyncio.run(lose_one_rank(victim=1, noted_by=None, stop_first=False))
    assert all(p.process.returncode is not None for p in leader.ranks)  # none lingers
    assert [r.replica for r in reports] == [5]  # one report, for the replica
    assert reports[0].signal == signal.SIGKILL
    assert [p.killed_by_agent for p in leader.ranks] == [
        "rank 1 of its replica exited", "", "rank 1 of its replica exited"]
    assert leader.lost


def test_the_rank_that_noted_a_fault_is_the_cause_whoever_exits_first() -> None:
    # Rank 0, blocked on a stopped rank 2, may be the one the watchdog kills first.
    leader, reports = asyncio.run(lose_one_rank(victim=0, noted_by=2, stop_first=True))
    assert [r.replica for r in reports] == [5]
    assert reports[0].fault.phase == "stop" and reports[0].fault.step == 4
    assert all(p.process.returncode is not None for p in leader.ranks)


def test_every_process_lists_each_replicas_ranks_in_order() -> None:
    async def build() -> list[tuple[int, int]]:
        workers = {0: await replica_of(2, replica=0), 1: await replica_of(1, replica=1)}
        listed = [(p.replica, p.rank) for p in every_process(workers)]
        for p in every_process(workers):
            p.kill()
            await p.process.wait()
        return listed

    assert asyncio.run(build()) == [(0, 0), (0, 1), (1, 0)]


def test_a_replica_still_starting_is_named_to_a_new_leader() -> None:
    """An agent rejoining a new leader while a worker is being started (its warm interpreter
    may import for seconds) names that replica too: it reports ready to the new leader then,
    instead of being declared lost in the takeover."""
    agent = Agent(AgentConfig(controller="127.0.0.1:1", slots=2))
    agent._starting.add(7)
    registration = agent._registration(resume=True).register
    assert list(registration.replica_ids) == [7] and registration.resume
    assert list(agent._registration(resume=False).register.replica_ids) == []


def test_a_request_for_a_replica_without_an_answer_is_asked_again_on_a_new_session() -> None:
    """The request (or its answer) may be lost with a session (a dead relay): it is asked
    again on the next until some answer for its slot came; an assignment of a replica the
    agent runs already (told again) starts nothing."""
    agent = Agent(AgentConfig(controller="127.0.0.1:1", slots=2))

    async def scenario() -> None:
        await agent._request_replica(1, "replica 4 exited", 0.0)
        assert [m.replica_request.slot for m in agent._replays.requests()] == [1]
        agent._starting.add(9)
        agent._handle(pb.ControllerMessage(replica_assigned=pb.ReplicaAssigned(slot=1,
                                                                               replica=9)))
        assert agent._replays.requests() == [] and agent._tasks == []  # nothing started twice
        await agent._request_replica(0, "replica 3 exited", 0.0)
        agent._handle(pb.ControllerMessage(replica_assigned=pb.ReplicaAssigned(
            slot=0, refused="the job has its replicas", waiting=True)))
        assert agent._replays.requests() == []  # waiting is an answer: nothing to ask

    asyncio.run(scenario())
