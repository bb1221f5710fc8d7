"""The step executor: run my microbatches, reduce, commit on the controller's word.

Inside step t a worker keeps every microbatch it has already accumulated.
When a new generation arrives mid-step (a replica died), it drops the old
group, rebuilds, computes the microbatches the new plan adds to its share,
and reduces again. The reduction always works on copies of the local
accumulation: a failed allreduce leaves a partially reduced buffer, and the
accumulation must survive it untouched. The optimizer step happens only on
the controller's commit, so no replica can apply a step another did not.

What a microbatch *is* (data, loss, backward) and what applying a step means
(clipping, optimizer, scheduler) belong to the workload (workload.py).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from typing import Any

import torch

from recover.common.ckptfile import CheckpointError
from recover.common.progress import ProgressBeacon
from recover.proto import pb
from recover.trainer.channel import AgentChannel
from recover.trainer.checkpoint import FINAL_WRITE_WAIT_S, CheckpointWriter
from recover.trainer.checkpoint import load as load_checkpoint
from recover.trainer.collectives import CollectiveAborted, GenerationGroup, GroupSpec
from recover.trainer.commits import CommitAction, judge_commit
from recover.trainer.destinations import OwnTensors
from recover.trainer.digest import parameter_digest
from recover.trainer.errors import call_user, contract_error
from recover.trainer.faults import FaultInjector
from recover.trainer.gradients import GradientBuckets
from recover.trainer.joining import Donation
from recover.trainer.joinsteps import JoinSteps
from recover.trainer.reduction import Accumulator
from recover.trainer.stepstate import ORPHAN_WAIT_S, StepState, TrainingEnded
from recover.trainer.transfer import Listener
from recover.trainer.workload import StepInfo, Workload

log = logging.getLogger("recover.trainer")

class StepExecutor(JoinSteps):
    def __init__(self, job: pb.JobConfig, replica: int, channel: AgentChannel, workload: Workload,
                 grads: GradientBuckets, accumulator: Accumulator, first_step: int = 0,
                 beacon: ProgressBeacon | None = None, listener: Listener | None = None) -> None:
        self.job = job
        self.replica = replica
        self.channel = channel
        self.workload = workload
        self.beacon = beacon
        self.grads = grads
        self.accumulator = accumulator
        self.faults = FaultInjector(job.testing.faults, replica, channel.note_fault,
                                    beacon.mark_killed if beacon is not None else None)
        self.generation = 0
        self.members: list[int] = []
        self.group: GenerationGroup | None = None
        self.state = StepState(step=first_step)
        self.finished = False
        self.steps_applied = 0
        self._reported_at = 0.0
        self.listener = listener
        """Where a donor's state arrives when this replica joins a running job."""
        self.donations: list[Donation] = []
        self.ledger: list[pb.StepRecord] = []
        """Every committed step's record, kept with the state: a checkpoint carries it."""
        self.checkpoints: CheckpointWriter | None = None
        self._admission: pb.GenerationView | None = None
        """A joiner's first generation, held until it has caught up to the view's step."""
        self._pending_join: pb.Join | None = None
        self.catching_up = False
        """Applying a donor's stream: a generation ahead of this replica is held, not fatal."""
        self.state_loaded = False
        """The state came from a donor or a checkpoint (else: the model as the user built it)."""
        self.resume: pb.ResumePoint | None = None
        """A checkpoint to load before the first generation, unless a donor's state came first."""
        self.built_tensors: OwnTensors | None = None
        """The state as built, offered to a join's snapshot to be received into in place."""
        # Guards the hand-over between the receiver thread (which learns of new
        # generations first) and the main thread (which owns the group).
        self._group_lock = threading.Lock()
        self._newest_seen = 0
        channel.set_generation_hook(self._on_generation_seen)

    # ------------------------------------------------------------ abort path

    def _on_generation_seen(self, generation: int) -> None:
        """Receiver thread: a newer generation makes the current group's collectives moot."""
        with self._group_lock:
            self._newest_seen = max(self._newest_seen, generation)
            if self.group is not None and self.group.spec.generation < generation:
                self.group.abort()

    def _install_group(self, group: GenerationGroup | None) -> None:
        with self._group_lock:
            old, self.group = self.group, group
            if group is not None and self._newest_seen > group.spec.generation:
                group.abort()  # the view was superseded before we even started
        if old is not None:
            old.abort()
            old.close()

    # ------------------------------------------------------------ main loop

    def run(self, ready: pb.Ready) -> pb.Shutdown:
        if self.faults.armed(self.state.step, "startup"):
            self.faults.fire(self.state.step, "startup")
        self.channel.send(pb.WorkerReport(ready=ready))
        try:
            while True:
                command = self.channel.poll() if self._has_work() else \
                    self.channel.next_command(ORPHAN_WAIT_S)
                if command is not None:
                    self._handle(command)
                elif self._has_work():
                    self._work()
                elif self.group is None and self.generation > 0 and not self.finished:
                    raise RuntimeError(f"no new generation {ORPHAN_WAIT_S:.0f}s after the group "
                                       f"of generation {self.generation} failed")
        except TrainingEnded as ended:
            return ended.shutdown
        finally:
            self._install_group(None)

    def _has_work(self) -> bool:
        s = self.state
        return (self.group is not None and not self.finished and s.planned
                and (len(s.done) < len(s.assigned) or s.reduced is None))

    def _handle(self, command: pb.WorkerCommand) -> None:
        kind = command.WhichOneof("kind")
        if kind == "generation":
            self._enter_generation(command.generation)
        elif kind == "commit":
            self._apply_commit(command.commit)
        elif kind == "shutdown":
            raise TrainingEnded(command.shutdown)
        elif kind == "donate":
            self._donate(command.donate)
        elif kind == "join":
            self._join(command.join)

    def _work(self) -> None:
        s = self.state
        if len(s.done) < len(s.assigned):
            self._compute(s.assigned[len(s.done)])
        else:
            self._reduce()

    # ------------------------------------------------------------ transitions

    def _enter_generation(self, view: pb.GenerationView) -> None:
        if view.generation <= self.generation:
            return  # fenced: an older view never replaces a newer one
        for donation in self.donations:
            if donation.joiner in view.members:  # it enters at this view's step
                donation.finish_before(view.plan.step)
        if self.generation == 0 and view.plan.step > self.state.step:
            if not self.catching_up:
                raise RuntimeError(f"generation {view.generation} admits this replica at step "
                                   f"{view.plan.step}, but it holds the state before step "
                                   f"{self.state.step} and no donor streams to it")
            self._admission = view  # a joiner still catching up: enter once it has
            return
        if self.generation == 0 and self.resume is not None and not self.state_loaded:
            self.load_checkpoint(self.resume)  # a replica that starts with a resumed job
        if self.generation == 0 and self.built_tensors is not None and self.built_tensors.used \
                and not self.state_loaded:
            raise RuntimeError("admitted as built, but a failed join overwrote the built state")
        recovering = self.generation > 0
        self.generation, self.members = view.generation, list(view.members)
        plan = view.plan
        if plan.step != self.state.step:
            raise RuntimeError(f"generation {view.generation} plans step {plan.step} but this "
                               f"worker is at step {self.state.step}")
        self._adopt_plan(plan)
        self.state.reduced = None  # reduced in an older generation: discard, reduce again
        started = time.monotonic()
        host, _, port = view.rendezvous.rpartition(":")
        group = GenerationGroup(GroupSpec(
            generation=view.generation, rank=self.members.index(self.replica),
            world_size=len(self.members), store_host=host, store_port=int(port),
            timeout_s=self.job.group_timeout_s or 30.0, secret=view.rendezvous_prefix))
        self._install_group(group)
        if recovering and self.faults.armed(self.state.step, "rebuild"):
            self.faults.fire_soon(self.state.step, "rebuild")
        try:
            group.connect()
        except CollectiveAborted as exc:
            log.warning("rebuild of generation %d aborted: %s", view.generation, exc,
                        extra=self._ctx())
            self._install_group(None)
            return
        self.channel.send(pb.WorkerReport(resumed=pb.Resumed(
            generation=view.generation, step=self.state.step, at=time.time(),
            rebuild_s=time.monotonic() - started)))
        log.info("generation %d: %d members, my microbatches %s", view.generation,
                 len(self.members), self.state.assigned, extra=self._ctx())

    def _adopt_plan(self, plan: pb.Plan) -> None:
        mine = next((list(a.microbatch_ids) for a in plan.assignments if a.replica == self.replica),
                    [])
        s = self.state
        if plan.scale_epoch != s.scale_epoch:
            # The exact scale changed (an overflow redo): what was accumulated at
            # the old scale cannot be mixed with the new one; start the step over.
            s.done, s.sample_ids, s.tokens, s.original = [], [], 0, set()
            s.scale_epoch = plan.scale_epoch
            self.accumulator.reset(plan.scale_epoch)
        missing = [mb for mb in s.done if mb not in mine]
        if missing:
            raise RuntimeError(f"plan of step {plan.step} drops microbatches {missing} this "
                               "worker already accumulated")
        # Done first, in order, so `assigned[len(done):]` is exactly what is left.
        s.assigned = s.done + [mb for mb in mine if mb not in s.done]
        s.planned = True
        if not s.original:
            s.original = set(mine)

    def _compute(self, microbatch: int) -> None:
        if self.beacon is not None:
            self.beacon.compute_started()
        self._compute_microbatch(microbatch)
        if self.beacon is not None:
            self.beacon.compute_finished()

    def _compute_microbatch(self, microbatch: int) -> None:
        s, faults = self.state, self.faults
        started = time.perf_counter()
        position = len(s.done)
        count = len(s.original) or len(s.assigned)
        if microbatch not in s.original and faults.armed(s.step, "recompute"):
            faults.fire(s.step, "recompute")
        points = faults.microbatch_points(s.step, position, count, self.workload.params)
        self.accumulator.before_microbatch()
        result = self.workload.compute(s.step, microbatch, points.before_backward)
        points.after_backward()
        self.grads.repair_views()
        if faults.armed(s.step, "nan", position, count):
            self.grads.buckets[0].flat[0] = math.nan
        if self.job.testing.compute_ms > 0:
            # Emulated accelerator time (--compute-ms): a sleep, not CPU work, so each
            # slot's capacity is its own instead of a share of the machine's cores.
            time.sleep(self.job.testing.compute_ms / 1000.0)
        self.accumulator.after_microbatch(result.loss)
        s.done.append(microbatch)
        s.sample_ids.extend(result.sample_ids)
        s.tokens += result.tokens
        s.compute_s += time.perf_counter() - started

    def _reduce(self) -> None:
        s, group = self.state, self.group
        assert group is not None
        started = time.perf_counter()
        # Copies: an interrupted allreduce leaves its buffer partially reduced,
        # and the local accumulation must survive for the next generation.
        buffers = self.accumulator.buffers()
        if self.faults.armed(s.step, "reduce"):
            self.faults.fire_soon(s.step, "reduce")
        try:
            for buffer in buffers:
                group.allreduce_sum_(buffer)
        except CollectiveAborted as exc:
            log.warning("reduction of step %d aborted: %s", s.step, exc, extra=self._ctx())
            self._install_group(None)
            return
        s.reduced = self.accumulator.finish(buffers)
        self.channel.send(pb.WorkerReport(reduced=pb.Reduced(
            generation=self.generation, step=s.step, microbatch_ids=s.done,
            sample_ids=s.sample_ids, loss=s.reduced.loss, compute_s=s.compute_s,
            reduce_s=time.perf_counter() - started, overflow=s.reduced.overflow,
            scale_epoch=s.scale_epoch, tokens=s.tokens)))
        self._reported_at = time.perf_counter()
        if self.faults.armed(s.step, "commit"):
            self.faults.fire(s.step, "commit")

    def _apply_commit(self, commit: pb.Commit) -> None:
        s = self.state
        verdict = judge_commit(commit.step, commit.generation, s.step, self.generation,
                               s.reduced is not None)
        if verdict.action is CommitAction.IGNORE:
            log.info("commit ignored: %s", verdict.reason, extra=self._ctx())
            return
        if verdict.action is CommitAction.REFUSE or s.reduced is None:
            raise RuntimeError(f"commit refused: {verdict.reason}")
        commit_wait = time.perf_counter() - self._reported_at
        self._apply(s.reduced.grads, pb.CatchUpStep(
            step=s.step, loss=s.reduced.loss, generation=self.generation,
            microbatches=commit.microbatches or self.job.global_microbatches, tokens=commit.tokens,
            record=commit.record), commit_wait, checkpoint_now=commit.checkpoint_now,
            final=commit.final)
        self.finished = commit.final
        if commit.HasField("next_plan"):
            self._adopt_plan(commit.next_plan)

    def _apply(self, means: list, step: pb.CatchUpStep, commit_wait: float | None,
               checkpoint_now: bool = False, final: bool = False) -> None:
        """Apply a committed step: as a member (`commit_wait` set), or catching up as a joiner.
        After the job's `final` step the first member writes its checkpoint before saying it
        applied the step: the job ends on that, and its last checkpoint is reported first."""
        lr, norm = self.workload.apply(self.grads, means)
        self.accumulator.observe_committed(means)
        self.accumulator.reset()
        member = commit_wait is not None
        first = member and bool(self.members) and self.replica == min(self.members)
        record = pb.StepRecord()
        record.CopyFrom(step.record)
        if member:  # a joiner's record carries its donor's digest: the same bits
            digest = parameter_digest(self.workload.model)
            record.param_sha256.append(pb.ReplicaDigest(replica=self.replica, param_sha256=digest))
            applied = pb.WorkerReport(applied=pb.Applied(
                step=step.step, param_sha256=digest, commit_wait_s=commit_wait))
            if not final:
                self.channel.send(applied)
            self.steps_applied += 1
        self.ledger.append(record)
        if member:
            step.record.CopyFrom(record)
            self._feed_joiners(step, means)
        self.state = StepState(step=step.step + 1)
        if first and self.checkpoints is not None:
            self.checkpoints.maybe_write(step.step + 1, lambda: self.training_state(False),
                                         self.ledger, force=checkpoint_now)
            if final:
                self.checkpoints.close(FINAL_WRITE_WAIT_S)
        if member and final:
            self.channel.send(applied)
        if self.workload.on_step_committed is not None:
            call_user("on_step_committed", self.workload.on_step_committed, StepInfo(
                step=step.step, loss=step.loss, lr=lr, grad_norm=norm,
                microbatches=step.microbatches, tokens=step.tokens, generation=step.generation,
                replica=self.replica, is_first_replica=first), step=step.step)

    def training_state(self, with_ledger: bool = True) -> dict[str, Any]:
        """Everything a joiner or a restore needs: the user's state, the exact-reduction
        scales and the step ledger (references to live tensors: encode() copies). A
        checkpoint keeps the ledger in its header instead (the controller reads it there)."""
        state = {"workload": self.workload.state_dict(),
                 "reduction": self.accumulator.state_dict()}
        if with_ledger:
            # Bytes in a tensor, not in the state's tree: the ledger grows with the job, and
            # a frame's message is bounded while its tensors are not.
            ledger = bytearray(pb.Ledger(records=self.ledger).SerializeToString())
            state["ledger"] = (torch.frombuffer(ledger, dtype=torch.uint8) if ledger
                               else torch.empty(0, dtype=torch.uint8))
        return state

    def load_training_state(self, state: dict[str, Any], step: int,
                            ledger: list[pb.StepRecord] | None = None) -> None:
        self.workload.load_state_dict(state["workload"])
        self.accumulator.load_state_dict(state["reduction"])
        if ledger is None:
            ledger = list(pb.Ledger.FromString(bytes(state["ledger"].numpy())).records)
        self.ledger = ledger
        self.state = StepState(step=step)
        self.state_loaded = True

    def load_checkpoint(self, resume: pb.ResumePoint) -> None:
        """The state a resumed job starts from (its checksum verified again here)."""
        try:
            meta, state = load_checkpoint(resume.path)
        except (CheckpointError, OSError) as exc:
            raise contract_error(f"cannot resume from {resume.path}: {exc}",
                                 where="resume") from None
        self.load_training_state(state, meta.step, list(meta.ledger))
        log.info("resumed from %s at step %d", resume.path, meta.step, extra=self._ctx())

    def _ctx(self) -> dict[str, int]:
        return {"step": self.state.step, "generation": self.generation, "replica": self.replica}
