"""What an operator may do to a running job: stop it, drain a host, change the spares.

Each request is decided by a pure function (table-tested) that says whether and why;
the transitions below carry it out. Stops and drains take
effect at the next step boundary, so the step in flight still sums all its
microbatches and nothing is recorded as a failure: a stopped job writes its summary
(and, when it checkpoints, a checkpoint of where it stopped, to resume from); a
drained agent's replicas leave the membership with the commit, then the agent stops.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Mapping
from dataclasses import dataclass

from recover.controller import effects, membership
from recover.controller.jobstate import TERMINAL, JobState
from recover.controller.transitions import retire, stop_now
from recover.controller.view import Draft, ReplicaState
from recover.proto import pb

MAX_SPARES = 1024


@dataclass(frozen=True)
class Decision:
    accepted: bool
    reason: str


def stop_decision(state: JobState, stopping: str) -> Decision:
    if state in TERMINAL:
        return Decision(False, f"the job is {state} already")
    if stopping:
        return Decision(False, f"a stop is under way already ({stopping})")
    if state is JobState.WAITING:
        return Decision(True, "the job had not started: it stops now")
    return Decision(True, "the job stops once the step in flight commits")


def drain_decision(agent_id: str, *, state: JobState, alive: Mapping[str, bool],
                   hosted_members: Collection[int], members: Collection[int],
                   draining: Collection[str]) -> Decision:
    """May `agent_id`'s replicas leave at the next step boundary? `hosted_members`: those of
    its replicas that are members; `draining`: agents whose drain is under way."""
    if state is not JobState.RUNNING:
        return Decision(False, f"the job is {state}: only a running job drains agents")
    if agent_id not in alive:
        return Decision(False, f"no agent {agent_id!r} in this job (agents: "
                               f"{', '.join(sorted(alive)) or 'none'})")
    if not alive[agent_id]:
        return Decision(False, f"agent {agent_id!r} is gone already")
    if agent_id in draining:
        return Decision(False, f"agent {agent_id!r} is being drained already")
    left = len(set(members) - set(hosted_members))
    if left == 0:
        return Decision(False, f"draining agent {agent_id!r} would leave no member: stop the "
                               "job instead")
    return Decision(True, f"agent {agent_id!r} leaves at the next step boundary with replicas "
                          f"{sorted(hosted_members)}; {left} members go on")


def spares_decision(spares: int, current: int, spare_replicas: list[int]) -> tuple[Decision,
                                                                                    list[int]]:
    """(the decision, the spare replicas to stop: the newest first beyond the new count)."""
    if not 0 <= spares <= MAX_SPARES:
        return Decision(False, f"spares must be between 0 and {MAX_SPARES}, got {spares}"), []
    if spares == current:
        return Decision(True, f"the job keeps {spares} spares already"), []
    extra = sorted(spare_replicas)[spares:] if len(spare_replicas) > spares else []
    if spares > current:
        return Decision(True, f"spares {current} -> {spares}: room for "
                              f"{spares - current} more (agents with free slots may register)"), []
    stopping = f"; stopping spare replicas {extra}" if extra else ""
    return Decision(True, f"spares {current} -> {spares}{stopping}"), extra


def request_stop(d: Draft, by: str, reason: str) -> Decision:
    decision = stop_decision(d.v.state, d.v.stopping)
    if not decision.accepted:
        return decision
    d.set(stopping=f"stopped by {by}" + (f": {reason}" if reason else ""))
    d.emit("stop-requested", f"{d.v.stopping}; {decision.reason}", step=d.v.step)
    if d.v.state is JobState.WAITING:
        stop_now(d)
    return decision


def request_drain(d: Draft, agent_id: str, by: str, reason: str) -> Decision:
    v = d.v
    agent = v.agents.get(agent_id)
    hosted = [r for r in agent.replicas if r in v.members] if agent else []
    decision = drain_decision(agent_id, state=v.state,
                              alive={a.agent_id: a.alive for a in v.agents.values()},
                              hosted_members=hosted, members=v.members, draining=v.draining)
    if decision.accepted:
        d.set(draining=v.draining | {agent_id})
        d.emit("drain-requested", f"by {by}" + (f" ({reason})" if reason else "")
               + f": {decision.reason}", step=v.step)
    return decision


def set_spares(d: Draft, spares: int, by: str) -> Decision:
    decision, extra = spares_decision(spares, d.v.job.spares, d.v.spares)
    if not decision.accepted or spares == d.v.job.spares:
        return decision
    # A new config, stored before it is in force (the old one is never edited in place:
    # messages already built from it keep what they said).
    job = pb.JobConfig()
    job.CopyFrom(d.v.job)
    job.spares = spares
    d.do(effects.SaveJob(job))
    d.set(job=job)
    for replica in extra:
        retire(d, replica, f"spares reduced to {spares} by {by}")
    d.emit("spares-changed", f"by {by}: {decision.reason}", step=d.v.step)
    membership.fill_waiting_slots(d, f"spares set to {spares}")
    return decision


def leaving_at_boundary(d: Draft) -> list[int]:
    """Members of agents being drained: they leave with this commit."""
    return [m for m in d.v.members
            if any(a in d.v.draining for a in d.v.replicas[m].agents)]


def finish_drains(d: Draft) -> None:
    """After the commit that took the drained agents' replicas out: stop those agents."""
    for agent_id in sorted(d.v.draining):
        agent = d.v.agents[agent_id]
        for r in agent.replicas:
            if d.v.replicas[r].alive:
                d.drop_join(r)
                info = d.change_replica(r, state=ReplicaState.RETIRED)
                for other in info.agents:  # a replica spanning agents leaves whole
                    if other != agent_id and d.v.agents[other].alive:
                        d.send(other, pb.ControllerMessage(stop_replica=pb.StopReplica(
                            replica=r, reason=f"its agent {agent_id} was drained")))
        d.change_agent(agent_id, alive=False)
        d.send(agent_id, pb.ControllerMessage(shutdown=pb.Shutdown(
            reason="drained by an operator", success=True, state="drained")))
        d.emit("drained", f"agent {agent_id} left the job", step=d.v.step, level=logging.INFO)
    drained = sorted(d.v.draining)
    d.set(draining=frozenset())
    if drained:
        membership.fill_waiting_slots(d, f"agent{'s' if len(drained) > 1 else ''} "
                                         f"{', '.join(drained)} drained")
