"""Who is in the job, as transitions: agents registering, workers becoming ready and
being replaced, and when the job starts. Losses are in losses.py, joins in joinflow.py.

A replica's life is `view.ReplicaState`. A lost replica's id is never reused: its agent
asks for a new one on the same slot (a restart), and the new replica joins with live
state transfer.
"""

from __future__ import annotations

import logging

from recover.controller import effects, joinflow, worker_errors
from recover.controller.admission import (
    Capacity,
    WaitingSlot,
    admit_agent,
    admit_replacement,
    fill_waiting,
    spans,
    start_decision,
)
from recover.controller.jobstate import TERMINAL, JobState, RegistrationRefused
from recover.controller.transitions import agent_record, fail, new_generation, retire
from recover.controller.view import Agent, Draft, Replica, ReplicaState
from recover.proto import pb


def capacity(d: Draft) -> Capacity:
    counts = d.v.counts  # lost replicas' ids included in next_id: ids are never reused
    return Capacity(wanted=d.v.job.replicas + d.v.job.spares, live=counts.live,
                    next_id=counts.next_id)


def register_agent(d: Draft, agent_id: str, host: str, slots: int,
                   subject: str = "", peer: str = "", store_port: int = 0) -> list[int]:
    """A new agent joins: fresh replica ids for its slots, or RegistrationRefused. One that
    holds part of a replica spanning agents waits for the others (`fill_waiting_slots`)."""
    v = d.v
    admission = admit_agent(
        agent_id, host, slots, job_id=v.job.job_id, job_state=v.state,
        taking_over=v.takeover is not None and v.takeover.persisted.view is not None,
        known_agents=v.agents.keys(), capacity=capacity(d),
        ranks_per_replica=v.job.ranks_per_replica)
    if not admission.admitted:
        raise RegistrationRefused(admission.reason)
    ids = list(admission.replica_ids)
    d.put_agent(Agent(agent_id, host, tuple(ids), subject=subject,
                      waiting=admission.waiting_slots, slots=slots, peer=peer,
                      store_port=store_port))
    ranks = max(v.job.ranks_per_replica, 1)
    for index, replica in enumerate(ids):  # a replica's ranks on consecutive slots
        d.put_replica(Replica(replica, agent_id, slot=index * ranks))
    agent_record(d, agent_id)
    d.emit("agent-registered", admission.reason)
    d.send(agent_id, pb.ControllerMessage(
        registered=pb.Registered(replica_ids=ids, job=v.job)))
    if spans(slots, v.job.ranks_per_replica) > 1:
        fill_waiting_slots(d, f"agent {agent_id} registered")
    return ids


def assignment(d: Draft, replica: int, agent_id: str) -> pb.ReplicaAssigned:
    """What an agent is told to start for `replica` (its part, if the replica spans agents)."""
    info = d.v.replicas[replica]
    if not info.satellites:
        return pb.ReplicaAssigned(slot=info.slot, replica=replica)
    index = info.agents.index(agent_id)
    return pb.ReplicaAssigned(slot=info.slot if index == 0 else 0, replica=replica,
                              first_rank=index * d.v.agents[agent_id].slots,
                              replica_store=d.v.agents[info.agent_id].replica_store)


def replica_request(d: Draft, agent_id: str, request: pb.ReplicaRequest) -> None:
    """An agent's worker died and may be restarted on its slot: a fresh replica id."""
    v = d.v
    agent = v.agents.get(agent_id)
    admission = admit_replacement(
        agent_id, request.slot, agent_alive=agent is not None and agent.alive,
        job_id=v.job.job_id, job_state=v.state,
        taking_over=v.takeover is not None, capacity=capacity(d),
        span=spans(agent.slots, v.job.ranks_per_replica) if agent is not None else 1)
    new_waiting = [s for s in admission.waiting_slots if agent and s not in agent.waiting]
    if agent is not None and new_waiting:
        d.change_agent(agent_id, waiting=(*agent.waiting, *new_waiting))
        agent_record(d, agent_id)
    if agent is None or not admission.replica_ids:
        d.send(agent_id, pb.ControllerMessage(replica_assigned=pb.ReplicaAssigned(
            slot=request.slot, refused=admission.reason, retryable=v.takeover is not None,
            waiting=bool(admission.waiting_slots))))
        if new_waiting:
            fill_waiting_slots(d, f"agent {agent_id} asked for a replica")
        return
    replica = admission.replica_ids[0]
    d.change_agent(agent_id, replicas=(*agent.replicas, replica))
    d.put_replica(Replica(replica, agent_id, slot=request.slot))
    agent_record(d, agent_id)
    d.emit("replica-restarted", f"{admission.reason} ({request.reason})", replica=replica)
    d.send(agent_id, pb.ControllerMessage(replica_assigned=pb.ReplicaAssigned(
        slot=request.slot, replica=replica)))


