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
from dataclasses import dataclass, field

from recover.common.progress import ProgressBeacon
from recover.proto import pb
from recover.trainer.channel import AgentChannel
from recover.trainer.collectives import CollectiveAborted, GenerationGroup, GroupSpec
from recover.trainer.commits import CommitAction, judge_commit
from recover.trainer.digest import parameter_digest
from recover.trainer.errors import call_user
from recover.trainer.faults import HANG_PHASES, FaultInjector
from recover.trainer.gradients import GradientBuckets
from recover.trainer.reduction import Accumulator, Reduced
from recover.trainer.workload import StepInfo, Workload

log = logging.getLogger("recover.trainer")

ORPHAN_WAIT_S = 60.0
"""How long a worker whose group failed waits for a new generation before giving up."""


class TrainingEnded(Exception):
    """The controller ended the job (shutdown)."""

    def __init__(self, shutdown: pb.Shutdown) -> None:
        super().__init__(shutdown.reason)
        self.shutdown = shutdown


@dataclass
class StepState:
    """What this worker holds of the current, uncommitted step."""

    step: int
    assigned: list[int] = field(default_factory=list)
    """My microbatches in the latest plan of this step (a superset of `done`)."""
    original: set[int] = field(default_factory=set)
    """My microbatches in the step's first plan: the rest were reassigned to me."""
    done: list[int] = field(default_factory=list)
    """Microbatches already accumulated into the parameters' .grad, in order."""
    sample_ids: list[int] = field(default_factory=list)
    tokens: int = 0
    scale_epoch: int = 0
    """Exact reduction: the fixed-point scale the accumulation was made at."""
    reduced: Reduced | None = None
    """The reduced gradient (a copy) awaiting the commit."""
    compute_s: float = 0.0


class StepExecutor:
    def __init__(self, job: pb.JobConfig, replica: int, channel: AgentChannel, workload: Workload,
                 grads: GradientBuckets, accumulator: Accumulator, first_step: int = 0,
                 beacon: ProgressBeacon | None = None) -> None:
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
        return (self.group is not None and not self.finished
                and (len(s.done) < len(s.assigned) or s.reduced is None))

    def _handle(self, command: pb.WorkerCommand) -> None:
        kind = command.WhichOneof("kind")
        if kind == "generation":
            self._enter_generation(command.generation)
        elif kind == "commit":
            self._apply_commit(command.commit)
        elif kind == "shutdown":
            raise TrainingEnded(command.shutdown)

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
            timeout_s=self.job.group_timeout_s or 30.0))
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
        hook = None

        def before_backward() -> None:
            # Testing-only fault points between this microbatch's forward and backward.
            nonlocal hook
            for phase in HANG_PHASES:
                if faults.armed(s.step, phase, position, count):
                    faults.hang(s.step, phase)
            if delay := faults.slow_seconds(s.step):
                time.sleep(delay)
            if faults.armed(s.step, "forward", position, count):
                faults.fire(s.step, "forward")
            if faults.armed(s.step, "backward", position, count):
                middle = self.workload.params[len(self.workload.params) // 2]
                hook = middle.register_hook(lambda grad: faults.fire(s.step, "backward"))

        self.accumulator.before_microbatch()
        result = self.workload.compute(s.step, microbatch, before_backward)
        if hook is not None:
            hook.remove()
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
        lr, norm = self.workload.apply(self.grads, s.reduced.grads)
        self.accumulator.observe_committed(s.reduced.grads)
        self.accumulator.reset()
        commit_wait = time.perf_counter() - self._reported_at
        self.channel.send(pb.WorkerReport(applied=pb.Applied(
            step=s.step, param_sha256=parameter_digest(self.workload.model),
            commit_wait_s=commit_wait)))
        self.steps_applied += 1
        info = StepInfo(step=s.step, loss=s.reduced.loss, lr=lr, grad_norm=norm,
                        microbatches=commit.microbatches or self.job.global_microbatches,
                        tokens=commit.tokens, generation=self.generation, replica=self.replica,
                        is_first_replica=bool(self.members) and self.replica == min(self.members))
        self.state = StepState(step=s.step + 1)
        self.finished = commit.final
        if commit.HasField("next_plan"):
            self._adopt_plan(commit.next_plan)
        if self.workload.on_step_committed is not None:
            call_user("on_step_committed", self.workload.on_step_committed, info, step=info.step)

    def _ctx(self) -> dict[str, int]:
        return {"step": self.state.step, "generation": self.generation, "replica": self.replica}
