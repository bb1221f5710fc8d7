"""The transitions every part of the coordinator builds on: a new generation, the end of
the job (succeeded, failed, stopped), a failure record, a replica retired.

Each takes a `Draft` (view.py), changes it and records the effects it needs; none
touches the store or a socket.
"""

from __future__ import annotations

import logging

from recover.controller import effects
from recover.controller.jobstate import TERMINAL, JobState, plan_message
from recover.controller.policy import PlanDecision
from recover.controller.view import Draft, ReplicaState
from recover.proto import pb


def broadcast(d: Draft, message: pb.ControllerMessage) -> None:
    """To every live agent that hosts a member of the current generation."""
    replicas, agents = d.v.replicas, d.v.agents
    targets = {a for m in d.v.members for a in replicas[m].agents}
    d.send_all(tuple(a for a in sorted(targets) if agents[a].alive), message)


def new_generation(d: Draft, members: list[int], decision: PlanDecision) -> None:
    v = d.v
    generation = v.generation + 1
    d.set(generation=generation, members=tuple(members), plan=decision.assignment,
          plan_version=0)
    for m in members:
        if d.v.replicas[m].alive and d.v.replicas[m].state is not ReplicaState.MEMBER:
            d.change_replica(m, state=ReplicaState.MEMBER)
    view = pb.GenerationView(
        generation=generation, members=members, rendezvous=d.facts.rendezvous,
        plan=plan_message(v.step, generation, v.scale_epoch, decision,
                          open_shares=v.job.work_stealing),
        rendezvous_prefix=d.facts.token())
    # The failures and events that led here ride along with the view's write: a leader
    # deposed right after must not take them with it (its successor's summary reports them).
    d.do(effects.StartGeneration(view))
    d.emit("generation", f"members {members}; {decision.reason}", step=v.step,
           generation=generation)
    broadcast(d, pb.ControllerMessage(generation=view))


def agent_record(d: Draft, agent_id: str) -> None:
    """Store who hosts which replicas (and joiners' transfer addresses, for a new leader to
    resume their joins) before the agent acts on it."""
    agent = d.v.agents[agent_id]
    record = pb.AgentRecord(agent_id=agent.agent_id, host=agent.host,
                            replica_ids=agent.replicas, subject=agent.subject,
                            waiting_slots=agent.waiting, peer=agent.peer, slots=agent.slots,
                            replica_store_port=agent.store_port)
    for r in agent.replicas:
        info = d.v.replicas.get(r)
        if info is not None and agent_id in info.satellites:
            record.first_ranks[r] = (info.satellites.index(agent_id) + 1) * agent.slots
        if info is not None and info.alive and info.transfer_address:
            record.join_addresses[r] = info.transfer_address
            if info.transfer_tls_sha256:
                record.join_tls_sha256[r] = info.transfer_tls_sha256
    d.do(effects.SaveAgent(d.v.job, record))


def record_failure(d: Draft, replica: int, cause: str, exited: pb.WorkerExited | None,
                   phase: str = "") -> None:
    d.do(effects.RecordFailure(replica, cause, exited, step=d.v.step,
                               generation=d.v.generation, phase=phase,
                               started=d.v.state is not JobState.WAITING,
                               during_training=d.v.state is JobState.RUNNING))


def lose_replica(d: Draft, replica: int) -> None:
    """Its process, agent or reports failed: it is gone, and any join of it with it. A
    replica spanning agents is lost as a unit: its ranks on the other agents are stopped
    (one of them could be hung, not dead, and the others would wait for it)."""
    d.drop_join(replica)
    info = d.change_replica(replica, state=ReplicaState.LOST)
    if info.satellites:
        d.send_replica(replica, pb.ControllerMessage(stop_replica=pb.StopReplica(
            replica=replica, reason="a part of its replica, on another agent, was lost")))


def retire(d: Draft, replica: int, why: str) -> None:
    """A replica leaves without a failure: forgotten first, so its exit is no loss."""
    d.drop_join(replica)
    d.change_replica(replica, state=ReplicaState.RETIRED)
    d.send_replica(replica, pb.ControllerMessage(
        stop_replica=pb.StopReplica(replica=replica, reason=why)))


def end(d: Draft, state: JobState, reason: str, *, success: bool) -> None:
    """The job is over: store the result, tell the live agents."""
    d.set(state=state, reason=reason, finished_at=d.now)
    result = pb.Shutdown(reason=reason, success=success, state=str(state))
    alive = tuple(a.agent_id for a in d.v.agents.values() if a.alive)
    d.do(effects.End(result, alive))


def fail(d: Draft, reason: str) -> None:
    if d.v.state in TERMINAL:
        return
    d.emit("failed", reason, step=d.v.step, generation=d.v.generation, level=logging.ERROR)
    end(d, JobState.FAILED, reason, success=False)


def stop_now(d: Draft) -> None:
    d.emit("stopped", f"{d.v.stopping}; {d.ledger_len} steps committed", step=d.v.step)
    end(d, JobState.STOPPED, d.v.stopping, success=False)


def maybe_finish(d: Draft) -> None:
    """The last step committed and every live member acknowledged it: the job is done."""
    v = d.v
    if v.state is not JobState.RUNNING or not v.last_step_committed:
        return
    if not set(v.members) <= d.applied_last:
        return
    if v.stop_pending:
        stop_now(d)
        return
    reason = f"{d.ledger_len} steps committed"
    # The event before the store write: the state is terminal as soon as this transition
    # is, and a reader who sees it (`recover run`) must find the event already there.
    d.emit("succeeded", reason)
    d.do(effects.SaveLastStep())
    end(d, JobState.SUCCEEDED, reason, success=True)
