"""A new leader's first moments, as transitions: rebuild the job's view from the store,
let the agents rejoin, carry on.

The old leader wrote everything a successor needs before acting on it: the
job, each agent's replicas, every generation view before broadcasting it,
every step record (with the plan the workers hold next) before broadcasting its
commit. So the successor knows the committed steps, the last generation (its
members and the plan of the step in flight) and who hosts which replica. It does not
know which messages the old leader queued but never delivered; the takeover makes
that moot:

1. wait (bounded by the agent timeout) for the agents hosting live members
   to rejoin; their workers never stopped. The missing ones are lost.
2. re-send the commit of the last committed step: a worker still waiting for
   it applies it; the agents drop it for workers that already did.
3. start a new generation for the step in flight with the plan the workers
   hold (survivors keep what they accumulated; a lost replica's microbatches
   are reassigned), so the step still sums the same M microbatches.

The same leader takes back an agent whose session ended while it lived (its relay died)
the same way, in small (`reattach`).
"""

from __future__ import annotations

import logging

from recover.controller import joinflow, losses, membership, policy
from recover.controller.jobstate import JobState, RegistrationRefused, RejoinUnexpected
from recover.controller.records import PersistedJob
from recover.controller.transitions import (
    broadcast,
    fail,
    lose_replica,
    maybe_finish,
    new_generation,
    record_failure,
)
from recover.controller.view import Agent, Draft, JobView, Replica, ReplicaState, TakeoverWait
from recover.proto import pb


def resume_plan(persisted: PersistedJob, committed: int, survivors: list[int],
                global_microbatches: int, plans: policy.PlanPolicy) -> policy.PlanDecision:
    """The plan of step `committed` for a new leader's first generation.

    The workers hold the plan of the last view if it is for that step, else the one the
    last commit handed them (stored with it): survivors keep their microbatches (they
    may have accumulated them already); a lost member's are reassigned by the policy. Only
    when no plan of that step was ever handed out (the commit before it expected a new
    generation at the boundary) does the policy plan it afresh.
    """
    assert persisted.view is not None
    members = list(persisted.view.members)
    held, source = persisted.plan_held_for(committed)
    if held is None:
        decision = plans.plan(survivors, global_microbatches)
        return policy.PlanDecision(decision.assignment, f"takeover: {source}; {decision.reason}")
    assignment = {a.replica: tuple(a.microbatch_ids) for a in held.assignments}
    lost = [m for m in members if m not in survivors]
    if not lost:
        return policy.PlanDecision(assignment, f"takeover: members keep {source}")
    decision = plans.reassign(assignment, lost, survivors)
    return policy.PlanDecision(decision.assignment, f"takeover from {source}; {decision.reason}")


def ledger(persisted: PersistedJob,
           resumed_ledger: list[pb.StepRecord] | None) -> list[pb.StepRecord]:
    """The committed steps: for a job resumed from a checkpoint, the checkpoint's ledger
    before the store's. A resumed job's first commit rewrites the checkpoint's last record
    (digests ride along with the next write): the store's copy is the newer one."""
    by_step = {r.step: r for r in [*(resumed_ledger or []), *persisted.steps]}
    return [by_step[s] for s in sorted(by_step)]


