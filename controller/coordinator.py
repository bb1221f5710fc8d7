"""The controller's brain: membership, generations, per-step plans, commits.

Single-threaded by construction: the gRPC layer calls one method at a time
(under a lock) and hands the coordinator a `send(agent_id, message)`
function; the coordinator never touches sockets, which keeps it testable
without a network.

Commit protocol (DESIGN.md, layer 2): a step commits only when every member
of the current generation reported "step t reduced in generation g"; the
record is written to the store *before* the members are told to apply it. A
failure before that makes a new generation in which the survivors keep their
accumulated microbatches, take the lost ones, and reduce again.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import Callable

from recover.controller import policy, reports, worker_errors
from recover.controller.events import EventLog
from recover.controller.jobstate import (
    TERMINAL,
    AgentInfo,
    JobState,
    ReplicaInfo,
    StepProgress,
    plan_message,
    step_record,
)
from recover.controller.joinflow import JoinFlow
from recover.controller.membership import Membership
from recover.controller.operations import Operations
from recover.controller.records import PersistedJob, Records
from recover.controller.recoveries import RecoveryTracker, observed_phase
from recover.controller.store import Store
from recover.controller.takeover import Takeover
from recover.proto import pb

log = logging.getLogger("recover.controller")

Send = Callable[[str, pb.ControllerMessage], None]


class Coordinator(Membership, Operations):
    def __init__(
        self,
        job: pb.JobConfig,
        store: Store,
        send: Send,
        rendezvous: str,
        *,
        agent_timeout_s: float = 3.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.job = job
        self.records = Records(store, job.job_id)
        self.policy = policy.policy_for(job.policy)
        """Who computes which microbatches (the job's `policy`)."""
        self._send = send
        self._rendezvous = rendezvous
        self._agent_timeout_s = agent_timeout_s
        self._clock = clock
        self.events = EventLog(self.records, clock)
        self.state = JobState.WAITING
        self.reason = ""
        self.agents: dict[str, AgentInfo] = {}
        self.replicas: dict[int, ReplicaInfo] = {}
        self.generation = 0
        self.members: list[int] = []
        self.step = 0
        self.plan: dict[int, tuple[int, ...]] = {}
        self.scale_epoch = 0
        """Exact reduction: overflow redos of the current step so far."""
        self.redos = 0
        self._progress = StepProgress()
        self.steps: list[pb.StepRecord] = []
        self.recovery = RecoveryTracker(self.events, self.records, clock)
        self.recoveries = 0
        self.stale_reports = 0
        self._commit_waits: dict[int, list[float]] = {}
        self.created_at = clock()
        self.started_at = 0.0
        self.finished_at = 0.0
        self.done = asyncio.Event()
        self._ending: asyncio.Future[None] | None = None
        """The end being announced (held so the shielded task is not collected)."""
        self.takeover: Takeover | None = None
        """Set while a new leader waits for the agents to rejoin (see takeover.py)."""
        self.workload = pb.WorkloadInfo()
        """What the workers train, from the first `ready` report."""
        self._errors: dict[worker_errors.ErrorKey, int] = {}
        """Errors in the user's code so far, and the replica that reported each first."""
        self.joins = JoinFlow(self)
        """Replicas joining the running job (restarts, replacement hosts, hot spares)."""
        self.last_checkpoint: pb.CheckpointWritten | None = None
        self.rejected: dict[str, int] = {}
        """Refused registrations, reports and calls, by reason (controller/authz.py)."""
        self.startup_failed_at: float | None = None
        """When a worker last failed before the job started (admission.start_decision)."""
        self.stopping = ""
        """Why the job stops at the next step boundary (an operator's stop: operations.py)."""
        self.stop_pending = False
        """The step the stop waited for is committed; the job stops once it is acknowledged."""
        self.draining: set[str] = set()
        """Agents whose replicas leave at the next step boundary (an operator's drain)."""

    def restore(self, persisted: PersistedJob,
                resumed_from: pb.CheckpointMeta | None = None) -> None:
        """Take over from a previous leader: rebuild the job's state from what it persisted
        (and, for a job resumed from a checkpoint, the ledger of the steps before it)."""
        # The agents notice the old leader's silence about when we win the
        # election; give them their own timeout and then some to rejoin.
        ledger = list(resumed_from.ledger) if resumed_from is not None else None
        self.takeover = Takeover(self, persisted, self._clock() + 2 * self._agent_timeout_s,
                                 resumed_ledger=ledger)

    def checkpoint_written(self, replica: int, written: pb.CheckpointWritten) -> None:
        if written.error:
            self.events.emit("checkpoint-failed", f"the checkpoint of step {written.step} was "
                             f"not written: {written.error}", step=written.step, replica=replica,
                             level=logging.WARNING)
            return
        self.last_checkpoint = written
        self.events.emit("checkpoint-written", f"{written.path}: {written.bytes} bytes written in "
                         f"{written.write_s:.2f}s in the background ({written.snapshot_s * 1000:.1f}"
                         " ms copying at the step boundary)", step=written.step, replica=replica)

    def resume_from(self, checkpoint: pb.CheckpointMeta) -> None:
        """Start from a checkpoint's step, its ledger as the steps committed before it."""
        self.steps = list(checkpoint.ledger)
        self.step = checkpoint.step
        self.events.emit("resumed", f"from the checkpoint of step {checkpoint.step} "
                         f"({len(self.steps)} steps in its ledger)", step=checkpoint.step)

    @property
    def failures(self) -> list[pb.FailureRecord]:
        return self.recovery.failures

    def send_to(self, agent_id: str, message: pb.ControllerMessage) -> None:
        self._send(agent_id, message)

    # ------------------------------------------------------------ worker reports

    async def resumed(self, replica: int, msg: pb.Resumed) -> None:
        if msg.generation != self.generation or replica not in self.members:
            self.stale_reports += 1
            return
        self._progress.resumed[replica] = msg.at
        self.recovery.resumed(replica, max(self._progress.resumed.values()), msg.rebuild_s,
                              set(self._progress.resumed), self.members, self.step, self.generation)

    async def reduced(self, replica: int, msg: pb.Reduced) -> None:
        if (self.state is not JobState.RUNNING or msg.generation != self.generation
                or msg.step != self.step or replica not in self.members):
            # Fencing: a report from an older generation or step must not count.
            self.stale_reports += 1
            return
        wrong = reports.unplanned_ids(replica, self.step, self.plan.get(replica, ()),
                                      msg.microbatch_ids)
        if wrong is not None:
            await self.members_lost([replica], f"{wrong}: dropped like a crash", cause="refused")
            return
        self._progress.reduced[replica] = msg
        if set(self._progress.reduced) >= set(self.members):
            await self._commit()

    async def applied(self, replica: int, msg: pb.Applied) -> None:
        if not 0 <= msg.step < len(self.steps):
            self.stale_reports += 1
            return
        record = self.steps[msg.step]
        if any(d.replica == replica for d in record.param_sha256):
            return  # replayed to a new leader that already had it from the store
        record.param_sha256.append(pb.ReplicaDigest(replica=replica, param_sha256=msg.param_sha256))
        waits = sorted([*self._commit_waits.get(msg.step, []), msg.commit_wait_s])
        self._commit_waits[msg.step] = waits
        record.commit_wait_s = waits[len(waits) // 2]
        digests = {d.param_sha256 for d in record.param_sha256}
        if len(digests) > 1:
            self.events.emit("divergence", f"replicas disagree on parameters after step {msg.step}",
                             step=msg.step, level=logging.ERROR)
        await self.maybe_finish()

    # ------------------------------------------------------------ transitions

    async def _start(self, why: str) -> None:
        self.state = JobState.RUNNING
        self.started_at = self._clock()
        ready = sorted(r for r, info in self.replicas.items() if info.alive and info.ready)
        members, spares = ready[:self.job.replicas], ready[self.job.replicas:]
        decision = self.policy.plan(members, self.job.global_microbatches)
        self.events.emit("started", f"{why}; {len(members)} members; {decision.reason}")
        # For a new leader's summary: what the workers train is known only from `ready`.
        await self.records.save_workload(self.workload)
        await self.new_generation(members, decision)
        for agent_id in sorted({self.replicas[s].agent_id for s in spares}):
            await self._persist_agent(self.agents[agent_id])  # a new leader resumes their joins
        for spare in spares:  # hot spares: they catch up from the first step on
            self.joins.add(spare, self.replicas[spare].transfer_address)

    async def new_generation(self, members: list[int], decision: policy.PlanDecision) -> None:
        self.generation += 1
        self.members = members
        self.plan = dict(decision.assignment)
        self._progress = StepProgress()
        self.recovery.generation_started()
        view = pb.GenerationView(
            generation=self.generation, members=members, rendezvous=self._rendezvous,
            plan=plan_message(self.step, self.generation, self.scale_epoch, decision),
            rendezvous_prefix=secrets.token_hex(16))
        # The failures and events that led here ride along: a leader deposed right after
        # must not take them with it (its successor's summary reports them).
        await self.records.save_view(view, self.events.take_pending())
        self.events.emit("generation", f"members {members}; {decision.reason}",
                         step=self.step, generation=self.generation)
        self.broadcast(pb.ControllerMessage(generation=view))

    async def _lose(self, lost: list[int], why: str) -> None:
        for replica in lost:
            self.replicas[replica].alive = False
            self.joins.forget(replica)
        lost = [r for r in lost if r in self.members]  # a joiner's loss changes no generation
        if self.state is not JobState.RUNNING or not lost or self.takeover is not None:
            return  # during a takeover, its end plans around every replica lost meanwhile
        survivors = [m for m in self.members if self.replicas[m].alive]
        if self.last_step_committed and survivors:
            # The final step is committed; only its acknowledgements are pending.
            self.members = survivors
            await self.maybe_finish()
            return
        # Spares holding the state of this very step take the lost members' place in the
        # same new generation (one group rebuild, not a second one at the next boundary)
        # and a share of the lost microbatches; if every member is lost, they carry on.
        spares = [] if not self.policy.spares_enter_mid_step or self.last_step_committed else \
            self.joins.entering(self.step, replacing=survivors)
        if not survivors and not spares:
            await self.fail(f"all replicas lost (last: {why})")
            return
        self.recoveries += 1
        decision = self.policy.reassign(self.plan, lost, survivors, spares)
        await self.new_generation(sorted([*survivors, *spares]), decision)

    async def _commit(self) -> None:
        reported = [self._progress.reduced[m] for m in self.members]
        if any(r.overflow for r in reported):
            await self._redo_overflowed_step(reported)
            return
        assignment = {m: tuple(r.microbatch_ids) for m, r in zip(self.members, reported, strict=True)}
        problem = policy.check_plan(assignment, self.job.global_microbatches,
                                    self.policy.expected(self.plan, self.job.global_microbatches))
        if problem is not None:
            await self.fail(f"refusing to commit step {self.step}: {problem}")
            return
        verdict = reports.agree_on_loss({m: r.loss for m, r in zip(self.members, reported,
                                                                    strict=True)})
        if verdict.reason:
            self.events.emit("loss-mismatch", verdict.reason, step=self.step,
                             generation=self.generation, level=logging.WARNING)
        if verdict.outliers:  # the step is reduced again without them, in the next generation
            await self.members_lost(list(verdict.outliers), verdict.reason, cause="refused")
            return
        job = self.job
        record = step_record(job, self.step, self.generation, reported, self._clock(),
                             loss=verdict.loss)
        next_step = self.step + 1
        final = next_step >= job.steps
        stop = bool(self.stopping) and not final
        entering = [] if stop else self.joins.entering(next_step, final=final)
        leaving = [] if final or stop else self.leaving_at_boundary()
        # The plan the workers will hold next goes with the commit, and into the store with
        # it: a new leader resumes from it, never from a plan it re-derives. None when the
        # membership changes at the boundary: the next generation plans the step then.
        decision = None if final or stop or entering or leaving else \
            self.policy.plan(self.members, job.global_microbatches)
        next_plan = None if decision is None else \
            plan_message(next_step, self.generation, 0, decision)
        # Durable before anyone applies: a new leader must know this step committed.
        # The previous record rides along in the same write with the parameter
        # digests its members reported since (no extra round trip per step).
        before_store = self._clock()
        await self.records.commit_step(record, self.steps[-1] if self.steps else None, next_plan)
        self.recovery.committed(before_store)
        self.steps.append(record)
        step, self.step = self.step, next_step
        self.scale_epoch = 0
        commit = pb.Commit(step=step, generation=self.generation, final=final,
                           microbatches=record.microbatches, tokens=record.tokens, record=record)
        commit.record.ClearField("sample_ids")  # the digest is the ledger entry workers keep
        if decision is not None and next_plan is not None:
            self.plan = dict(decision.assignment)
            commit.next_plan.CopyFrom(next_plan)
        commit.checkpoint_now = stop
        self._progress.reduced.clear()
        self.broadcast(pb.ControllerMessage(commit=commit))
        if stop:  # ends once every member acknowledged this step (its digests in the summary)
            self.stop_pending = True
            await self.maybe_finish()
            return
        if leaving:
            await self.finish_drains()
        if entering or leaving:  # joiners enter, drained members leave at the step boundary
            members = sorted({*self.members, *entering} - set(leaving))
            await self.new_generation(members, self.policy.plan(members, job.global_microbatches))

    async def _redo_overflowed_step(self, reported: list[pb.Reduced]) -> None:
        """Exact reduction overflowed its predicted scale: redo the step at a lower one.

        A new generation (same members, same plan, next scale epoch) rather than
        a side message: it reuses fencing, so a member whose allreduce failed
        while others saw the overflow cannot end up on a different scale.
        """
        overflowed = max(r.overflow for r in reported)
        redo = policy.overflow_redo(self.step, self.scale_epoch, overflowed)
        if not redo.redo:
            await self.fail(redo.reason)
            return
        self.scale_epoch = redo.scale_epoch
        self.redos += 1
        await self.new_generation(list(self.members), policy.PlanDecision(dict(self.plan), redo.reason))

    async def maybe_finish(self) -> None:
        if self.state is not JobState.RUNNING or not self.last_step_committed:
            return
        last = self.steps[-1]
        applied = {d.replica for d in last.param_sha256}
        if set(self.members) <= applied and self.stop_pending:
            await self.stop_now()
        elif set(self.members) <= applied:
            await self.records.save_step(last)
            self.state = JobState.SUCCEEDED
            self.finished_at = self._clock()
            self.reason = f"{len(self.steps)} steps committed"
            self.events.emit("succeeded", self.reason)
            await self._end(success=True)

    async def fail(self, reason: str) -> None:
        if self.state in TERMINAL:
            return
        self.state = JobState.FAILED
        self.reason = reason
        self.finished_at = self._clock()
        self.events.emit("failed", reason, step=self.step, generation=self.generation,
                         level=logging.ERROR)
        await self._end(success=False)

    async def _end(self, success: bool) -> None:
        """Persist the result, tell the agents, set `done`. Shielded: the caller is usually an
        agent's stream handler, and the agent closes its stream as soon as it hears the
        shutdown, which cancels the handler; the end must still run to `done` (or the
        controller never writes its summary nor exits)."""
        self._ending = asyncio.ensure_future(self._announce_end(success))
        await asyncio.shield(self._ending)

    async def _announce_end(self, success: bool) -> None:
        result = pb.Shutdown(reason=self.reason, success=success, state=str(self.state))
        await self.records.save_result(result)
        shutdown = pb.ControllerMessage(shutdown=result)
        for agent in self.agents.values():
            if agent.alive:
                self._send(agent.agent_id, shutdown)
        await self.events.flush()
        self.done.set()

    # ------------------------------------------------------------ helpers

    @property
    def last_step_committed(self) -> bool:
        """No step is left to train: the job's last, or the one an operator stopped after."""
        return self.step >= self.job.steps or self.stop_pending

    def now(self) -> float:
        return self._clock()

    def broadcast(self, message: pb.ControllerMessage) -> None:
        """Send to every live agent that hosts a member of the current generation."""
        targets = {self.replicas[m].agent_id for m in self.members}
        for agent_id in sorted(targets):
            if self.agents[agent_id].alive:
                self._send(agent_id, message)

    def record_failure(self, replica: int, cause: str, exited: pb.WorkerExited | None,
                       phase: str = "") -> None:
        phase = phase or observed_phase(replica, started=self.state is not JobState.WAITING,
                                        resumed=self._progress.resumed,
                                        reduced=self._progress.reduced)
        self.recovery.failed(replica, cause, exited, step=self.step, generation=self.generation,
                             phase=phase, during_training=self.state is JobState.RUNNING)