def fill_waiting_slots(d: Draft, why: str) -> None:
    """The job has room again (`why`: a replica lost, an agent drained, more spares): give
    waiting slots their replicas; each joins like a restarted worker."""
    v = d.v
    if v.state in TERMINAL or v.takeover is not None:
        return
    ranks = v.job.ranks_per_replica
    waiting = [WaitingSlot(a.agent_id, slot, spans(a.slots, ranks)) for a in v.agents.values()
               if a.alive and a.agent_id not in v.draining for slot in a.waiting]
    for filled in fill_waiting(waiting, capacity(d), why):
        d.put_replica(Replica(filled.replica, filled.agent_id, slot=filled.slot,
                              satellites=filled.satellites))
        for agent_id in d.v.replicas[filled.replica].agents:
            agent, assigned = d.v.agents[agent_id], assignment(d, filled.replica, agent_id)
            d.change_agent(agent_id, replicas=(*agent.replicas, filled.replica),
                           waiting=tuple(s for s in agent.waiting if s != assigned.slot))
            agent_record(d, agent_id)
            d.send(agent_id, pb.ControllerMessage(replica_assigned=assigned))
        d.emit("slot-filled", filled.reason, replica=filled.replica)


def maybe_start(d: Draft, grace_s: float) -> None:
    counts = d.v.counts
    failed_at = d.v.startup_failed_at
    decision = start_decision(
        ready=counts.ready, live=counts.live, target=d.v.job.replicas,
        min_replicas=d.v.job.min_replicas,
        startup_failure_for_s=None if failed_at is None else d.now - failed_at,
        grace_s=grace_s)
    if decision.start and d.v.takeover is None:
        _start(d, decision.reason)


def _start(d: Draft, why: str) -> None:
    d.set(state=JobState.RUNNING, started_at=d.now)
    v = d.v
    ready = sorted(r for r, info in v.replicas.items() if info.alive and info.ready)
    members, spares = ready[:v.job.replicas], ready[v.job.replicas:]
    decision = d.policy.plan(members, v.job.global_microbatches)
    d.emit("started", f"{why}; {len(members)} members; {decision.reason}")
    # For a new leader's summary: what the workers train is known only from `ready`.
    d.do(effects.SaveWorkload(v.workload))
    new_generation(d, members, decision)
    for agent_id in sorted({d.v.replicas[s].agent_id for s in spares}):
        agent_record(d, agent_id)  # a new leader resumes their joins
    for spare in spares:  # hot spares: they catch up from the first step on
        joinflow.add(d, spare)


def worker_ready(d: Draft, replica: int, ready: pb.Ready, grace_s: float) -> None:
    info = d.v.replicas.get(replica)
    if info is None or not info.alive or info.ready or d.v.state in TERMINAL:
        d.do(effects.Stale())
        return
    d.change_replica(replica, state=ReplicaState.READY, pid=ready.pid,
                     transfer_address=ready.transfer_address,
                     transfer_tls_sha256=ready.transfer_tls_sha256)
    d.emit("replica-ready", f"pid {ready.pid}, params {ready.param_sha256[:12]}",
           replica=replica, pid=ready.pid)
    if not d.v.workload.parameters:
        d.set(workload=ready.workload)
    v = d.v
    mismatch = worker_errors.determinism_mismatch(
        replica, ready.workload.determinism_sha256, v.workload.determinism_sha256)
    exact = v.job.reduce == "exact"
    if mismatch is not None and exact and v.state is JobState.RUNNING:
        # A newcomer (restart, replacement, spare) that would not compute the members'
        # gradients costs itself, never the job: whatever its cause (another torch build
        # on its host, or a forged report), it is stopped before it gets any state.
        d.emit("replica-refused", f"{mismatch}; it does not enter the job", replica=replica,
               level=logging.WARNING)
        retire(d, replica, f"refused: {mismatch}")
        return
    if mismatch is not None and exact:
        fail(d, mismatch)  # at the start: no member yet to tell who is right
        return
    if mismatch is not None:  # fast mode promises no bitwise equality: say it, go on
        d.emit("nondeterminism", mismatch, replica=replica, level=logging.WARNING)
    if v.state is JobState.RUNNING:
        agent_record(d, info.agent_id)  # a new leader resumes the join
        joinflow.add(d, replica)
    else:
        maybe_start(d, grace_s)


def start_timed_out(d: Draft, timeout_s: float, created_at: float) -> None:
    """Fail a job that has not started `timeout_s` after the controller did."""
    v = d.v
    if v.state is not JobState.WAITING or d.now - created_at <= timeout_s:
        return
    ready = sum(r.ready and r.alive for r in v.replicas.values())
    fail(d, f"only {ready} of {v.job.replicas} replicas were ready after {timeout_s:.0f}s "
            f"({len(v.replicas)} hosted by the agents that registered): are the agents "
            "running, or does building the model take longer (--start-timeout)?")