def restore(d: Draft, persisted: PersistedJob, steps: list[pb.StepRecord],
            deadline: float) -> None:
    """The view a new leader starts from (`d` holds an empty view of the job), waiting
    until `deadline` for the agents to rejoin."""
    view = persisted.view
    members = set(view.members) if view is not None else set()
    joiners: set[int] = set()
    satellites: dict[int, list[tuple[int, str]]] = {}
    for record in persisted.agents:
        ids = tuple(record.replica_ids)
        d.put_agent(Agent(record.agent_id, record.host, ids, alive=False,
                          subject=record.subject, waiting=tuple(record.waiting_slots),
                          slots=record.slots, peer=record.peer,
                          store_port=record.replica_store_port))
        for r in ids:
            if record.first_ranks.get(r, 0):  # holds later ranks of a replica spanning agents
                satellites.setdefault(r, []).append((record.first_ranks[r], record.agent_id))
                continue
            joining = view is not None and r not in members and r in record.join_addresses
            if joining:
                joiners.add(r)
            state = (ReplicaState.ASSIGNED if view is None else ReplicaState.MEMBER
                     if r in members else ReplicaState.READY if joining else ReplicaState.LOST)
            d.put_replica(Replica(r, record.agent_id, state=state,
                                  transfer_address=record.join_addresses.get(r, ""),
                                  transfer_tls_sha256=record.join_tls_sha256.get(r, "")))
    for r, parts in satellites.items():
        if r in d.v.replicas:
            d.change_replica(r, satellites=tuple(agent_id for _, agent_id in sorted(parts)))
    expected = {a.agent_id for a in persisted.agents
                if view is None or members & set(a.replica_ids)}
    expected |= {a for r in joiners for a in d.v.replicas[r].agents}
    step = steps[-1].step + 1 if steps else 0
    d.set(step=step)
    if persisted.job is not None and persisted.job.spares != d.v.job.spares:
        job = pb.JobConfig()  # an operator changed the spares under the old leader
        job.CopyFrom(d.v.job)
        job.spares = persisted.job.spares
        d.set(job=job)
    if persisted.workload is not None:
        d.set(workload=persisted.workload)
    started = next((e.at for e in persisted.events if e.kind == "started"), 0.0)
    d.set(recoveries=len({f.generation for f in persisted.failures}),
          started_at=started or (steps[0].committed_at if steps else 0.0))
    if persisted.result is not None:
        result = persisted.result
        d.set(state=(JobState(result.state) if result.state else
                     JobState.SUCCEEDED if result.success else JobState.FAILED),
              reason=result.reason, finished_at=steps[-1].committed_at if steps else d.now)
        expected = set()
    elif view is not None:
        # The plan the members work on while their agents rejoin: their reports of the
        # step in flight are checked against it (reports.unplanned_ids).
        held, _ = persisted.plan_held_for(step)
        d.set(state=JobState.RUNNING, generation=view.generation, members=tuple(view.members),
              scale_epoch=view.plan.scale_epoch if view.plan.step == step else 0,
              plan={} if held is None else {a.replica: tuple(a.microbatch_ids)
                                            for a in held.assignments})
    d.set(takeover=TakeoverWait(persisted, deadline, frozenset(expected),
                                joiners=frozenset(joiners)))
    d.emit("takeover", f"rebuilt from the store: {step} steps committed, generation "
           f"{d.v.generation}, members {list(d.v.members)}; waiting for {len(expected)} "
           "agents to rejoin", step=step, generation=d.v.generation)


def rejoin(d: Draft, agent_id: str, host: str, replicas: list[int], peer: str = "",
           seen_generation: int = 0) -> list[int]:
    """An agent whose workers kept running reconnects; returns its replica ids."""
    wait = d.v.takeover
    known = d.v.agents.get(agent_id)
    if wait is None and known is not None and known.alive:  # this leader never gave it up
        return reattach(d, agent_id, host, replicas, peer, seen_generation)
    if wait is None:
        raise RejoinUnexpected(f"agent {agent_id!r} cannot rejoin: this leader has run "
                               "the job since it started and did not expect it")
    agent = d.v.agents.get(agent_id)
    if agent is None:
        raise RegistrationRefused(f"agent {agent_id!r} is not part of job {d.v.job.job_id}")
    if agent.alive:
        raise RegistrationRefused(f"agent {agent_id!r} has already rejoined")
    if agent_id not in wait.expected:
        raise RegistrationRefused(f"agent {agent_id!r} hosts no live replica of this job")
    d.change_agent(agent_id, alive=True, host=host, peer=peer or agent.peer)
    for r in agent.replicas:
        if r not in replicas and d.v.replicas[r].alive:
            lose_replica(d, r)  # its worker died while no leader listened
            record_failure(d, r, "external", None, phase="takeover")
            if wait.persisted.view is None:  # the start waits a grace for its replacement
                d.set(startup_failed_at=d.now)
    d.set(takeover=TakeoverWait(wait.persisted, wait.deadline, wait.expected,
                                wait.rejoined | {agent_id}, wait.joiners))
    d.emit("agent-rejoined", f"agent {agent_id} on {host}: replicas {replicas} kept running",
           step=d.v.step, generation=d.v.generation)
    d.send(agent_id, pb.ControllerMessage(
        registered=pb.Registered(replica_ids=agent.replicas, job=d.v.job)))
    return list(agent.replicas)


