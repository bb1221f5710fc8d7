"""Carries out the effects that transitions ask for (controller/effects.py), in their order.

The coordinator (controller/coordinator.py) runs a transition, freezes the new view and
hands each effect here: those that never wait (messages, events, failure records,
counters) are carried out at once; store writes and the end are awaited, so every store
write lands before the messages that depend on it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from recover.controller import effects
from recover.controller.events import EventLog
from recover.controller.inflight import StepInFlight
from recover.controller.ledger import Ledger
from recover.controller.records import Records
from recover.controller.recoveries import RecoveryTracker, observed_phase
from recover.controller.view import JobView
from recover.proto import pb

Send = Callable[[str, pb.ControllerMessage], None]
SendAll = Callable[[tuple[str, ...], pb.ControllerMessage], None]


def _one_by_one(send: Send) -> SendAll:
    def send_all(agent_ids: tuple[str, ...], message: pb.ControllerMessage) -> None:
        for agent_id in agent_ids:
            send(agent_id, message)
    return send_all


class EffectInterpreter:
    def __init__(self, *, view: Callable[[], JobView], send: Send, records: Records,
                 events: EventLog, recovery: RecoveryTracker, ledger: Ledger,
                 inflight: StepInFlight, clock: Callable[[], float],
                 send_all: SendAll | None = None) -> None:
        self._view = view
        """The view the effects were asked for (the coordinator's, just frozen)."""
        self._send = send
        self._send_all = send_all or _one_by_one(send)
        """One message to many agents (the sessions' own checks leadership once for all)."""
        self._records = records
        self._events = events
        self._recovery = recovery
        self._ledger = ledger
        self._inflight = inflight
        self._clock = clock
        self.stale_reports = 0
        """Reports fenced off as stale (an older generation or step, a replaced attempt)."""
        self.transfers: list[tuple[int, float]] = []
        """(bytes, seconds) of every snapshot transferred, for metrics and the summary."""
        self.done = asyncio.Event()
        """Set once the job's end is stored and announced."""
        self._ending: asyncio.Future[None] | None = None
        """The end being announced (held so the shielded task is not collected)."""

    def now(self, effect: effects.Effect) -> bool:
        """Carry out an effect that never waits; False: it must be awaited (`later`)."""
        match effect:
            case effects.Send(agent_id, message):
                self._send(agent_id, message)
            case effects.Broadcast(agent_ids, message):
                self._send_all(agent_ids, message)
            case effects.Emit(kind, message, step, generation, replica, level, pid):
                self._events.emit(kind, message, step=step, generation=generation,
                                  replica=replica, level=level, pid=pid)
            case effects.RecordFailure():
                progress = self._inflight.progress
                phase = effect.phase or observed_phase(
                    effect.replica, started=effect.started, resumed=progress.resumed,
                    reduced=progress.reduced)
                self._recovery.failed(effect.replica, effect.cause, effect.exited,
                                      step=effect.step, generation=effect.generation,
                                      phase=phase, during_training=effect.during_training)
                self._inflight.member_failed(effect.replica)
            case effects.Stale():
                self.stale_reports += 1
            case effects.Transferred(nbytes, seconds):
                self.transfers.append((nbytes, seconds))
            case _:
                return False
        return True

    async def later(self, effect: effects.Effect) -> None:
        """Carry out an effect that waits on the store (or the job's end)."""
        match effect:
            case effects.SaveAgent(job, record):
                await self._records.save_agent(job, record)
            case effects.SaveJob(job):
                await self._records.save_job(job)
            case effects.SaveWorkload(workload):
                await self._records.save_workload(workload)
            case effects.StartGeneration(view):
                self._inflight.new_generation()
                self._recovery.generation_started()
                await self._records.save_view(view, self._events.take_pending())
                self._inflight.generation_started(self._view())
            case effects.CommitStep(record, next_plan):
                before_store = self._clock()
                await self._records.commit_step(record, self._ledger.last, next_plan)
                self._recovery.committed(before_store)
                self._ledger.committed(record)
                self._inflight.step_committed(self._view() if next_plan is not None else None)
            case effects.SavePlan(plan):
                await self._records.save_plan(plan)
            case effects.SaveLastStep():
                await self._records.save_step(self._ledger.steps[-1])
            case effects.End():
                # Shielded: the caller is usually an agent's stream handler, and the agent
                # closes its stream as soon as it hears the shutdown, which cancels the
                # handler; the end must still run to `done` (or the controller never
                # writes its summary nor exits).
                self._ending = asyncio.ensure_future(self._announce_end(effect))
                await asyncio.shield(self._ending)
            case _:
                raise AssertionError(f"no way to carry out {effect!r}")

    async def _announce_end(self, end: effects.End) -> None:
        await self._records.save_result(end.result)
        shutdown = pb.ControllerMessage(shutdown=end.result)
        for agent_id in end.agents:
            self._send(agent_id, shutdown)
        await self._events.flush()
        self.done.set()
