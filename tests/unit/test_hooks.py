"""Test concerns as step hooks (trainer/hooks.py, trainer/faults.py): a production job gets
no-ops, and every `--kill` phase fires at its own hook point and nowhere else (the
integration tests then check each phase end to end, with real SIGKILLs)."""

from __future__ import annotations

import threading

import pytest
import torch

from recover.proto import pb
from recover.trainer import faults as faults_module
from recover.trainer.faults import FaultHooks, FaultInjector, hooks_for
from recover.trainer.gradients import GradientBuckets
from recover.trainer.hooks import NO_POINTS, StepHooks

STEP = 3


def test_a_job_without_testing_settings_gets_the_no_op_hooks() -> None:
    note = [].append
    assert type(hooks_for(pb.TestingConfig(), 0, note)) is StepHooks
    elsewhere = pb.TestingConfig(faults=[pb.FaultSpec(step=1, replica=2, phase="forward")])
    assert type(hooks_for(elsewhere, 0, note)) is StepHooks  # another replica's fault
    assert isinstance(hooks_for(elsewhere, 2, note), FaultHooks)
    assert isinstance(hooks_for(pb.TestingConfig(compute_ms=5), 0, note), FaultHooks)
    hooks = StepHooks()
    assert hooks.before_microbatch(0, 0, 1, recomputed=True, params=[]) is NO_POINTS


class Recorder:
    """Drives every hook point of one step in the executor's order and notes where a fault
    struck: `kill` (synchronous phases) or the agent note (phases fired from a timer)."""

    def __init__(self, phase: str) -> None:
        self.point = ""
        self.killed_at: list[str] = []
        self.noted_at: list[tuple[str, str]] = []
        self.killed = threading.Event()
        spec = pb.FaultSpec(step=STEP, replica=0, phase=phase, microbatch=-1)
        self.hooks = FaultHooks(FaultInjector([spec], 0, self.note, kill=self.kill))
        self.param = torch.nn.Parameter(torch.ones(3))
        self.grads = GradientBuckets([self.param])

    def note(self, note: pb.FaultNote) -> None:
        self.noted_at.append((self.point, note.phase))

    def kill(self) -> None:
        self.killed_at.append(self.point)
        self.killed.set()

    def at(self, point: str) -> None:
        self.point = point

    def step(self, step: int, recomputed: bool = False) -> None:
        hooks = self.hooks
        self.at("on_startup")
        hooks.on_startup(step)
        self.at("on_rebuild")
        hooks.on_rebuild(step)
        for position in range(2):
            self.at(f"before_microbatch[{position}]")
            points = hooks.before_microbatch(step, position, 2, recomputed=recomputed,
                                             params=[self.param])
            loss = (self.param * 2).sum()
            self.at(f"before_backward[{position}]")
            points.before_backward()
            self.at(f"backward[{position}]")
            loss.backward()
            points.after_backward()
            self.at(f"after_microbatch[{position}]")
            hooks.after_microbatch(step, position, 2, self.grads)
        self.at("before_reduce")
        hooks.before_reduce(step)
        self.at("after_reported")
        hooks.after_reported(step)
        self.at("after_snapshot_sent")
        hooks.after_snapshot_sent(step)
        self.at("after_snapshot_loaded")
        hooks.after_snapshot_loaded(step)
        self.at("before_feeding")
        hooks.before_feeding(step)


@pytest.mark.parametrize("phase, point", [
    ("startup", "on_startup"),
    ("forward", "before_backward[1]"),  # the middle microbatch of two
    ("backward", "backward[1]"),
    ("commit", "after_reported"),
    ("donate", "after_snapshot_sent"),
    ("join", "after_snapshot_loaded"),
    ("feed", "before_feeding"),
])
def test_each_kill_phase_strikes_at_its_hook_point_only(phase: str, point: str) -> None:
    recorder = Recorder(phase)
    recorder.step(STEP - 1)
    assert recorder.killed_at == []
    recorder.step(STEP)
    assert recorder.killed_at == [point] and recorder.noted_at == [(point, phase)]
    if phase in ("donate", "join", "feed"):  # joins happen when they happen: at or after the step
        recorder.step(STEP + 1)
        assert recorder.killed_at == [point] * 2


def test_recompute_strikes_only_on_a_reassigned_microbatch() -> None:
    recorder = Recorder("recompute")
    recorder.step(STEP)
    assert recorder.killed_at == []
    recorder.step(STEP, recomputed=True)
    assert recorder.killed_at[0] == "before_microbatch[0]"  # a real kill ends it there


@pytest.mark.parametrize("phase, point", [("rebuild", "on_rebuild"), ("reduce", "before_reduce")])
def test_phases_inside_a_blocking_call_strike_from_a_timer(phase: str, point: str) -> None:
    recorder = Recorder(phase)
    recorder.step(STEP)
    assert recorder.noted_at == [(point, phase)]  # the note goes at once, the kill just after
    assert recorder.killed.wait(10)


def test_nan_poisons_the_middle_microbatch_gradient_and_compute_ms_sleeps(
        monkeypatch: pytest.MonkeyPatch) -> None:
    slept: list[float] = []
    monkeypatch.setattr(faults_module.time, "sleep", slept.append)
    recorder = Recorder("nan")
    recorder.hooks.compute_s = 0.25
    poisoned = []
    original = recorder.hooks.after_microbatch

    def watch(step: int, position: int, count: int, grads: GradientBuckets) -> None:
        original(step, position, count, grads)
        poisoned.append(bool(grads.buckets[0].flat.isnan().any()))
        grads.zero()

    recorder.hooks.after_microbatch = watch  # type: ignore[method-assign]
    recorder.step(STEP)
    assert poisoned == [False, True] and recorder.killed_at == []
    assert slept == [0.25, 0.25]
