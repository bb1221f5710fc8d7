"""Losses as transitions: a worker exits, an agent goes silent, a member must be dropped.

A member lost inside a step makes a new generation at once: the policy's `reassign`
keeps every survivor's microbatches and hands out the lost ones (to caught-up spares
first when the policy lets them enter mid-step), so the step still sums the same M
microbatches. A joiner's loss changes no generation.
"""

from __future__ import annotations

import logging

from recover.controller import effects, joinflow, membership, worker_errors
from recover.controller.jobstate import TERMINAL, JobState
from recover.controller.transitions import (
    fail,
    lose_replica,
    maybe_finish,
    new_generation,
    record_failure,
)
from recover.controller.view import Draft, ReplicaState
from recover.proto import pb


def lose(d: Draft, lost: list[int], why: str) -> None:
    """Replicas lost: recover without them; then slots waiting for room get replicas."""
    for replica in lost:
        lose_replica(d, replica)
    _recover_without(d, lost, why)
    if lost:
        membership.fill_waiting_slots(d, f"replica{'s' if len(lost) > 1 else ''} "
                                         f"{', '.join(map(str, lost))} lost")


def _recover_without(d: Draft, lost: list[int], why: str) -> None:
    """A new generation without the members in `lost`: gone, or (`_demote`) alive but out
    of the step."""
    v = d.v
    lost = [r for r in lost if r in v.members]  # a joiner's loss changes no generation
    if v.state is not JobState.RUNNING or not lost or v.takeover is not None:
        return  # during a takeover, its end plans around every replica lost meanwhile
    survivors = [r for r in v.live(v.members) if r not in lost]
    if v.last_step_committed and survivors:
        # The final step is committed; only its acknowledgements are pending.
        d.set(members=tuple(survivors))
        maybe_finish(d)
        return
    # Spares holding the state of this very step take the lost members' place in the
    # same new generation (one group rebuild, not a second one at the next boundary)
    # and a share of the lost microbatches; if every member is lost, they carry on.
    spares = [] if not d.policy.spares_enter_mid_step or v.last_step_committed else \
        joinflow.entering(d, v.step, replacing=survivors)
    if not survivors and not spares:
        fail(d, f"all replicas lost (last: {why})")
        return
    d.set(recoveries=d.v.recoveries + 1)
    decision = d.policy.reassign(d.v.plan, lost, survivors, spares)
    new_generation(d, sorted([*survivors, *spares]), decision)


def members_lost(d: Draft, replicas: list[int], why: str, cause: str = "external") -> None:
    """Replicas that cannot go on though their processes live (one that lost its donor,
    one whose report contradicts its plan or the others): stop them, and recover
    without them in one new generation."""
    lost = [r for r in replicas if r in d.v.replicas and d.v.replicas[r].alive]
    for replica in lost:
        record_failure(d, replica, cause, None)
        d.send_replica(replica, pb.ControllerMessage(
            stop_replica=pb.StopReplica(replica=replica, reason=why)))
    if lost:
        lose(d, lost, why)


def worker_exited(d: Draft, exited: pb.WorkerExited) -> None:
    info = d.v.replicas.get(exited.replica)
    if info is None or not info.alive:
        return
    v = d.v
    verdict = worker_errors.judge_exit(exited, training=v.state is not JobState.WAITING,
                                       earlier_errors=v.errors)
    for key in worker_errors.error_keys(exited.error) if exited.HasField("error") else ():
        d.note_error(key, exited.replica)
    member = exited.replica in v.members
    record_failure(d, exited.replica, worker_errors.failure_cause(exited), exited,
                   phase="" if member or v.state is JobState.WAITING else "join")
    if verdict.fatal:
        lose_replica(d, exited.replica)
        fail(d, verdict.reason)
        return
    if v.state is JobState.WAITING:
        d.set(startup_failed_at=d.now)
    lose(d, [exited.replica], verdict.reason)


def agent_lost(d: Draft, agent_id: str, why: str) -> None:
    agents_lost(d, [(agent_id, why)])


def agents_lost(d: Draft, agents: list[tuple[str, str]]) -> None:
    """Agents lost together, each with why (a relay's agents when it dies, those found
    silent by one check): one new generation without all their replicas, not one per
    agent, each broadcast to every agent (at thousands of agents a generation per loss
    kept the leader busy for seconds: BENCHMARKS.md 5)."""
    lost: list[int] = []
    named: list[str] = []
    for agent_id, why in agents:
        agent = d.v.agents.get(agent_id)
        if agent is None or not agent.alive:
            continue
        d.change_agent(agent_id, alive=False)
        if d.v.state in TERMINAL:
            continue
        d.emit("agent-lost", f"agent {agent_id}: {why}", level=logging.WARNING)
        # Fencing: should the host wake up (it was only stopped, or cut off), it
        # must stop its workers rather than act on a membership it is no longer in.
        d.send(agent_id, pb.ControllerMessage(shutdown=pb.Shutdown(
            reason=f"this agent was declared lost ({why})", success=False)))
        replicas = d.v.live(agent.replicas)
        for replica in replicas:
            record_failure(d, replica, "agent-lost", None)
        lost += replicas
        named.append(f"agent {agent_id} lost ({why})")
    if d.v.state is JobState.WAITING and lost:
        d.set(startup_failed_at=d.now)
    if named:
        lose(d, lost, named[0] if len(named) == 1 else f"{len(named)} agents lost "
                                                        f"({'; '.join(named[:3])}...)")


def join_failed(d: Draft, replica: int, msg: pb.JoinFailed) -> None:
    if replica in d.v.members:
        if msg.step >= d.v.step:
            # It holds every step before the one being computed (a spare that entered a
            # recovery mid-step, whose donor was the replica lost): nothing is missing.
            d.do(effects.Stale())
            return
        _demote(d, replica, msg)
        return
    joinflow.attempt_failed(d, replica, msg)


def _demote(d: Draft, replica: int, msg: pb.JoinFailed) -> None:
    """Admitted at this step, but its donor died before streaming the step before it: it
    cannot compute, yet its process and the steps it holds are good. It leaves the step as a
    lost member would (its microbatches go to the others, one new generation) and joins
    again from another member, instead of being stopped and restarted (a new process, a
    whole new transfer)."""
    v = d.v
    why = (f"replica {replica} was admitted at step {v.step} but its donor stopped streaming "
           f"with the state before step {msg.step}")
    if v.state is not JobState.RUNNING or v.takeover is not None or v.last_step_committed:
        members_lost(d, [replica], f"{why}: stopped")  # no step left for it to join
        return
    d.emit("join-demoted", f"{why}: it leaves the step and joins again", step=v.step,
           generation=v.generation, replica=replica, level=logging.WARNING)
    d.change_replica(replica, state=ReplicaState.JOINING)
    _recover_without(d, [replica], why)
    if d.v.state is JobState.RUNNING and d.v.replicas[replica].alive:
        joinflow.rejoin(d, replica, msg)
