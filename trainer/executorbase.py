"""What the step executor and its join steps share: the replica's state, its group, and
the few operations both call.

The executor is one object in three layers, each in a module of its own so that none
imports the one built on it: this base (the state and the group hand-over), `JoinSteps`
(joinsteps.py: donating and joining, which need the state and the step operations) and
`StepExecutor` (executor.py: the step loop, which implements those operations). The
abstract methods are the step operations the join steps call.
"""

from __future__ import annotations

import logging
import threading
import time
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any

import torch

from recover.common.ckptfile import CheckpointError, rank_file
from recover.common.progress import ProgressBeacon
from recover.proto import pb
from recover.trainer.channel import AgentChannel
from recover.trainer.checkpoint import CheckpointWriter, committed_digest
from recover.trainer.checkpoint import load as load_checkpoint
from recover.trainer.destinations import OwnTensors
from recover.trainer.errors import contract_error
from recover.trainer.gradients import GradientBuckets
from recover.trainer.groups import (
    CollectiveAborted,
    CrossReplicaGroup,
    GroupFactory,
    build_group,
)
from recover.trainer.groups.meeting import Meeting
from recover.trainer.hooks import StepHooks
from recover.trainer.joining import Donation
from recover.trainer.overlap import EarlyReduction
from recover.trainer.reduction import Accumulator
from recover.trainer.replica import Lockstep
from recover.trainer.stepdigest import BackgroundDigests
from recover.trainer.stepstate import StepState
from recover.trainer.transfer import Listener
from recover.trainer.workload import Workload

log = logging.getLogger("recover.trainer")


