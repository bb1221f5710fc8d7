"""The executor's side of joins (a mixin of StepExecutor, whose state it shares).

A member donates: on the controller's word it snapshots its state between two
steps and streams it, then every step it commits, to the joiner (joining.py
does the streaming). A joiner catches up: it loads the snapshot, applies each
streamed step as the donor did, and enters the generation that admits it.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from recover.proto import pb
from recover.trainer.joining import Catchup, Donation, catch_up_step
from recover.trainer.statewire import encode
from recover.trainer.stepstate import ORPHAN_WAIT_S
from recover.trainer.transfer import TransferError

if TYPE_CHECKING:
    from recover.trainer.executor import StepExecutor

    _Base = StepExecutor
else:
    _Base = object

log = logging.getLogger("recover.trainer")


class JoinSteps(_Base):
    # ------------------------------------------------------------ joins: the donor's side

    def _donate(self, command: pb.Donate) -> None:
        """Snapshot the state between two steps (parameters change only when a step is applied)
        and stream it, then every step committed from now on, to the joiner."""
        snapshot = encode(self.training_state())
        self.donations = [d for d in self.donations if not d.done.is_set()]
        step, faults = self.state.step, self.faults
        after_snapshot = ((lambda: faults.fire(step, "donate"))
                          if faults.armed(step, "donate") else None)
        self.donations.append(Donation(command, self.replica, snapshot, step, after_snapshot))
        log.info("donating state of step %d to replica %d (%.1f MB)", self.state.step,
                 command.joiner, snapshot.nbytes / 1e6, extra=self._ctx())

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
        try:
            catchup = Catchup(self.listener, command)
        except TransferError as exc:
            self._join_failed(command, str(exc))
            return
        try:
            self.load_training_state(catchup.state, catchup.step)
            if self.faults.armed(catchup.step, "join"):
                self.faults.fire(catchup.step, "join")
            self._report_join(command, catchup)
            while (committed := catchup.next()) is not None:
                self._apply(committed.grads, committed.step, None)
                self._report_join(command, catchup)
                while (next_command := self.channel.poll()) is not None:
                    self._handle(next_command)  # a shutdown ends it; an admission is held
        except TransferError as exc:
            admission = self._admission
            if admission is not None and admission.plan.step != self.state.step:
                # Admitted, but it can no longer catch up: die, be recovered like a crash.
                raise RuntimeError(f"lost the donor after being admitted: {exc}") from None
            if admission is None:
                self._join_failed(command, str(exc))
                return
            # Admitted with every step it needs (a spare replacing lost members): enter.
        finally:
            catchup.close()
        # The donor ends its stream once it sees this replica admitted: the admission is
        # here already, or on its way through the agent.
        while self.generation == 0 and self._admission is None:
            next_command = self.channel.next_command(ORPHAN_WAIT_S)
            if next_command is None:
                raise RuntimeError(f"the donor's stream ended but no admission came within "
                                   f"{ORPHAN_WAIT_S:.0f}s")
            self._handle(next_command)
        view, self._admission = self._admission, None
        if view is not None:
            self._enter_generation(view)

    def _report_join(self, command: pb.Join, catchup: Catchup) -> None:
        self.channel.send(pb.WorkerReport(join_progress=pb.JoinProgress(
            step=self.state.step, snapshot_bytes=catchup.snapshot_bytes,
            snapshot_s=catchup.snapshot_s, donor=command.donor)))

    def _join_failed(self, command: pb.Join, reason: str) -> None:
        log.warning("join failed: %s", reason, extra=self._ctx())
        self.channel.send(pb.WorkerReport(join_failed=pb.JoinFailed(donor=command.donor,
                                                                   reason=reason)))
