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
import time
from dataclasses import replace

from recover.proto import pb
from recover.trainer.checkpoint import FINAL_WRITE_WAIT_S
from recover.trainer.commits import CommitAction, judge_commit
from recover.trainer.errors import call_user
from recover.trainer.groups import CollectiveAborted, GroupSpec
from recover.trainer.joinsteps import JoinSteps
from recover.trainer.stepstate import ORPHAN_WAIT_S, StepState, TrainingEnded
from recover.trainer.workload import StepInfo

log = logging.getLogger("recover.trainer")


class StepExecutor(JoinSteps):
    """One replica's training loop: commands in, microbatches, reductions, commits.

    Built with the job, the replica's channel to its agent, the workload and its
    accumulator (executorbase.ExecutorBase). What the cross-replica group is comes from
    its `groups` factory (gloo unless told otherwise), and test concerns (faults,
    emulated compute) from its `hooks`: the executor knows neither.
    """

    # ------------------------------------------------------------ main loop

    def run(self, ready: pb.Ready) -> pb.Shutdown:
        self.hooks.on_startup(self.state.step)
        self.channel.send(pb.WorkerReport(ready=ready))
        lockstep = self.lockstep
        try:
            while True:
                if lockstep is not None and not lockstep.ranks.leads:
                    self._follow(lockstep.follow())
                    continue
                busy = self._has_work()  # unchanged until a command is handled
                self.deliver_digests(idle=not busy)
                command = self.channel.poll() if busy else self.channel.next_command(ORPHAN_WAIT_S)
                if command is not None:
                    if lockstep is not None:
                        lockstep.lead(command)
                    self._handle(command)
                elif busy:
                    if lockstep is not None:
                        lockstep.lead(None)
                    self._work()
                elif self.group is None and self.generation > 0 and not self.finished:
                    raise RuntimeError(f"no new generation {ORPHAN_WAIT_S:.0f}s after the group "
                                       f"of generation {self.generation} failed")
        except TrainingEnded as ended:
            return ended.shutdown
        finally:
            self._install_group(None)
            if self.early is not None:
                self.early.close()  # after the group: a collective in flight ends with it
            if self._digests is not None:
                self._digests.close()
            close_source = getattr(self.workload.source, "close", None)
            if close_source is not None:
                close_source()

    def _follow(self, command: pb.WorkerCommand | None) -> None:
        """Ranks 1.. of a replica make rank 0's move (replica.Lockstep): its command, or
        the next piece of work, which their state (the same commands) makes the same."""
        if command is not None:
            self._handle(command)
        else:
            self._work()

    def _has_work(self) -> bool:
        s = self.state
        return (self.group is not None and not self.finished and s.planned
                and (len(s.done) < len(s.assigned) or (s.reduced is None
                                                        and not s.idle_reported)))

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
        elif kind == "share":
            self._adopt_share(command.share)
        elif kind == "release":
            self._release(command.release)

    def _work(self) -> None:
        s = self.state
        if s.committed_at is not None:  # the step's first work: the time between steps
            # Here, not at the first microbatch: a member with none (a quota of 0, a share
            # stolen whole) reduces or reports idle instead, and its lead counts the same.
            s.lead_s, s.committed_at = time.perf_counter() - s.committed_at, None
        if len(s.done) < len(s.assigned):
            self._compute(s.assigned[len(s.done)])
        elif s.open:
            self._report_progress(0.0)  # an empty share: idle at once
        else:
            self._reduce()

    # ------------------------------------------------------------ transitions

    def _enter_generation(self, view: pb.GenerationView) -> None:
        if view.generation <= self.generation:
            return  # fenced: an older view never replaces a newer one
        for donation in self.donations:
            if donation.joiner in view.members:  # it enters at this view's step
                donation.finish_before(view.plan.step)
        if self.generation == 0 and not self._ready_to_enter(view):
            return
        recovering = self.generation > 0
        self.generation, self.members = view.generation, list(view.members)
        plan = view.plan
        if plan.step != self.state.step:
            raise RuntimeError(f"generation {view.generation} plans step {plan.step} but this "
                               f"worker is at step {self.state.step}")
        self._adopt_plan(plan)
        self.state.reduced = None  # reduced in an older generation: discard, reduce again
        self.state.committed_at = None  # a wait for a new generation is not this replica's
        started = time.monotonic()
        # With "group met in" (logged when the reduction first needs the group), this splits
        # a slow rebuild into the wait for this thread and the group's own meeting.
        log.info("generation %d: building its group", view.generation, extra=self._ctx())
        host, _, port = view.rendezvous.rpartition(":")
        group = self.build_group(GroupSpec(
            generation=view.generation, rank=self.members.index(self.replica),
            world_size=len(self.members), store_host=host, store_port=int(port),
            timeout_s=self.job.group_timeout_s or 30.0, secret=view.rendezvous_prefix,
            shard=self.lockstep.ranks.rank if self.lockstep is not None else 0))
        self._install_group(group)
        if recovering:
            self.hooks.on_rebuild(self.state.step)
        if not self._meet(group, started):
            return
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
        s.open, s.idle_reported, s.heard_at, s.pace_s = plan.open, False, None, 0.0
        self._load_ahead()
        if not s.original:
            s.original = set(mine)

    def _load_ahead(self) -> None:
        s = self.state
        load_ahead = getattr(self.workload.source, "plan", None)
        if load_ahead is not None:  # a source that loads ahead learns what comes next
            load_ahead([(s.step, mb) for mb in s.assigned[len(s.done):]]
                       + [(s.step + 1, mb) for mb in s.assigned])  # the next plan repeats, often

    # ------------------------------------------------------------ work-stealing

    def _adopt_share(self, update: pb.ShareUpdate) -> None:
        """More microbatches, stolen for this member, or its share closed (reduce when done)."""
        s = self.state
        if update.generation != self.generation or update.step != s.step or s.reduced is not None:
            return  # fenced: a new generation's plan replaced the share it changes
        if s.adopt_share(list(update.microbatch_ids), update.open):
            self._load_ahead()
            self.hooks.on_share_grown(s.step)

    def _release(self, release: pb.Release) -> None:
        """Give back the asked-for microbatches this worker has not started, and say which,
        before anyone else is handed them."""
        s = self.state
        current = (release.generation == self.generation and release.step == s.step and s.open
                   and s.reduced is None)
        released = s.release_unstarted(list(release.microbatch_ids)) if current else []
        self.channel.send(pb.WorkerReport(released=pb.Released(
            generation=release.generation, step=release.step, steal=release.steal,
            microbatch_ids=released)))
        if current:  # between two microbatches: where this member is, exactly
            self._report_progress(0.0)
        if released:
            self.hooks.on_release(s.step)

    def _report_progress(self, last_s: float) -> None:
        s = self.state
        s.idle_reported = len(s.done) >= len(s.assigned)
        self.channel.send(pb.WorkerReport(progress=pb.Progress(
            generation=self.generation, step=s.step, done=s.done, last_s=last_s)))
        s.heard(time.perf_counter(), last_s)

    def _compute(self, microbatch: int) -> None:
        if self._resumed_at is not None:
            self._say_resumed()
        if self.beacon is not None:
            self.beacon.compute_started()
        self._compute_microbatch(microbatch)
        if self.beacon is not None:
            self.beacon.compute_finished()

    def _compute_microbatch(self, microbatch: int) -> None:
        s, hooks = self.state, self.hooks
        started = time.perf_counter()
        position = len(s.done)
        count = len(s.original) or len(s.assigned)
        points = hooks.before_microbatch(s.step, position, count,
                                         recomputed=microbatch not in s.original,
                                         params=self.workload.params)
        self.accumulator.before_microbatch()
        hooked = self._hook_reduction(position)
        try:
            result = self.workload.compute(s.step, microbatch, points.before_backward,
                                           last=position == len(s.assigned) - 1)
        finally:
            if hooked:
                self.early.unhook()
        points.after_backward()
        self.grads.repair_views()
        hooks.after_microbatch(s.step, position, count, self.grads)
        self.accumulator.after_microbatch(result.loss)
        s.done.append(microbatch)
        s.sample_ids.extend(result.sample_ids)
        s.tokens += result.tokens
        took = time.perf_counter() - started
        s.compute_s += took
        if s.open and s.is_news(started + took):  # news only: common/stealnews.py
            self._report_progress(took)

    def _hook_reduction(self, position: int) -> bool:
        """Start reducing during this microbatch's backward if it is surely the replica's
        last of the step (overlap.py): a closed plan, one process per replica."""
        s, early, group = self.state, self.early, self.group
        if early is None or s.open or self.lockstep is not None or position != len(s.assigned) - 1 \
                or group is None or group.aborted:
            return False
        if self._meeting is not None and not self._meeting.met:
            return False  # still meeting: this step reduces after the backward instead
        early.hook(group, s.step, position + 1)
        return True

    def _reduce(self) -> None:
        s, group = self.state, self.group
        started = time.perf_counter()
        # Copies: an interrupted allreduce leaves its buffer partially reduced,
        # and the local accumulation must survive for the next generation.
        hooked = self.early.take(group, s.step, len(s.done)) if self.early is not None else None
        buffers = hooked.buffers if hooked is not None else self.accumulator.buffers()
        self.hooks.before_reduce(s.step)
        failure = self._met(group) if group is not None \
            else f"no group of generation {self.generation}"
        if failure is None and group is not None:
            try:
                if hooked is not None and self.early is not None:
                    self.early.finish(hooked)  # its pieces started during the last backward
                else:
                    for view in self.accumulator.schedule(buffers):
                        group.allreduce_sum_(view)
            except CollectiveAborted as exc:
                failure = str(exc)
        reduced = self.accumulator.finish(buffers) if failure is None else None
        tokens = s.tokens
        if self.lockstep is not None:
            # The replica reduced only if each of its ranks did (each its own shard).
            agreed = self.lockstep.agree(reduced is not None, reduced.loss if reduced else 0.0,
                                         tokens, reduced.overflow if reduced else 0)
            if failure is None and not agreed.reduced:
                failure = "another rank of this replica could not reduce its shard"
            if reduced is not None:
                reduced = replace(reduced, loss=agreed.loss, overflow=agreed.overflow)
            tokens = agreed.tokens
            if reduced is not None and failure is None and self.lockstep.buffers_averaged:
                # After the gradients come the buffers' mean updates, each rank's of its
                # slices: the replica's are their mean (what joiners are streamed, too).
                count = len(self.grads.buckets)
                reduced = replace(reduced, grads=[
                    *reduced.grads[:count], *self.lockstep.average(reduced.grads[count:])])
        if failure is not None or reduced is None:
            log.warning("reduction of step %d aborted: %s", s.step, failure, extra=self._ctx())
            self._install_group(None)
            return
        s.reduced = reduced
        self.channel.send(pb.WorkerReport(reduced=pb.Reduced(
            generation=self.generation, step=s.step, microbatch_ids=s.done,
            sample_ids=s.sample_ids, loss=s.reduced.loss, compute_s=s.compute_s,
            reduce_s=time.perf_counter() - started, overflow=s.reduced.overflow,
            scale_epoch=s.scale_epoch, tokens=tokens, applied=self.held_applied(),
            lead_s=s.lead_s)))
        self._reported_at = time.perf_counter()
        self.hooks.after_reported(s.step)

    def _apply_commit(self, commit: pb.Commit) -> None:
        s = self.state
        verdict = judge_commit(commit.step, commit.generation, s.step, self.generation,
                               s.reduced is not None)
        if verdict.action is CommitAction.IGNORE:
            log.info("commit ignored: %s", verdict.reason, extra=self._ctx())
            return
        if verdict.action is CommitAction.REFUSE or s.reduced is None:
            raise RuntimeError(f"commit refused: {verdict.reason}")
        committed_at = time.perf_counter()
        commit_wait = committed_at - self._reported_at
        if not commit.HasField("next_plan") and not commit.final \
                and any(not d.done.is_set() for d in self.donations):
            self.hooks.before_feeding(s.step)
        self._apply(s.reduced.grads, pb.CatchUpStep(
            step=s.step, loss=s.reduced.loss, generation=self.generation,
            microbatches=commit.microbatches or self.job.global_microbatches, tokens=commit.tokens,
            record=commit.record), commit_wait, checkpoint_now=commit.checkpoint_now,
            final=commit.final)
        self.finished = commit.final
        if commit.HasField("next_plan"):
            self.state.committed_at = committed_at
            self._adopt_plan(commit.next_plan)
            # The controller's book of this step starts at the commit, at its speed estimate.
            self.state.heard(committed_at, s.compute_s / len(s.done) if s.done else 0.0)

    def _apply(self, means: list, step: pb.CatchUpStep, commit_wait: float | None,
               checkpoint_now: bool = False, final: bool = False) -> None:
        """Apply a committed step: as a member (`commit_wait` set), or catching up as a joiner.
        After the job's `final` step the first member writes its checkpoint before saying it
        applied the step: the job ends on that, and its last checkpoint is reported first."""
        self.parameters_about_to_change()
        applied_step = self.workload.apply(self.grads, means)
        self.accumulator.observe_committed(means)
        self.accumulator.loss_scale_changed(applied_step.loss_scale_factor)
        self.accumulator.reset()
        member = commit_wait is not None
        first = member and bool(self.members) and self.replica == min(self.members)
        self.first_at_last_commit = first
        record = pb.StepRecord()
        record.CopyFrom(step.record)
        digests = self._digest_pipeline() if member and not final else None
        if digests is not None:  # hashed on a thread while the next step computes
            # A callback after the commit may write the parameters: then they are copied.
            digests.submit(step.step, record, commit_wait or 0.0, *self.workload.digest_tensors(),
                           borrow=self.workload.on_step_committed is None)
        elif member:  # a joiner's record carries its donor's digest: the same bits
            self.settle_digests()  # the final step's report comes after every earlier one
            digest = self.workload.digest()
            record.param_sha256.append(pb.ReplicaDigest(replica=self.replica, param_sha256=digest))
            applied = pb.WorkerReport(applied=pb.Applied(
                step=step.step, param_sha256=digest, commit_wait_s=commit_wait))
            if not final:
                self.channel.send(applied)
        if member:
            self.steps_applied += 1
        self.ledger.append(record)
        if member:
            if self.donations:  # a joiner's catch-up step carries the members' digests
                self.settle_digests()
            step.record.CopyFrom(record)
            self._feed_joiners(step, means)
        self.state = StepState(step=step.step + 1)
        if first and self.checkpoints is not None:
            if final or checkpoint_now or self.checkpoints.due(step.step + 1):
                self.settle_digests()  # the checkpoint's ledger holds this step's digest
            self.checkpoints.maybe_write(step.step + 1, lambda: self.training_state(False),
                                         self.ledger, force=checkpoint_now or final)
            if final:
                self.checkpoints.close(FINAL_WRITE_WAIT_S)
        if member and final:
            self.channel.send(applied)
        if self.workload.on_step_committed is not None:
            call_user("on_step_committed", self.workload.on_step_committed, StepInfo(
                step=step.step, loss=step.loss, lr=applied_step.lr,
                grad_norm=applied_step.grad_norm, microbatches=step.microbatches,
                tokens=step.tokens, generation=step.generation, replica=self.replica,
                is_first_replica=first, loss_scale=applied_step.loss_scale,
                skipped=applied_step.skipped), step=step.step)
            self.workload.restore_buffers()  # whatever the callback's forwards wrote in them