def last_commit(d: Draft) -> pb.Commit | None:
    """The commit of the ledger's last step, to send again (a worker still waiting for it
    applies it; agents drop it for workers that already did)."""
    record = d.facts.last_record
    if record is None:
        return None
    commit = pb.Commit(step=record.step, generation=record.generation,
                       final=d.v.step >= d.v.job.steps, microbatches=record.microbatches,
                       tokens=record.tokens, record=record)
    commit.record.ClearField("sample_ids")  # as at the first send: workers keep the digest
    return commit


def reattach(d: Draft, agent_id: str, host: str, replicas: list[int], peer: str,
             seen_generation: int) -> list[int]:
    """An agent this leader has not given up comes back on a new session: its relay died,
    or its link to the leader broke, while its workers trained on (their collectives do not
    pass through the control plane). Nothing is lost: replicas it no longer runs are. What
    either side sent meanwhile may be gone (the leader's messages went nowhere; its workers'
    reports may have died in the old relay), so, as after a takeover, it gets the last
    commit again and every member a new generation with the plan they hold: they keep what
    they accumulated and report the step anew. Correctness does not depend on which
    reports made it."""
    agent = d.v.agents[agent_id]
    d.change_agent(agent_id, host=host, peer=peer or agent.peer)
    d.emit("agent-reattached", f"agent {agent_id} on {host}: replicas {replicas} kept running "
           f"(it had seen generation {seen_generation})", step=d.v.step,
           generation=d.v.generation)
    d.send(agent_id, pb.ControllerMessage(
        registered=pb.Registered(replica_ids=agent.replicas, job=d.v.job)))
    commit = last_commit(d)
    if commit is not None and d.v.state is JobState.RUNNING:
        d.send(agent_id, pb.ControllerMessage(commit=commit))
    gone = [r for r in d.v.live(agent.replicas) if r not in replicas]
    for r in gone:
        record_failure(d, r, "external", None)
    generation = d.v.generation
    if gone:  # its workers died while it had no session (a member's loss: a new generation)
        losses.lose(d, gone, f"agent {agent_id} came back without replicas {gone}")
    if d.v.generation == generation and d.v.state is JobState.RUNNING \
            and d.v.step < d.v.job.steps and set(d.v.live(agent.replicas)) & set(d.v.members):
        missed = f" (it missed generation {d.v.generation})" \
            if seen_generation < d.v.generation else ""
        new_generation(d, d.v.live(d.v.members), policy.PlanDecision(
            dict(d.v.plan), f"agent {agent_id} came back on a new session{missed}: members "
                            "keep their plan and report the step anew"))
    return list(agent.replicas)


def ready_to_finish(view: JobView, now: float) -> bool:
    wait = view.takeover
    return wait is not None and (wait.rejoined >= wait.expected or now >= wait.deadline)


def finish(d: Draft) -> None:
    """Every expected agent rejoined (or the wait ran out): carry on with the job."""
    wait = d.v.takeover
    assert wait is not None
    view = wait.persisted.view
    d.set(takeover=None)
    if wait.persisted.result is not None:
        return  # the job is over: nothing to carry on
    missing = sorted(wait.expected - wait.rejoined)
    lost = []
    for agent_id in missing:
        for r in d.v.agents[agent_id].replicas:
            if d.v.replicas[r].alive:
                lose_replica(d, r)
                lost.append(r)
                record_failure(d, r, "agent-lost", None, phase="takeover")
    if missing and view is None:
        d.set(startup_failed_at=d.now)
    if missing:
        d.emit("agent-lost", f"agents {missing} did not rejoin the new leader",
               level=logging.WARNING)
    if view is None:
        return  # not started: the usual start (every replica ready) takes it from here
    commit = last_commit(d)
    if commit is not None:
        broadcast(d, pb.ControllerMessage(commit=commit))
    survivors = d.v.live(view.members)
    if not survivors:
        fail(d, f"no replica rejoined the new leader (expected agents {sorted(wait.expected)})")
        return
    d.set(members=tuple(survivors))
    if d.v.step >= d.v.job.steps:
        maybe_finish(d)
        return
    if [r for r in lost if r in view.members]:  # a lost joiner costs the step nothing
        d.set(recoveries=d.v.recoveries + 1)
    decision = resume_plan(wait.persisted, d.v.step, survivors, d.v.job.global_microbatches,
                           d.policy)
    new_generation(d, survivors, decision)
    for r in sorted(wait.joiners):
        if d.v.replicas[r].alive:
            joinflow.add(d, r)  # anew: this leader knows nothing of the old attempt
    if lost:
        membership.fill_waiting_slots(d, "replicas lost in the leader change")
