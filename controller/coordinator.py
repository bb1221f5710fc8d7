"""The controller's driver: it holds the job's view, runs transitions, carries out effects.

Single-threaded by construction: the gRPC layer calls one method at a time (under a
lock) and hands the coordinator a `send(agent_id, message)` function; the coordinator
never touches sockets, which keeps it testable without a network.

Every change to the job's state is a transition (membership.py, losses.py, joinflow.py,
commits.py, operations.py, takeover.py): it gets a `Draft` of the view and `Facts`, and
returns the new view with the effects it asks for (view.py, effects.py). This module is
the one writer of `view`; interpreter.py carries out the effects in their order, which puts
every store write before the messages that depend on it. The per-message paths
(heartbeats, reports of the step in flight, parameter digests) run a transition only when
they complete something: every member reduced (a commit; inflight.py gathers the step),
every member applied the last step (the end).
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import Callable, Mapping
from typing import Concatenate, ParamSpec, TypeVar

from recover.controller import (
    commits,
    joinflow,
    losses,
    membership,
    operations,
    policy,
    stealflow,
    takeover,
)
from recover.controller.events import EventLog
from recover.controller.inflight import Complete, Drop, Stale, StepInFlight
from recover.controller.interpreter import EffectInterpreter, SendAll
from recover.controller.jobstate import TERMINAL, JobState, RejoinUnexpected
from recover.controller.joinreports import JoinReports
from recover.controller.leader import LostLeadership
from recover.controller.ledger import AppliedVerdict, Ledger
from recover.controller.records import PersistedJob, Records
from recover.controller.recoveries import RecoveryTracker
from recover.controller.store import Store
from recover.controller.throughput import Speeds
from recover.controller.transitions import fail, maybe_finish
from recover.controller.view import Agent, Draft, Facts, JobView, Replica, TakeoverWait
from recover.proto import pb

log = logging.getLogger("recover.controller")

Send = Callable[[str, pb.ControllerMessage], None]
P = ParamSpec("P")
T = TypeVar("T")
Transition = Callable[Concatenate[Draft, P], T]


def _token() -> str:
    return secrets.token_hex(16)


class Coordinator:
    start_timeout_s: float = 120.0
    """Fail the job if it has not started this long after the controller did."""
    start_grace_s: float = 10.0
    """After a worker failed during startup: how long its replacement gets before the job
    starts with fewer replicas (at least the job's min_replicas)."""

    def __init__(
        self,
        job: pb.JobConfig,
        store: Store,
        send: Send,
        rendezvous: str,
        *,
        agent_timeout_s: float = 3.0,
        clock: Callable[[], float] = time.time,
        send_all: SendAll | None = None,
    ) -> None:
        self.view = JobView(job=job)
        """The job's state; replaced (never edited) by each transition."""
        self.records = Records(store, job.job_id)
        self.policy = policy.policy_for(job.policy)
        """Who computes which microbatches (the job's `policy`)."""
        self._rendezvous = rendezvous
        self._agent_timeout_s = agent_timeout_s
        self._clock = clock
        self.events = EventLog(self.records, clock)
        self.recovery = RecoveryTracker(self.events, self.records, clock)
        self.heartbeats: dict[str, float] = {}
        """When each agent was last heard (the failure detector's input)."""
        self.inflight = StepInFlight(clock)
        """The step between two commits: who reduced it, speeds, work-stealing."""
        self._steering = False
        """Work-stealing's decisions are due at the end of this pass of the event loop."""
        self.ledger = Ledger()
        self._effects = EffectInterpreter(
            view=lambda: self.view, send=send, records=self.records, events=self.events,
            recovery=self.recovery, ledger=self.ledger, inflight=self.inflight, clock=clock,
            send_all=send_all)
        self.done = self._effects.done
        """Set once the job's end is stored and announced."""
        self.rejected: dict[str, int] = {}
        """Refused registrations, reports and calls, by reason (controller/authz.py)."""
        self.last_checkpoint: pb.CheckpointWritten | None = None
        self.created_at = clock()
        self.joins = JoinReports(lambda: self.view, lambda: self.ledger.steps,
                                 self._effects.transfers, self._run, self._run_now)

    # ------------------------------------------------------------ the view, read-only

    job = property(lambda self: self.view.job)
    state = property(lambda self: self.view.state)
    reason = property(lambda self: self.view.reason)
    generation = property(lambda self: self.view.generation)
    step = property(lambda self: self.view.step)
    scale_epoch = property(lambda self: self.view.scale_epoch)
    workload = property(lambda self: self.view.workload)
    started_at = property(lambda self: self.view.started_at)
    finished_at = property(lambda self: self.view.finished_at)
    recoveries = property(lambda self: self.view.recoveries)
    redos = property(lambda self: self.view.redos)

    @property
    def steps(self) -> list[pb.StepRecord]:
        """The ledger: every committed step's record, in order."""
        return self.ledger.steps

    @property
    def members(self) -> list[int]:
        return list(self.view.members)

    @property
    def plan(self) -> Mapping[int, tuple[int, ...]]:
        return self.view.plan

    @property
    def agents(self) -> Mapping[str, Agent]:
        return self.view.agents

    @property
    def replicas(self) -> Mapping[int, Replica]:
        return self.view.replicas

    @property
    def takeover(self) -> TakeoverWait | None:
        return self.view.takeover

    @property
    def failures(self) -> list[pb.FailureRecord]:
        return self.recovery.failures

    def now(self) -> float:
        return self._clock()

    # ------------------------------------------------------------ running transitions

    def speeds(self) -> Speeds:
        """Measured seconds per microbatch of each replica measured so far (a snapshot)."""
        return self.inflight.speeds()

    @property
    def steals(self) -> stealflow.StealBook:
        return self.inflight.steals

    @property
    def stale_reports(self) -> int:
        """Reports fenced off as stale (an older generation or step, a replaced attempt)."""
        return self._effects.stale_reports

    @property
    def transfers(self) -> list[tuple[int, float]]:
        """(bytes, seconds) of every snapshot transferred, for metrics and the summary."""
        return self._effects.transfers

    def _draft(self) -> Draft:
        # A quota policy plans from measured speeds and, for its hysteresis, the plan the
        # workers hold; a policy that plans by counts alone ignores both.
        plans = self.policy.with_measurements(self.speeds(), self.view.plan)
        return Draft(self.view, Facts(
            now=self._clock(), policy=plans, token=_token, rendezvous=self._rendezvous,
            ledger_len=len(self.steps), last_record=self.ledger.last,
            unrecorded_failures=self.ledger.unrecorded(self.recovery.failures)))

    async def _run(self, transition: Transition[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        draft = self._draft()
        result = transition(draft, *args, **kwargs)
        await self._settle(draft)
        return result

    def _run_now(self, transition: Transition[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        """For transitions whose effects never wait (messages, events, counters)."""
        draft = self._draft()
        result = transition(draft, *args, **kwargs)
        self.view, todo = draft.freeze()
        for effect in todo:
            if not self._effects.now(effect):
                raise AssertionError(f"{transition.__name__} asked for {effect!r}: run it "
                                     "with _run")
        return result

    async def _settle(self, draft: Draft) -> None:
        self.view, todo = draft.freeze()
        for effect in todo:
            if not self._effects.now(effect):
                await self._effects.later(effect)

    # ------------------------------------------------------------ a new leader, a resume

    def restore(self, persisted: PersistedJob,
                resumed_from: pb.CheckpointMeta | None = None) -> None:
        """Take over from a previous leader: rebuild the job's state from what it persisted
        (and, for a job resumed from a checkpoint, the ledger of the steps before it)."""
        resumed = list(resumed_from.ledger) if resumed_from is not None else None
        self.ledger.load(takeover.ledger(persisted, resumed))
        self.recovery.failures = list(persisted.failures)
        self.events.restore(persisted.events)
        # The agents notice the old leader's silence about when we win the
        # election; give them their own timeout and then some to rejoin.
        self._run_now(takeover.restore, persisted, self.steps,
                      self._clock() + 2 * self._agent_timeout_s)
        if self.view.state in TERMINAL:
            self.done.set()

    def resume_from(self, checkpoint: pb.CheckpointMeta) -> None:
        """Start from a checkpoint's step, its ledger as the steps committed before it."""
        self.ledger.load(checkpoint.ledger)
        # The failures before the resume, as the ledger kept them (summary.json shows them).
        self.recovery.failures = self.ledger.failures()
        recoveries = len({(f.step, f.generation) for f in self.recovery.failures})
        self._run_now(lambda d: d.set(step=checkpoint.step, recoveries=recoveries))
        self.events.emit("resumed", f"from the checkpoint of step {checkpoint.step} "
                         f"({len(self.steps)} steps in its ledger)", step=checkpoint.step)

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

    # ------------------------------------------------------------ agents and workers

    async def register_agent(self, agent_id: str, host: str, slots: int,
                             resume: list[int] | None = None, subject: str = "", *, peer: str = "",
                             store_port: int = 0, seen_generation: int = 0) -> list[int]:
        """A new agent joins (`resume` None), or one whose workers ran on rejoins (a new
        leader, or this one on a new session). RegistrationRefused says why not."""
        draft = self._draft()
        if resume is None:
            ids = membership.register_agent(draft, agent_id, host, slots, subject, peer, store_port)
        else:
            try:
                ids = takeover.rejoin(draft, agent_id, host, resume, peer, seen_generation)
            except RejoinUnexpected:
                # This refusal fences the agent for good (it stops its workers), so only a
                # leader that still leads may give it; one that cannot reach its store may be
                # standing down, and the next leader's takeover expects the agent.
                if not await self.records.store.transaction([], []):  # fenced, writes nothing
                    raise LostLeadership("the leader key is no longer ours") from None
                raise
        self.heartbeats[agent_id] = self._clock()
        await self._settle(draft)
        await self._maybe_end_takeover()
        return ids

    async def replica_request(self, agent_id: str, request: pb.ReplicaRequest) -> None:
        await self._run(membership.replica_request, agent_id, request)

    @property
    def agent_timeout_s(self) -> float:
        """How long an agent may be silent before it is lost."""
        return self._agent_timeout_s

    def heartbeat(self, agent_id: str) -> None:
        if agent_id in self.view.agents:
            self.heartbeats[agent_id] = self._clock()

    async def agent_lost(self, agent_id: str, why: str) -> None:
        await self.agents_lost([(agent_id, why)])

    async def agents_lost(self, agents: list[tuple[str, str]]) -> None:
        await self._run(losses.agents_lost, agents)  # (agent id, why): one generation for all

    async def worker_ready(self, replica: int, ready: pb.Ready) -> None:
        await self._run(membership.worker_ready, replica, ready, self.start_grace_s)

    async def worker_exited(self, exited: pb.WorkerExited) -> None:
        await self._run(losses.worker_exited, exited)

    async def worker_lost(self, replica: int, why: str) -> None:
        """A replica that cannot go on though its process lives: stop it, recover without it."""
        await self._run(losses.members_lost, [replica], why)

    async def members_lost(self, replicas: list[int], why: str, cause: str = "external") -> None:
        await self._run(losses.members_lost, replicas, why, cause)

    async def check_liveness(self) -> None:
        """Declare agents whose heartbeats went silent lost; start a job that waited for a
        failed worker's replacement long enough; find donors for waiting joins."""
        await self._maybe_end_takeover()
        now = self._clock()
        silent = ((a.agent_id, now - self.heartbeats.get(a.agent_id, now))
                  for a in self.view.agents.values() if a.alive)
        lost = [(a, f"no heartbeat for {s:.1f}s") for a, s in silent if s > self._agent_timeout_s]
        if lost:
            await self.agents_lost(lost)
        if self.view.state is JobState.WAITING:
            await self._run(membership.maybe_start, self.start_grace_s)
        if self.view.state is JobState.WAITING:
            await self._run(membership.start_timed_out, self.start_timeout_s, self.created_at)
        if self.view.state is JobState.RUNNING and self.view.joins:
            self._run_now(joinflow.retry_waiting)

    async def _maybe_end_takeover(self) -> None:
        if takeover.ready_to_finish(self.view, self._clock()):
            await self._run(takeover.finish)

    # ------------------------------------------------------------ the step in flight

    async def resumed(self, replica: int, msg: pb.Resumed) -> None:
        v = self.view
        last = self.inflight.resumed(v, replica, msg)
        if last is None:
            self._effects.stale_reports += 1
            return
        self.recovery.resumed(replica, last, msg.rebuild_s, set(self.inflight.progress.resumed),
                              list(v.members), v.step, v.generation)

    async def reduced(self, replica: int, msg: pb.Reduced) -> None:
        match self.inflight.reduced(self.view, replica, msg):
            case Stale():
                self._effects.stale_reports += 1
            case Drop(reason):
                await self.members_lost([replica], reason, cause="refused")
            case Complete(reported):
                await self._run(commits.commit, reported)

    async def progress(self, replica: int, msg: pb.Progress) -> None:
        if self.inflight.progress_reported(self.view, replica, msg):
            self._steer()

    async def released(self, replica: int, msg: pb.Released) -> None:
        settled = self.inflight.released(replica, msg)
        if settled is None:
            self._effects.stale_reports += 1
            return
        if settled.microbatch_ids:
            await self._run(stealflow.hand_over, settled)
        self._steer()

    def _steer(self) -> None:
        """Decide steals once per pass of the event loop, after every report it read: a
        decision costs O(members), and near a step's end every member reports within a
        microbatch's time; folded, a busy controller decides as often as it can afford and
        an idle one at once (bench/scripts/stealing_step.py)."""
        if not self._steering:
            self._steering = True
            asyncio.get_running_loop().call_soon(self._steer_now)

    def _steer_now(self) -> None:
        self._steering = False
        if (moves := self.inflight.moves()) is not None:
            self._run_now(stealflow.steer, *moves)

    async def applied(self, replica: int, msg: pb.Applied) -> None:
        verdict = self.ledger.applied(replica, msg)
        if verdict is AppliedVerdict.STALE:
            self._effects.stale_reports += 1
            return
        if verdict is AppliedVerdict.KNOWN:
            return
        if verdict is AppliedVerdict.DIVERGED:
            self.events.emit("divergence", f"replicas disagree on parameters after step {msg.step}",
                             step=msg.step, level=logging.ERROR)
        await self.maybe_finish()

    async def maybe_finish(self) -> None:
        if self.view.state is JobState.RUNNING and self.view.last_step_committed:
            await self._run(maybe_finish)

    async def fail(self, reason: str) -> None:
        await self._run(fail, reason)

    # ------------------------------------------------------------ operators

    async def request_stop(self, by: str, reason: str) -> operations.Decision:
        return await self._run(operations.request_stop, by, reason)

    async def request_drain(self, agent_id: str, by: str, reason: str) -> operations.Decision:
        return await self._run(operations.request_drain, agent_id, by, reason)

    async def set_spares(self, spares: int, by: str) -> operations.Decision:
        return await self._run(operations.set_spares, spares, by)


__all__ = ["Coordinator", "JobState"]
