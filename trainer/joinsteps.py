"""The executor's side of joins: a layer of StepExecutor, built on the state it shares
(executorbase.py) and on the step operations StepExecutor implements.

A member donates: on the controller's word it snapshots its state between two
steps and streams it, then every step it commits, to the joiner (joining.py
does the streaming). A joiner catches up: it loads the snapshot, applies each
streamed step as the donor did, and enters the generation that admits it.
"""

from __future__ import annotations

import functools
import logging

from recover.proto import pb
from recover.trainer.destinations import own_tensors
from recover.trainer.executorbase import ExecutorBase
from recover.trainer.joining import Catchup, Donation, catch_up_step
from recover.trainer.statewire import encode
from recover.trainer.stepstate import ORPHAN_WAIT_S
from recover.trainer.transfer import TransferError

log = logging.getLogger("recover.trainer")


class JoinSteps(ExecutorBase):
    # ------------------------------------------------------------ joins: the donor's side

    def _donate(self, command: pb.Donate) -> None:
        """Snapshot the state between two steps (parameters change only when a step is applied)
        and stream it, then every step committed from now on, to the joiner."""
        if self.lockstep is not None:  # rank k of the donor streams to rank k of the joiner
            command = self._my_part(command)
        self.settle_digests()  # the snapshot's ledger holds every applied step's digest
        snapshot = encode(self.training_state())
        self.donations = [d for d in self.donations if not d.done.is_set()]
        step = self.state.step
        self.donations.append(Donation(command, self.replica, snapshot, step,
                                       functools.partial(self.hooks.after_snapshot_sent, step)))
        log.info("donating state of step %d to replica %d (%.1f MB)", self.state.step,
                 command.joiner, snapshot.nbytes / 1e6, extra=self._ctx())

    def _my_part(self, command: pb.Donate) -> pb.Donate:
        """The joiner's address (and certificate) for this rank: a replica of several ranks
        reports one per rank, in rank order, separated by commas (the controller passes them
        on as they are)."""
        assert self.lockstep is not None
        addresses = command.address.split(",")
        pins = command.tls_sha256.split(",") if command.tls_sha256 else [""] * len(addresses)
        ranks = self.lockstep.ranks
        if len(addresses) != ranks.size or len(pins) != ranks.size:
            raise RuntimeError(f"replica {command.joiner} gave {len(addresses)} transfer "
                               f"addresses and {len(pins)} certificates for a replica of "
                               f"{ranks.size} ranks")
        mine = pb.Donate()
        mine.CopyFrom(command)
        mine.address, mine.tls_sha256 = addresses[ranks.rank], pins[ranks.rank]
        return mine

    def _feed_joiners(self, step: pb.CatchUpStep, means: list) -> None:
        self.donations = [d for d in self.donations if not d.done.is_set()]
        for donation in self.donations:
            message = catch_up_step(step.step, step.loss, step.microbatches, step.tokens,
                                    step.generation, means)
            message.record.CopyFrom(step.record)
            donation.offer(message, means)

    # ------------------------------------------------------------ joins: the joiner's side

    def _join(self, command: pb.Join) -> None:
        """Load a donor's snapshot, apply every step it commits since, and enter the
        generation that admits this replica at the step where the donor's stream ends."""
        if self.generation > 0 or self.listener is None:
            return  # a member already (a stale command)
        self._pending_join = None
        self.join_failure_reported = False
        try:
            # A state as built is worthless: the snapshot may be received straight into it.
            if not self.state_loaded and self.built_tensors is None:
                self.built_tensors = own_tensors(self.training_state(with_ledger=False))
            catchup = Catchup(self.listener, command, stop=self._stop_waiting,
                              own=None if self.state_loaded else self.built_tensors)
        except TransferError as exc:
            self._join_ended(command, str(exc))
            return
        self.catching_up = True
        try:
            self.load_training_state(catchup.state, catchup.step)
            self.built_tensors = None  # loaded: nothing of the state as built is needed now
            self.hooks.after_snapshot_loaded(catchup.step)
            # The controller checks what was loaded against the committed digest. On the
            # step digests' threads: a large model's hash is on the join's critical path.
            pipeline = self._digest_pipeline()
            self._report_join(command, catchup, self.workload.digest(
                pool=pipeline.chunk_pool if pipeline is not None else None))
            while (committed := catchup.next()) is not None:
                self._apply(committed.grads, committed.step, None)
                self._report_join(command, catchup)
                self._poll_while_joining()
                if self._pending_join is not None:
                    raise TransferError("the controller started another attempt")
        except TransferError as exc:
            self.catching_up = False
            self._join_ended(command, str(exc))
            return
        finally:
            self.catching_up = False
            catchup.close()
        # The donor ends its stream once it sees this replica admitted: the admission is
        # here already, or on its way through the agent. (A replica of several ranks takes
        # it from its main loop, where rank 0 hands it to the others: replica.Lockstep.)
        while (self.lockstep is None and self.generation == 0 and self._admission is None
               and self._pending_join is None):
            next_command = self.channel.next_command(ORPHAN_WAIT_S)
            if next_command is None:
                raise RuntimeError(f"the donor's stream ended but no admission came within "
                                   f"{ORPHAN_WAIT_S:.0f}s")
            self._handle(next_command)
        self._join_ended(command, "")

    def _stop_waiting(self) -> bool:
        """Asked while waiting for a donor: commands may make the wait moot."""
        if self.lockstep is not None:
            return False  # its ranks handle commands only in step, from the main loop
        self._poll_while_joining()
        admitted = self._admission is not None and self._admission.plan.step == self.state.step
        return admitted or self._pending_join is not None

    def _poll_while_joining(self) -> None:
        if self.lockstep is not None:
            # A replica of several ranks handles commands only from its main loop, where
            # rank 0 hands each to the others: while its ranks catch up (each from its donor
            # rank, at its own pace) they stay queued. The donor's stream ends on the
            # admission either way; a shutdown or a new attempt waits for the stream's end.
            return
        while (next_command := self.channel.poll()) is not None:
            if next_command.WhichOneof("kind") == "join":
                self._pending_join = next_command.join  # a new attempt replaces this one
            else:
                self._handle(next_command)  # a shutdown ends it; an admission is held

    def _join_ended(self, command: pb.Join, failure: str) -> None:
        """After a join attempt: enter if admitted with every step it needs (a spare taking
        lost members' place), start a newer attempt, or say why it failed."""
        view = self._admission
        if view is not None and view.plan.step == self.state.step:
            self._admission = None
            self._enter_generation(view)
            return
        if view is not None:
            self._admission = None
            if not failure or self.lockstep is not None:
                # A replica of several ranks cannot tell that all its ranks fell short
                # alike: it is recovered as from a crash (its agent restarts it).
                raise RuntimeError(f"admitted at step {view.plan.step} while at step "
                                   f"{self.state.step}, with no donor left: {failure}")
            # Its donor died a step short: the failure report makes the controller take it
            # out of the step and start another attempt (losses.py, `_demote`).
            failure = f"admitted at step {view.plan.step} one step short: {failure}"
        if failure:
            log.warning("join failed: %s", failure, extra=self._ctx())
        if failure and self._pending_join is None:  # else the controller moved on already
            self.join_failure_reported = True
            self.channel.send(pb.WorkerReport(join_failed=pb.JoinFailed(
                donor=command.donor, reason=failure, attempt=command.attempt,
                step=self.state.step if self.state_loaded else -1)))
        pending, self._pending_join = self._pending_join, None
        if pending is not None:
            self._join(pending)

    def _report_join(self, command: pb.Join, catchup: Catchup, digest: str = "") -> None:
        self.channel.send(pb.WorkerReport(join_progress=pb.JoinProgress(
            step=self.state.step, snapshot_bytes=catchup.snapshot_bytes,
            snapshot_s=catchup.snapshot_s, donor=command.donor, attempt=command.attempt,
            param_sha256=digest)))

    def _ready_to_enter(self, view: pb.GenerationView) -> bool:
        """May this replica, in no generation yet, enter `view` now? A joiner still catching
        up enters once it has (the view is kept); one whose join failed waits for another;
        one that holds an older step with no donor streaming to it cannot (an error). A
        replica that starts with a resumed job loads its checkpoint here."""
        if view.plan.step > self.state.step:
            if not self.catching_up and self.join_failure_reported and self.lockstep is None:
                # Admitted before the controller read this joiner's failure report: the
                # report takes it out of this generation (losses.py, `_demote`).
                log.info("generation %d admits this replica at step %d, but it holds the "
                         "state before step %d: waiting for another join", view.generation,
                         view.plan.step, self.state.step, extra=self._ctx())
                return False
            if not self.catching_up:
                raise RuntimeError(f"generation {view.generation} admits this replica at step "
                                   f"{view.plan.step}, but it holds the state before step "
                                   f"{self.state.step} and no donor streams to it")
            self._admission = view  # a joiner still catching up: enter once it has
            return False
        if self.resume is not None and not self.state_loaded:
            self.load_checkpoint(self.resume)  # a replica that starts with a resumed job
        if self.built_tensors is not None and self.built_tensors.used and not self.state_loaded:
            raise RuntimeError("admitted as built, but a failed join overwrote the built state")
        return True
