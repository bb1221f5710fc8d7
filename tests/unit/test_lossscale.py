"""Dynamic loss scaling (trainer/lossscale.py): the rule table-tested on its decisions and
reasons, the exact accumulator's non-finite microbatches, and the executor in one process
(tests/unit/test_executor_fake.py's replicas as threads on the fake group): float16
autocast with steps skipped for overflow, the same steps on every replica, through a loss,
bitwise equal to the failure-free run."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from torch import nn

from recover.trainer.buffers import reduced_buckets
from recover.trainer.executor import StepExecutor
from recover.trainer.gradients import GradientBuckets
from recover.trainer.lossscale import LossScale, LossScaler, ScaleState, make_scaler, next_scale
from recover.trainer.reduction import ExactAccumulator, make_accumulator
from recover.trainer.workload import StepInfo
from tests.unit import test_executor_fake as fake

torch.set_num_threads(1)

CONFIG = LossScale(init_scale=8.0, growth_factor=2.0, backoff_factor=0.5, growth_interval=3)


@pytest.mark.parametrize(("state", "finite", "want", "skip", "reason"), [
    (ScaleState(8.0), True, ScaleState(8.0, 1), False,
     "finite at scale 8 (1 of 3 before it grows)"),
    (ScaleState(8.0, 1), True, ScaleState(8.0, 2), False,
     "finite at scale 8 (2 of 3 before it grows)"),
    (ScaleState(8.0, 2), True, ScaleState(16.0, 0), False, "3 finite steps at scale 8: scale 16"),
    (ScaleState(8.0, 2), False, ScaleState(4.0, 0), True,
     "gradient not finite at scale 8: step skipped, scale 4"),
    (ScaleState(0.5), False, ScaleState(0.25), True,
     "gradient not finite at scale 0.5: step skipped, scale 0.25"),
])
def test_next_scale(state: ScaleState, finite: bool, want: ScaleState, skip: bool,
                    reason: str) -> None:
    decision = next_scale(CONFIG, state, finite)
    assert (decision.state, decision.skip, decision.reason) == (want, skip, reason)


@pytest.mark.parametrize(("config", "problem"), [
    (LossScale(), None),
    (LossScale(init_scale=0.0), "init_scale must be a positive number, got 0.0"),
    (LossScale(init_scale=math.inf), "init_scale must be a positive number, got inf"),
    (LossScale(growth_factor=1.0), "growth_factor must be above 1, got 1.0"),
    (LossScale(backoff_factor=1.0), "backoff_factor must be between 0 and 1, got 1.0"),
    (LossScale(growth_interval=0), "growth_interval must be at least 1, got 0"),
])
def test_config_check(config: LossScale, problem: str | None) -> None:
    assert config.check() == problem


@pytest.mark.parametrize(("args", "problem"), [
    (dict(loss_scale=2.0 ** 16), "pass rt.LossScale(...), got float"),
    (dict(loss_scale=LossScale(growth_interval=0)), "growth_interval must be at least 1, got 0"),
    (dict(has_loss_fn=False), "needs loss_fn"),
    (dict(sharded=True), "not supported with several ranks per replica yet"),
    (dict(model=nn.Linear(2, 2).half()), "the model has float16 parameters: keep them float32"),
])
def test_make_scaler_refuses_in_one_line(args: dict[str, Any], problem: str) -> None:
    given: dict[str, Any] = dict(loss_scale=LossScale(), model=nn.Linear(2, 2), has_loss_fn=True,
                                 sharded=False) | args
    with pytest.raises(ValueError, match=problem.replace("(", r"\(").replace(")", r"\)")) as caught:
        make_scaler(given.pop("loss_scale"), given.pop("model"), **given)
    assert "\n" not in str(caught.value)


def test_scaler_state_round_trips() -> None:
    scaler = LossScaler(CONFIG)
    scaler.commit(finite=False)
    scaler.commit(finite=True)
    other = LossScaler(CONFIG)
    other.load_state_dict(scaler.state_dict())
    assert other.state == scaler.state == ScaleState(4.0, 1)


def test_exact_accumulator_skips_a_non_finite_scaled_gradient_instead_of_redoing() -> None:
    """A microbatch whose loss-scaled gradient is not finite makes the step's mean NaN (a
    float sum would be too) without an overflow (no redo can make it fit); a finite one that
    only overflows its fixed-point scale still counts as overflow."""
    params = [nn.Parameter(torch.zeros(4))]
    flat = GradientBuckets(params)
    acc = ExactAccumulator(flat, 4, loss_scaled_buckets=1)
    for gradient in ([1.0, 2.0, 3.0, 4.0], [1.0, math.inf, 3.0, 4.0], [math.nan, 0, 0, 0]):
        acc.before_microbatch()
        flat.buckets[0].flat.add_(torch.tensor(gradient))
        acc.after_microbatch(1.0)
    reduced = acc.finish(acc.buffers())
    assert (reduced.overflow, reduced.microbatches, reduced.loss) == (0, 3, 1.0)
    assert torch.isnan(reduced.grads[0]).all()
    acc.reset()
    acc.before_microbatch()
    flat.buckets[0].flat.add_(torch.tensor([1e30, 0.0, 0.0, 0.0]))  # finite, far too large
    acc.after_microbatch(1.0)
    assert acc.finish(acc.buffers()).overflow == 1
    # Without loss scaling a non-finite gradient is an overflow, as before.
    plain = make_accumulator("exact", reduced_buckets(flat, None), 4)
    plain.before_microbatch()
    flat.buckets[0].flat.add_(torch.tensor([math.inf, 0.0, 0.0, 0.0]))
    plain.after_microbatch(1.0)
    assert plain.finish(plain.buffers()).overflow == 1


# ---------------------------------------------------------------- the executor, in-process

SCALE = LossScale(init_scale=2.0 ** 24, backoff_factor=2.0 ** -6, growth_interval=2)
"""Float16 gradients of this model overflow at 2**24 and 2**18 (some at 2**16), not at 2**12:
the four steps skip, skip, step, step, and the scale then grows."""


def half_mse(model: nn.Module, batch: Any) -> torch.Tensor:
    with torch.autocast("cpu", dtype=torch.float16):
        out = model(batch[0])
    return nn.functional.mse_loss(out.float(), batch[1])


def with_loss_scaling(mode: str, infos: dict[int, list[StepInfo]]):
    def prepare(executors: dict[int, StepExecutor]) -> None:
        for replica, executor in executors.items():
            workload = executor.workload
            workload.loss_fn = half_mse
            workload.loss_scaler = LossScaler(SCALE)
            workload.on_step_committed = infos.setdefault(replica, []).append
            executor.accumulator = make_accumulator(
                mode, reduced_buckets(executor.grads, workload.model_buffers), fake.M,
                loss_scaled_buckets=len(executor.grads.buckets), loss_scale=SCALE.init_scale)
    return prepare


def scaled_run(mode: str = "exact", **kwargs: Any) -> tuple[fake.Run, dict[int, list[StepInfo]]]:
    infos: dict[int, list[StepInfo]] = {}
    return fake.train(reduce=mode, prepare=with_loss_scaling(mode, infos), **kwargs), infos


def trajectory(infos: list[StepInfo]) -> list[tuple[int, float | None, bool]]:
    return [(i.step, i.loss_scale, i.skipped) for i in infos]


@pytest.fixture(scope="module")
def scaled_baseline() -> tuple[fake.Run, dict[int, list[StepInfo]]]:
    return scaled_run()


def test_overflowing_steps_are_skipped_on_every_replica_and_the_scale_follows(
        scaled_baseline: tuple[fake.Run, dict[int, list[StepInfo]]]) -> None:
    run, infos = scaled_baseline
    want = [(0, 2.0 ** 24, True), (1, 2.0 ** 18, True), (2, 2.0 ** 12, False),
            (3, 2.0 ** 12, False)]
    assert all(trajectory(infos[r]) == want for r in range(fake.REPLICAS)), infos
    # A skipped step leaves the parameters as they were: step 0's digest is the initial one.
    first = run.executors[0]
    assert run.controller.digests[0][0] == run.controller.digests[1][0]
    # After two finite steps the scale grew: it is the next step's.
    assert first.workload.loss_scaler is not None
    assert first.workload.loss_scaler.state == ScaleState(2.0 ** 13, 0)
    # Unscaled exactly: the parameters differ from the unscaled float32 run's only by the
    # float16 forward, and they moved.
    assert run.controller.digests[2][0] != run.controller.digests[1][0]


@pytest.mark.parametrize("phase", ["backward", "commit"])
def test_a_loss_during_a_skipped_step_changes_nothing(
        scaled_baseline: tuple[fake.Run, dict[int, list[StepInfo]]], phase: str) -> None:
    baseline, want = scaled_baseline
    run, infos = scaled_run(faults=(fake.kill(1, 1, phase),),
                            hold={1} if phase == "commit" else None)
    fake.assert_survivors_match(run, baseline, lost=[1])
    for replica in (0, 2):
        assert trajectory(infos[replica]) == trajectory(want[0])


def test_fast_mode_skips_the_same_steps(
        scaled_baseline: tuple[fake.Run, dict[int, list[StepInfo]]]) -> None:
    _, exact = scaled_baseline
    run, infos = scaled_run("fast", faults=(fake.kill(2, 2, "forward"),))
    assert run.controller.lost == [2]
    assert trajectory(infos[0]) == trajectory(infos[1]) == trajectory(exact[0])


def test_the_scale_travels_with_the_training_state() -> None:
    """What a joiner receives and a checkpoint holds (Workload.state_dict) carries the scale."""

    def workload() -> Any:
        from recover.trainer.sources import FunctionMicrobatches
        from recover.trainer.workload import Workload

        model = fake.mlp()
        return Workload(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                        source=FunctionMicrobatches(fake.data), seed=1, loss_fn=half_mse,
                        loss_scaler=LossScaler(CONFIG))

    donor, joiner = workload(), workload()
    assert donor.loss_scaler is not None and joiner.loss_scaler is not None
    donor.loss_scaler.commit(finite=False)
    joiner.load_state_dict(donor.state_dict())
    assert joiner.loss_scaler.state == ScaleState(4.0)
