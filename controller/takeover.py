"""A new leader's first moments: rebuild the job from the store, let the agents rejoin.

The old leader wrote everything a successor needs before acting on it: the
job, each agent's replicas, every generation view before broadcasting it,
every step record before broadcasting its commit. So the successor knows
the committed steps, the last generation (its members and the plan of the
step in flight) and who hosts which replica. It does not know which messages
the old leader queued but never delivered; the takeover makes that moot:

1. wait (bounded by the agent timeout) for the agents hosting live members
   to rejoin; their workers never stopped. The missing ones are lost.
2. re-send the commit of the last committed step: a worker still waiting for
   it applies it; the agents drop it for workers that already did.
3. start a new generation for the step in flight with the plan the workers
   hold (survivors keep what they accumulated; a lost replica's microbatches
   are reassigned), so the step still sums the same M microbatches.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from recover.controller import policy
from recover.controller.jobstate import AgentInfo, JobState, RegistrationRefused, ReplicaInfo
from recover.controller.records import PersistedJob
from recover.proto import pb

if TYPE_CHECKING:
    from recover.controller.coordinator import Coordinator

log = logging.getLogger("recover.controller")


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


class Takeover:
    """Restores a coordinator from the store and runs the rejoin of the agents."""

    def __init__(self, coordinator: Coordinator, persisted: PersistedJob, deadline: float,
                 resumed_ledger: list[pb.StepRecord] | None = None) -> None:
        """`resumed_ledger`: for a job resumed from a checkpoint, the steps before it
        (the store holds only the steps this job committed itself)."""
        self.c = coordinator
        self.persisted = persisted
        self.deadline = deadline
        c, view = coordinator, persisted.view
        now = c.now()
        members = set(view.members) if view is not None else set()
        self.joiners: dict[int, str] = {}
        """Replicas that were joining (or spares) when the old leader went: their joins
        start over once their agents rejoin."""
        for record in persisted.agents:
            ids = list(record.replica_ids)
            c.agents[record.agent_id] = AgentInfo(record.agent_id, record.host, ids, now,
                                                  alive=False, subject=record.subject)
            for r in ids:
                joining = view is not None and r not in members and r in record.join_addresses
                if joining:
                    self.joiners[r] = record.join_addresses[r]
                c.replicas[r] = ReplicaInfo(r, record.agent_id, ready=view is not None,
                                            alive=view is None or r in members or joining,
                                            transfer_address=record.join_addresses.get(r, ""))
        self.expected = {a.agent_id for a in persisted.agents
                         if view is None or members & set(a.replica_ids)}
        self.expected |= {c.replicas[r].agent_id for r in self.joiners}
        """Agents whose rejoin the takeover waits for: those hosting members or joiners."""
        self.rejoined: set[str] = set()
        # A resumed job's first commit rewrites the checkpoint's last record (digests ride
        # along with the next write): the store's copy is the newer one.
        by_step = {r.step: r for r in [*(resumed_ledger or []), *persisted.steps]}
        c.steps = [by_step[s] for s in sorted(by_step)]
        c.step = c.steps[-1].step + 1 if c.steps else 0
        if persisted.job is not None and persisted.job.spares != c.job.spares:
            job = pb.JobConfig()  # an operator changed the spares under the old leader
            job.CopyFrom(c.job)
            job.spares = persisted.job.spares
            c.job = job
        if persisted.workload is not None:
            c.workload.CopyFrom(persisted.workload)
        c.recovery.failures = list(persisted.failures)
        c.recoveries = len({f.generation for f in c.failures})
        c.events.restore(persisted.events)
        started = next((e.at for e in persisted.events if e.kind == "started"), 0.0)
        c.started_at = started or (c.steps[0].committed_at if c.steps else 0.0)
        if persisted.result is not None:
            self.expected = set()
            result = persisted.result
            c.state = (JobState(result.state) if result.state else
                       JobState.SUCCEEDED if result.success else JobState.FAILED)
            c.reason = persisted.result.reason
            c.finished_at = c.steps[-1].committed_at if c.steps else now
            c.done.set()
        elif view is not None:
            c.state = JobState.RUNNING
            c.generation = view.generation
            c.members = list(view.members)
            c.scale_epoch = view.plan.scale_epoch if view.plan.step == c.step else 0
            # The plan the members work on while their agents rejoin: their reports of the
            # step in flight are checked against it (reports.unplanned_ids).
            held, _ = persisted.plan_held_for(c.step)
            c.plan = {} if held is None else {a.replica: tuple(a.microbatch_ids)
                                              for a in held.assignments}
        c.events.emit("takeover", f"rebuilt from the store: {c.step} steps committed, generation "
                      f"{c.generation}, members {c.members}; waiting for "
                      f"{len(self.expected)} agents to rejoin", step=c.step, generation=c.generation)

    async def rejoin(self, agent_id: str, host: str, replicas: list[int]) -> list[int]:
        """An agent whose workers kept running reconnects; returns its replica ids."""
        c = self.c
        agent = c.agents.get(agent_id)
        if agent is None:
            raise RegistrationRefused(f"agent {agent_id!r} is not part of job {c.job.job_id}")
        if agent.alive:
            raise RegistrationRefused(f"agent {agent_id!r} has already rejoined")
        if agent_id not in self.expected:
            raise RegistrationRefused(f"agent {agent_id!r} hosts no live replica of this job")
        agent.alive, agent.host, agent.last_heartbeat = True, host, c.now()
        for r in agent.replicas:
            if r not in replicas and c.replicas[r].alive:
                c.replicas[r].alive = False  # its worker died while no leader listened
                c.record_failure(r, "external", None, phase="takeover")
                if self.persisted.view is None:  # the start waits a grace for its replacement
                    c.startup_failed_at = c.now()
        self.rejoined.add(agent_id)
        c.events.emit("agent-rejoined", f"agent {agent_id} on {host}: replicas {replicas} kept "
                      "running", step=c.step, generation=c.generation)
        c.send_to(agent_id, pb.ControllerMessage(
            registered=pb.Registered(replica_ids=agent.replicas, job=c.job)))
        return list(agent.replicas)

    def ready_to_finish(self) -> bool:
        return self.rejoined >= self.expected or self.c.now() >= self.deadline

    async def finish(self) -> None:
        """Every expected agent rejoined (or the wait ran out): carry on with the job."""
        c, view = self.c, self.persisted.view
        c.takeover = None
        if self.persisted.result is not None:
            return  # the job is over: nothing to carry on
        missing = sorted(self.expected - self.rejoined)
        lost = []
        for agent_id in missing:
            for r in c.agents[agent_id].replicas:
                if c.replicas[r].alive:
                    c.replicas[r].alive = False
                    lost.append(r)
                    c.record_failure(r, "agent-lost", None, phase="takeover")
        if missing and view is None:
            c.startup_failed_at = c.now()
        if missing:
            c.events.emit("agent-lost", f"agents {missing} did not rejoin the new leader",
                          level=logging.WARNING)
        if view is None:
            return  # not started: the usual start (every replica ready) takes it from here
        if c.steps:
            last = c.steps[-1]
            commit = pb.Commit(step=last.step, generation=last.generation,
                               final=c.step >= c.job.steps, microbatches=last.microbatches,
                               tokens=last.tokens, record=last)
            commit.record.ClearField("sample_ids")  # as at the first send: workers keep the digest
            c.broadcast(pb.ControllerMessage(commit=commit))
        survivors = [m for m in view.members if c.replicas[m].alive]
        if not survivors:
            await c.fail(f"no replica rejoined the new leader (expected agents {sorted(self.expected)})")
            return
        c.members = survivors
        if c.step >= c.job.steps:
            await c.maybe_finish()
            return
        lost = [r for r in lost if r in view.members]  # a lost joiner costs the step nothing
        if lost:
            c.recoveries += 1
        decision = resume_plan(self.persisted, c.step, survivors, c.job.global_microbatches,
                               c.policy)
        c.plan = dict(decision.assignment)
        await c.new_generation(survivors, decision)
        for r, address in sorted(self.joiners.items()):
            if c.replicas[r].alive:
                c.joins.add(r, address)  # anew: this leader knows nothing of the old attempt
