"""What an operator may do to a running job: stop it, drain a host, change the spares.

Each request is decided by a pure function (table-tested) that says whether and why;
the `Operations` mixin of the coordinator carries it out. Stops and drains take
effect at the next step boundary, so the step in flight still sums all its
microbatches and nothing is recorded as a failure: a stopped job writes its summary
(and, when it checkpoints, a checkpoint of where it stopped, to resume from); a
drained agent's replicas leave the membership with the commit, then the agent stops.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from recover.controller.jobstate import TERMINAL, JobState
from recover.proto import pb

if TYPE_CHECKING:
    from recover.controller.coordinator import Coordinator

    _Base = Coordinator
else:
    _Base = object

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


class Operations(_Base):
    stopping: str = ""
    """Why the job stops at the next step boundary (an operator asked); empty otherwise."""

    async def request_stop(self, by: str, reason: str) -> Decision:
        decision = stop_decision(self.state, self.stopping)
        if not decision.accepted:
            return decision
        self.stopping = f"stopped by {by}" + (f": {reason}" if reason else "")
        self.events.emit("stop-requested", f"{self.stopping}; {decision.reason}", step=self.step)
        if self.state is JobState.WAITING:
            await self.stop_now()
        return decision

    async def stop_now(self) -> None:
        self.state = JobState.STOPPED
        self.reason = self.stopping
        self.finished_at = self._clock()
        self.events.emit("stopped", f"{self.reason}; {len(self.steps)} steps committed",
                         step=self.step)
        await self._end(success=False)

    async def request_drain(self, agent_id: str, by: str, reason: str) -> Decision:
        agent = self.agents.get(agent_id)
        hosted = [r for r in agent.replicas if r in self.members] if agent else []
        decision = drain_decision(agent_id, state=self.state,
                                  alive={a.agent_id: a.alive for a in self.agents.values()},
                                  hosted_members=hosted, members=self.members,
                                  draining=self.draining)
        if decision.accepted:
            self.draining.add(agent_id)
            self.events.emit("drain-requested", f"by {by}" + (f" ({reason})" if reason else "")
                             + f": {decision.reason}", step=self.step)
        return decision

    async def set_spares(self, spares: int, by: str) -> Decision:
        decision, extra = spares_decision(spares, self.job.spares, self.joins.spares)
        if not decision.accepted or spares == self.job.spares:
            return decision
        # A new config, stored before it is in force (the old one is never edited in place:
        # messages already built from it keep what they said).
        job = pb.JobConfig()
        job.CopyFrom(self.job)
        job.spares = spares
        await self.records.save_job(job)
        self.job = job
        for replica in extra:
            self._retire(replica, f"spares reduced to {spares} by {by}")
        self.events.emit("spares-changed", f"by {by}: {decision.reason}", step=self.step)
        return decision

    def _retire(self, replica: int, why: str) -> None:
        """A replica leaves without a failure: forgotten first, so its exit is no loss."""
        info = self.replicas[replica]
        info.alive = False
        self.joins.forget(replica)
        self._send(info.agent_id, pb.ControllerMessage(
            stop_replica=pb.StopReplica(replica=replica, reason=why)))

    def leaving_at_boundary(self) -> list[int]:
        """Members of agents being drained: they leave with this commit."""
        return [m for m in self.members if self.replicas[m].agent_id in self.draining]

    async def finish_drains(self) -> None:
        """After the commit that took the drained agents' replicas out: stop those agents."""
        for agent_id in sorted(self.draining):
            agent = self.agents[agent_id]
            for r in agent.replicas:
                if self.replicas[r].alive:
                    self.replicas[r].alive = False
                    self.joins.forget(r)
            agent.alive = False
            self._send(agent_id, pb.ControllerMessage(shutdown=pb.Shutdown(
                reason="drained by an operator", success=True, state="drained")))
            self.events.emit("drained", f"agent {agent_id} left the job", step=self.step,
                             level=logging.INFO)
        self.draining.clear()
