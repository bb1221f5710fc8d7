"""Who is in the job: agents registering and getting lost, workers becoming ready, dying
and being replaced, and when the job starts. Part of the coordinator (a mixin: the job's
state stays in the one `Coordinator` object), kept apart from the step protocol.

A replica's life: assigned to an agent's slot -> ready -> a member of a generation
(at the start, or after a join: joinflow.py) -> lost. A lost replica's id is never
reused: its agent asks for a new one on the same slot (a restart), and the new
replica joins with live state transfer.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from recover.controller import worker_errors
from recover.controller.admission import (
    Capacity,
    admit_agent,
    admit_replacement,
    start_decision,
)
from recover.controller.jobstate import (
    TERMINAL,
    AgentInfo,
    JobState,
    RegistrationRefused,
    ReplicaInfo,
)
from recover.proto import pb

if TYPE_CHECKING:
    from recover.controller.coordinator import Coordinator

    _Base = Coordinator
else:
    _Base = object


class Membership(_Base):
    start_timeout_s: float = 120.0
    """Fail the job if it has not started this long after the controller did."""
    start_grace_s: float = 10.0
    """After a worker failed during startup: how long its replacement gets before the job
    starts with fewer replicas (at least the job's min_replicas)."""

    def _capacity(self) -> Capacity:
        known = list(self.replicas)  # lost ones included: ids are never reused
        return Capacity(wanted=self.job.replicas + self.job.spares,
                        live=sum(r.alive for r in self.replicas.values()),
                        next_id=max(known, default=-1) + 1)

    async def _persist_agent(self, agent: AgentInfo) -> None:
        # Before the agent learns its replicas: a new leader must know who hosts them.
        record = pb.AgentRecord(agent_id=agent.agent_id, host=agent.host,
                                replica_ids=agent.replicas, subject=agent.subject)
        for r in agent.replicas:
            info = self.replicas.get(r)
            if info is not None and info.alive and info.transfer_address:
                record.join_addresses[r] = info.transfer_address
        await self.records.save_agent(self.job, record)

    async def register_agent(self, agent_id: str, host: str, slots: int,
                             resume: list[int] | None = None, subject: str = "") -> list[int]:
        """A new agent joins (`resume` None), or one whose workers kept running rejoins a new leader."""
        if resume is not None:
            if self.takeover is None:
                raise RegistrationRefused(f"agent {agent_id!r} cannot rejoin: this leader has run "
                                          "the job since it started and did not expect it")
            ids = await self.takeover.rejoin(agent_id, host, resume)
            await self._maybe_end_takeover()
            return ids
        admission = admit_agent(
            agent_id, host, slots, job_id=self.job.job_id, job_state=self.state,
            taking_over=self.takeover is not None and self.takeover.persisted.view is not None,
            known_agents=self.agents.keys(), capacity=self._capacity())
        if not admission.admitted:
            raise RegistrationRefused(admission.reason)
        ids = list(admission.replica_ids)
        agent = self.agents[agent_id] = AgentInfo(agent_id, host, ids, self._clock(),
                                                  subject=subject)
        for slot, replica in enumerate(ids):
            self.replicas[replica] = ReplicaInfo(replica, agent_id, slot=slot)
        await self._persist_agent(agent)
        self.events.emit("agent-registered", admission.reason)
        self._send(agent_id, pb.ControllerMessage(
            registered=pb.Registered(replica_ids=ids, job=self.job)))
        return ids

    async def replica_request(self, agent_id: str, request: pb.ReplicaRequest) -> None:
        """An agent's worker died and may be restarted on its slot: a fresh replica id."""
        agent = self.agents.get(agent_id)
        admission = admit_replacement(
            agent_id, request.slot, agent_alive=agent is not None and agent.alive,
            job_id=self.job.job_id, job_state=self.state,
            taking_over=self.takeover is not None, capacity=self._capacity())
        if agent is None or not admission.admitted:
            self._send(agent_id, pb.ControllerMessage(replica_assigned=pb.ReplicaAssigned(
                slot=request.slot, refused=admission.reason,
                retryable=self.takeover is not None)))
            return
        replica = admission.replica_ids[0]
        agent.replicas.append(replica)
        self.replicas[replica] = ReplicaInfo(replica, agent_id, slot=request.slot)
        await self._persist_agent(agent)
        self.events.emit("replica-restarted", f"{admission.reason} ({request.reason})",
                         replica=replica)
        self._send(agent_id, pb.ControllerMessage(replica_assigned=pb.ReplicaAssigned(
            slot=request.slot, replica=replica)))

    async def _maybe_end_takeover(self) -> None:
        if self.takeover is not None and self.takeover.ready_to_finish():
            await self.takeover.finish()

    def heartbeat(self, agent_id: str) -> None:
        agent = self.agents.get(agent_id)
        if agent is not None:
            agent.last_heartbeat = self._clock()

    async def agent_lost(self, agent_id: str, why: str) -> None:
        agent = self.agents.get(agent_id)
        if agent is None or not agent.alive:
            return
        agent.alive = False
        if self.state in TERMINAL:
            return
        self.events.emit("agent-lost", f"agent {agent_id}: {why}", level=logging.WARNING)
        # Fencing: should the host wake up (it was only stopped, or cut off), it
        # must stop its workers rather than act on a membership it is no longer in.
        self._send(agent_id, pb.ControllerMessage(shutdown=pb.Shutdown(
            reason=f"this agent was declared lost ({why})", success=False)))
        lost = [r for r in agent.replicas if self.replicas[r].alive]
        for replica in lost:
            self.record_failure(replica, "agent-lost", None)
        if self.state is JobState.WAITING and lost:
            self.startup_failed_at = self._clock()
        await self._lose(lost, f"agent {agent_id} lost ({why})")

    async def check_liveness(self) -> None:
        """Declare agents whose heartbeats went silent lost; start a job that waited for a
        failed worker's replacement long enough; find donors for waiting joins."""
        await self._maybe_end_takeover()
        now = self._clock()
        for agent in list(self.agents.values()):
            silent = now - agent.last_heartbeat
            if agent.alive and silent > self._agent_timeout_s:
                await self.agent_lost(agent.agent_id, f"no heartbeat for {silent:.1f}s")
        if self.state is JobState.WAITING:
            await self._maybe_start()
        if self.state is JobState.WAITING and now - self.created_at > self.start_timeout_s:
            ready = sum(r.ready and r.alive for r in self.replicas.values())
            await self.fail(
                f"only {ready} of {self.job.replicas} replicas were ready after "
                f"{self.start_timeout_s:.0f}s ({len(self.replicas)} hosted by the agents that "
                "registered): are the agents running, or does building the model take longer "
                "(--start-timeout)?")
        if self.state is JobState.RUNNING:
            self.joins.retry_waiting()

    async def _maybe_start(self) -> None:
        live = [r for r in self.replicas.values() if r.alive]
        failed_at = self.startup_failed_at
        decision = start_decision(
            ready=sum(r.ready for r in live), live=len(live), target=self.job.replicas,
            min_replicas=self.job.min_replicas,
            startup_failure_for_s=None if failed_at is None else self._clock() - failed_at,
            grace_s=self.start_grace_s)
        if decision.start and self.takeover is None:
            await self._start(decision.reason)

    async def worker_ready(self, replica: int, ready: pb.Ready) -> None:
        info = self.replicas.get(replica)
        if info is None or not info.alive or info.ready or self.state in TERMINAL:
            self.stale_reports += 1
            return
        info.ready, info.pid, info.transfer_address = True, ready.pid, ready.transfer_address
        self.events.emit("replica-ready", f"pid {ready.pid}, params {ready.param_sha256[:12]}",
                         replica=replica)
        if not self.workload.parameters:
            self.workload.CopyFrom(ready.workload)
        mismatch = worker_errors.determinism_mismatch(
            replica, ready.workload.determinism_sha256, self.workload.determinism_sha256)
        if mismatch is not None and self.job.reduce == "exact" and self.state is JobState.RUNNING:
            # A newcomer (restart, replacement, spare) that would not compute the members'
            # gradients costs itself, never the job: whatever its cause (another torch build
            # on its host, or a forged report), it is stopped before it gets any state.
            self.events.emit("replica-refused", f"{mismatch}; it does not enter the job",
                             replica=replica, level=logging.WARNING)
            self._retire(replica, f"refused: {mismatch}")
            return
        if mismatch is not None and self.job.reduce == "exact":
            await self.fail(mismatch)  # at the start: no member yet to tell who is right
            return
        if mismatch is not None:  # fast mode promises no bitwise equality: say it, go on
            self.events.emit("nondeterminism", mismatch, replica=replica, level=logging.WARNING)
        if self.state is JobState.RUNNING:
            await self._persist_agent(self.agents[info.agent_id])  # a new leader resumes the join
            self.joins.add(replica, ready.transfer_address)
        else:
            await self._maybe_start()

    async def worker_lost(self, replica: int, why: str) -> None:
        """A replica that cannot go on though its process lives: stop it, recover without it."""
        await self.members_lost([replica], why)

    async def members_lost(self, replicas: list[int], why: str, cause: str = "external") -> None:
        """Replicas that cannot go on though their processes live (one that lost its donor,
        one whose report contradicts its plan or the others): stop them, and recover
        without them in one new generation."""
        lost = [r for r in replicas if r in self.replicas and self.replicas[r].alive]
        for replica in lost:
            self.record_failure(replica, cause, None)
            self._send(self.replicas[replica].agent_id, pb.ControllerMessage(
                stop_replica=pb.StopReplica(replica=replica, reason=why)))
        if lost:
            await self._lose(lost, why)

    async def worker_exited(self, exited: pb.WorkerExited) -> None:
        info = self.replicas.get(exited.replica)
        if info is None or not info.alive:
            return
        verdict = worker_errors.judge_exit(exited, training=self.state is not JobState.WAITING,
                                           earlier_errors=self._errors)
        for key in worker_errors.error_keys(exited.error) if exited.HasField("error") else ():
            self._errors.setdefault(key, exited.replica)
        member = exited.replica in self.members
        self.record_failure(exited.replica, worker_errors.failure_cause(exited), exited,
                            phase="" if member or self.state is JobState.WAITING else "join")
        if verdict.fatal:
            info.alive = False
            await self.fail(verdict.reason)
            return
        if self.state is JobState.WAITING:
            self.startup_failed_at = self._clock()
        await self._lose([exited.replica], verdict.reason)