class ExecutorBase(ABC):
    def __init__(self, job: pb.JobConfig, replica: int, channel: AgentChannel, workload: Workload,
                 grads: GradientBuckets, accumulator: Accumulator, first_step: int = 0,
                 beacon: ProgressBeacon | None = None, listener: Listener | None = None,
                 hooks: StepHooks | None = None, groups: GroupFactory = build_group) -> None:
        self.job = job
        self.replica = replica
        self.channel = channel
        self.workload = workload
        self.beacon = beacon
        self.grads = grads
        self.accumulator = accumulator
        self.early: EarlyReduction | None = EarlyReduction(accumulator, replica) \
            if accumulator.pieces else None
        """Reduces the pieces of the gradient during the step's last backward (overlap.py);
        None when the accumulator has no pieces (a small model, turned off)."""
        self.hooks = hooks or StepHooks()
        """Fault injection and emulated compute when the job's testing config asks; no-ops else."""
        self.build_group = groups
        """Makes a generation's cross-replica group (gloo by default; a fake in unit tests)."""
        self.generation = 0
        self.members: list[int] = []
        self.group: CrossReplicaGroup | None = None
        self._meeting: Meeting | None = None
        """The current group's meeting while it runs beside the step's compute (meeting.py)."""
        self._resumed_at: float | None = None
        """When this member entered a generation it has not yet said it resumed in."""
        self.state = StepState(step=first_step)
        self.finished = False
        self.steps_applied = 0
        self.first_at_last_commit = False
        """This replica was the first member at the last step it committed."""
        self._reported_at = 0.0
        self.listener = listener
        """Where a donor's state arrives when this replica joins a running job."""
        self.donations: list[Donation] = []
        self.ledger: list[pb.StepRecord] = []
        """Every committed step's record, kept with the state: a checkpoint carries it."""
        self.checkpoints: CheckpointWriter | None = None
        self.background_digests = False if job.testing.digest_inline else None
        """Hash step digests on a thread while the next step computes (stepdigest.py): None
        (the default) does wherever it can, False hashes in line (tests, benchmarks)."""
        self._digests: BackgroundDigests | None = None
        self._applied_held: list[pb.Applied] = []
        """`applied` reports of digests hashed on the thread, to ride on the next `reduced`
        report (one message fewer a step); sent alone before this worker waits for a
        command, or before something reads the ledger (`settle_digests`)."""
        self._admission: pb.GenerationView | None = None
        """A joiner's first generation, held until it has caught up to the view's step."""
        self._pending_join: pb.Join | None = None
        self.catching_up = False
        """Applying a donor's stream: a generation ahead of this replica is held, not fatal."""
        self.join_failure_reported = False
        """A join attempt failed and the controller was told: an admission that comes
        before the controller read it is waited out, not an error."""
        self.state_loaded = False
        """The state came from a donor or a checkpoint (else: the model as the user built it)."""
        self.resume: pb.ResumePoint | None = None
        """A checkpoint to load before the first generation, unless a donor's state came first."""
        self.lockstep: Lockstep | None = None
        """A replica of several ranks: how its ranks keep in step (replica.py); None else."""
        self.built_tensors: OwnTensors | None = None
        """The state as built, offered to a join's snapshot to be received into in place."""
        # Guards the hand-over between the receiver thread (which learns of new
        # generations first) and the main thread (which owns the group).
        self._group_lock = threading.Lock()
        self._newest_seen = 0
        channel.set_generation_hook(self._on_generation_seen)

    # ------------------------------------------------------------ the step operations

    @abstractmethod
    def _handle(self, command: pb.WorkerCommand) -> None:
        """Act on one command from the controller."""

    @abstractmethod
    def _enter_generation(self, view: pb.GenerationView) -> None:
        """Become a member of `view`'s generation (or hold it, while catching up)."""

    @abstractmethod
    def _apply(self, means: list, step: pb.CatchUpStep, commit_wait: float | None,
               checkpoint_now: bool = False, final: bool = False) -> None:
        """Apply a committed step (as a member, or catching up as a joiner)."""

    # ------------------------------------------------------------ abort path

    def _on_generation_seen(self, generation: int) -> None:
        """Receiver thread: a newer generation makes the current group's collectives moot."""
        with self._group_lock:
            self._newest_seen = max(self._newest_seen, generation)
            if self.group is not None and self.group.spec.generation < generation:
                # Logged: the moment a stalled recovery's survivor was told to move on.
                log.info("generation %d seen: aborting the group of generation %d",
                         generation, self.group.spec.generation, extra=self._ctx())
                self.group.abort()

    def _install_group(self, group: CrossReplicaGroup | None) -> None:
        with self._group_lock:
            old, self.group = self.group, group
            if group is not None and self._newest_seen > group.spec.generation:
                group.abort()  # the view was superseded before we even started
        if old is not None:
            old.abort()
            old.close()

    def _meet(self, group: CrossReplicaGroup, entered: float) -> bool:
        """Meet the generation's other members: on a thread beside the step's compute where
        the group allows it (meeting.py: the reduction waits for it), else here. False: the
        group failed to meet here, and was dropped."""
        self._meeting, self._resumed_at = None, entered
        if group.meets_in_background:
            self._meeting = Meeting(group)  # resumed: with the next microbatch, or once met
            return True
        try:
            group.connect()
        except CollectiveAborted as exc:
            log.warning("rebuild of generation %d aborted: %s", group.spec.generation, exc,
                        extra=self._ctx())
            self._install_group(None)
            return False
        self._say_resumed()
        return True

    def _say_resumed(self) -> None:
        """Tell the controller this member works on the generation's step again: computing,
        or (with nothing to compute) its group met."""
        if self._resumed_at is None:
            return
        self.channel.send(pb.WorkerReport(resumed=pb.Resumed(
            generation=self.generation, step=self.state.step, at=time.time(),
            rebuild_s=time.monotonic() - self._resumed_at)))
        self._resumed_at = None

    def _met(self, group: CrossReplicaGroup) -> str | None:
        """Wait for `group`'s meeting, if it is still meeting: None once it is usable, else
        why it is not (a failure of the step's reduction, handled as one)."""
        meeting = self._meeting
        if meeting is None or meeting.group is not group:
            return None
        failure = meeting.wait()
        if failure is None:
            log.info("generation %d: group met in %.1f ms", group.spec.generation,
                     (meeting.took_s or 0.0) * 1000, extra=self._ctx())
            self._meeting = None
            self._say_resumed()
        return failure

    # ------------------------------------------------------------ the state

    def _digest_pipeline(self) -> BackgroundDigests | None:
        """The background step digests, made on the first step applied, when they apply."""
        wanted = self.background_digests is not False and self.lockstep is None
        if self._digests is None and wanted:
            self._digests = BackgroundDigests(self.replica, self._hold_applied)
        return self._digests

    def _hold_applied(self, report: pb.WorkerReport) -> None:
        self._applied_held.append(report.applied)

    def held_applied(self) -> list[pb.Applied]:
        """The held `applied` reports, handed over to ride on a `reduced` one."""
        held, self._applied_held = self._applied_held, []
        return held

    def deliver_digests(self, idle: bool) -> None:
        """The step digests hashed meanwhile, in order; when `idle` (about to wait for a
        command: a stop or the job's end waits for them) all of them, sent now."""
        if self._digests is not None:
            self._digests.deliver(wait=idle)
            if idle:
                self._send_held_applied()

    def _send_held_applied(self) -> None:
        for applied in self.held_applied():
            self.channel.send(pb.WorkerReport(applied=applied))

    def parameters_about_to_change(self) -> None:
        """Every step digest that hashes the parameters in place is done (stepdigest.py)."""
        if self._digests is not None:
            self._digests.release()

    def settle_digests(self) -> None:
        """Every step digest in its ledger record and reported (a snapshot or a checkpoint
        of the ledger, or a joiner's catch-up step, is about to carry them)."""
        if self._digests is not None:
            self._digests.settle()
            self._send_held_applied()

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
        self.parameters_about_to_change()
        self.workload.load_state_dict(state["workload"])
        self.accumulator.load_state_dict(state["reduction"])
        if ledger is None:
            ledger = list(pb.Ledger.FromString(bytes(state["ledger"].numpy())).records)
        self.ledger = ledger
        self.state = StepState(step=step)
        self.state_loaded = True

    def load_checkpoint(self, resume: pb.ResumePoint) -> None:
        """The state a resumed job starts from: authenticated again here (the file may have
        changed since the launcher chose it), of the step the job resumes at, and holding
        the parameters the ledger committed for that step."""
        rank = self.lockstep.ranks.rank if self.lockstep is not None else 0
        path = str(rank_file(Path(resume.path), rank))
        try:
            meta, state = load_checkpoint(path)
        except (CheckpointError, OSError) as exc:
            raise contract_error(f"cannot resume from {resume.path}: {exc}",
                                 where="resume") from None
        if meta.step != resume.step:
            raise contract_error(f"cannot resume from {resume.path}: it holds the state before "
                                 f"step {meta.step}, the job resumes at {resume.step}",
                                 where="resume")
        self.load_training_state(state, meta.step, list(meta.ledger))
        committed = committed_digest(meta)
        # A checkpoint of a build before digest.DIGEST_SCHEME recorded the older digest.
        if committed is not None and self.workload.digest() != committed \
                and self.workload.digest(legacy=True) != committed:
            raise contract_error(f"cannot resume from {resume.path}: the parameters (or buffers) "
                                 f"loaded are not the ones the ledger committed after step {meta.step - 1}",
                                 where="resume")
        log.info("resumed from %s at step %d", resume.path, meta.step, extra=self._ctx())

    def _ctx(self) -> dict[str, int]:
        return {"step": self.state.step, "generation": self.generation, "replica": self.replica}
