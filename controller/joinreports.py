"""The joins of the running job as the gRPC layer, metrics and tests see them: their state
is in the job's view (`JobView.joins`), their reports run joinflow's and losses'
transitions through the coordinator's runners."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from recover.controller import joinflow, losses
from recover.controller.joins import Join
from recover.controller.view import JobView
from recover.proto import pb


class JoinReports:
    """Reads the joins from the view in force; hands each join report to its transition."""

    def __init__(self, view: Callable[[], JobView], steps: Callable[[], list[pb.StepRecord]],
                 transfers: list[tuple[int, float]], run: Callable[..., Any],
                 run_now: Callable[..., Any]) -> None:
        self._view = view
        self._steps = steps
        """The ledger (the coordinator replaces the list on a takeover or a resume)."""
        self._transfers = transfers
        self._run = run
        self._run_now = run_now

    @property
    def joins(self) -> Mapping[int, Join]:
        return self._view().joins

    @property
    def spares(self) -> list[int]:
        return self._view().spares

    @property
    def joined(self) -> int:
        return self._view().joined

    @property
    def abandoned(self) -> int:
        return self._view().abandoned

    @property
    def transfers(self) -> list[tuple[int, float]]:
        """(bytes, seconds) of every snapshot transferred."""
        return self._transfers

    def progress(self, replica: int, msg: pb.JoinProgress) -> None:
        steps = self._steps()
        before = msg.step - 1  # the snapshot holds the state after this step
        committed = ({d.param_sha256 for d in steps[before].param_sha256}
                     if msg.param_sha256 and 0 <= before < len(steps) else set())
        self._run_now(joinflow.progress, replica, msg, committed)

    async def failed(self, replica: int, msg: pb.JoinFailed) -> None:
        await self._run(losses.join_failed, replica, msg)

    def retry_waiting(self) -> None:
        self._run_now(joinflow.retry_waiting)
