"""`--slowdown` (trainer/slowdown.py): its specs, their checks as one-line usage errors, the
flag and job-file round trips, and the hooks that stretch a slowed replica's microbatches
(timed with a fake clock and sleep: nothing here waits on real time)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from recover.cli import jobfile
from recover.cli.jobargs import job_from_args, job_to_args
from recover.cli.main import build_parser, job_parser
from recover.proto import pb
from recover.trainer import faults as faults_module
from recover.trainer.faults import FaultHooks, FaultInjector, hooks_for
from recover.trainer.gradients import GradientBuckets
from recover.trainer.hooks import StepHooks
from recover.trainer.slowdown import (
    SlowdownSchedule,
    SlowdownSpecError,
    format_slowdown_spec,
    overlap,
    parse_slowdown_spec,
)
from tests.unit.test_cli_args import assert_one_line, no_launch, run_main  # noqa: F401 (autouse)


def spec(replica: int, factor: float, from_step: int = 0, until_step: int = 0) -> pb.SlowdownSpec:
    return pb.SlowdownSpec(replica=replica, factor=factor, from_step=from_step,
                           until_step=until_step)


# ---------------------------------------------------------------- specs

@pytest.mark.parametrize(("text", "expected", "canonical"), [
    pytest.param("replica=1,factor=2", spec(1, 2.0), "replica=1,factor=2.0", id="forever"),
    pytest.param("replica=0,factor=1.5,from_step=10", spec(0, 1.5, 10),
                 "replica=0,factor=1.5,from_step=10", id="from-a-step"),
    pytest.param("until_step=30,from_step=10,factor=3,replica=2", spec(2, 3.0, 10, 30),
                 "replica=2,factor=3.0,from_step=10,until_step=30", id="any-order-and-back"),
    pytest.param("replica=3,factor=4,until_step=5", spec(3, 4.0, 0, 5),
                 "replica=3,factor=4.0,until_step=5", id="only-at-first"),
    pytest.param("replica=1,factor=1", spec(1, 1.0), "replica=1,factor=1.0", id="factor-one"),
    pytest.param("replica=1,factor=99.9", spec(1, 99.9), "replica=1,factor=99.9",
                 id="just-below-100"),
    pytest.param(" replica=1, factor=1.1 ", spec(1, 1.1), "replica=1,factor=1.1", id="spaces"),
    pytest.param("replica=1,factor=1.0000000000000002", spec(1, 1.0000000000000002),
                 "replica=1,factor=1.0000000000000002", id="every-digit"),
    pytest.param("replica=70000,factor=2", spec(70000, 2.0), "replica=70000,factor=2.0",
                 id="a-later-replica-id"),
])
def test_slowdown_specs_parse_and_round_trip(text: str, expected: pb.SlowdownSpec,
                                             canonical: str) -> None:
    parsed = parse_slowdown_spec(text)
    assert parsed == expected
    assert format_slowdown_spec(parsed) == canonical
    assert parse_slowdown_spec(canonical) == parsed


@pytest.mark.parametrize(("text", "phrase"), [
    pytest.param("", "expected key=value pairs", id="empty"),
    pytest.param("slow", "expected key=value pairs", id="no-pairs"),
    pytest.param("replica=1,factor=", "expected key=value pairs", id="empty-value"),
    pytest.param("replica=1", "missing ['factor']", id="no-factor"),
    pytest.param("factor=2", "missing ['replica']", id="no-replica"),
    pytest.param("replica=1,factor=2,step=3", "unknown key(s) ['step']", id="unknown-key"),
    pytest.param("replica=1,factor=2,factor=3", "'factor' given twice", id="key-twice"),
    pytest.param("replica=one,factor=2", "replica, from_step and until_step must be integers",
                 id="non-integer-replica"),
    pytest.param("replica=1,factor=2,from_step=1.5", "must be integers", id="fractional-step"),
    pytest.param("replica=1,factor=fast", "factor must be a number", id="non-numeric-factor"),
    pytest.param("replica=-1,factor=2", "must not be negative", id="negative-replica"),
    pytest.param("replica=1,factor=2,from_step=-3", "must not be negative", id="negative-step"),
    pytest.param("replica=1,factor=0.5", "factor must be at least 1 and below 100, got 0.5",
                 id="a-speedup"),
    pytest.param("replica=1,factor=0", "factor must be at least 1", id="zero-factor"),
    pytest.param("replica=1,factor=100", "factor must be at least 1 and below 100, got 100",
                 id="factor-100"),
    pytest.param("replica=1,factor=nan", "factor must be at least 1", id="nan-factor"),
    pytest.param("replica=1,factor=inf", "factor must be at least 1", id="inf-factor"),
    pytest.param("replica=1,factor=2,from_step=5,until_step=5",
                 "until_step (5) must be above from_step (5)", id="empty-range"),
    pytest.param("replica=1,factor=2,until_step=0", "until_step (0) must be above from_step (0)",
                 id="until-zero"),
])
def test_bad_slowdown_specs_are_refused_in_one_line(text: str, phrase: str) -> None:
    with pytest.raises(SlowdownSpecError) as info:
        parse_slowdown_spec(text)
    message = str(info.value)
    assert message.startswith(f"malformed --slowdown {text!r}: ") and "\n" not in message
    assert phrase in message


@pytest.mark.parametrize(("specs", "expected"), [
    pytest.param([], None, id="none"),
    pytest.param([spec(1, 2), spec(2, 3)], None, id="two-replicas"),
    pytest.param([spec(1, 2, 0, 10), spec(1, 3, 10, 20)], None, id="back-to-back"),
    pytest.param([spec(1, 2, 20), spec(1, 3, 0, 20)], None, id="back-to-back-reversed"),
    pytest.param([spec(1, 2, 0, 10), spec(1, 3, 9, 20)], (0, 1), id="one-step-in-common"),
    pytest.param([spec(1, 2), spec(1, 3, 500, 501)], (0, 1), id="forever-covers-all"),
    pytest.param([spec(1, 2, 5), spec(1, 3, 50)], (0, 1), id="two-open-ended"),
    pytest.param([spec(0, 2, 0, 5), spec(1, 2), spec(0, 4, 3, 8)], (0, 2), id="third-spec"),
    pytest.param([spec(1, 2, 10, 20), spec(1, 3, 12, 14)], (0, 1), id="nested"),
])
def test_overlapping_slowdowns_of_one_replica_are_found(specs, expected) -> None:
    assert overlap(specs) == expected


def test_the_schedule_gives_each_step_its_factor() -> None:
    schedule = SlowdownSchedule([spec(1, 2.0, 3, 5), spec(1, 4.0, 8), spec(0, 9.0)], replica=1)
    assert [schedule.factor_at(step) for step in range(10)] == [
        1.0, 1.0, 1.0, 2.0, 2.0, 1.0, 1.0, 1.0, 4.0, 4.0]
    assert not SlowdownSchedule([spec(0, 9.0)], replica=1)
    assert not SlowdownSchedule([spec(1, 1.0)], replica=1)  # factor 1 slows nothing


# ---------------------------------------------------------------- the flag and the job file

def parse_job(argv: list[str], command: str = "controller") -> pb.JobConfig:
    parser = build_parser()
    jobfile.apply(job_parser(parser, (command,)), argv)
    return job_from_args(parser.parse_args([command, *argv]))


def test_slowdowns_round_trip_through_the_flags_in_order() -> None:
    job = parse_job(["-T", "40", "--job-id", "j", "--compute-ms", "5",
                     "--slowdown", "replica=2,factor=1.25,from_step=10,until_step=20",
                     "--slowdown", "replica=0,factor=3",
                     "--slowdown", "replica=2,factor=2,from_step=20"])
    assert list(job.testing.slowdowns) == [spec(2, 1.25, 10, 20), spec(0, 3.0),
                                           spec(2, 2.0, 20)]
    again = parse_job(job_to_args(job))
    assert again == job
    assert again.SerializeToString(deterministic=True) == job.SerializeToString(deterministic=True)
    assert not parse_job(["--job-id", "j"]).testing.slowdowns


def test_a_job_file_slows_replicas_and_flags_add_to_it(tmp_path: Path) -> None:
    path = tmp_path / "job.toml"
    path.write_text('[job]\nsteps = 30\n\n[testing]\ncompute_ms = 50\n'
                    'slowdown = ["replica=1,factor=2,from_step=5,until_step=15"]\n')
    job = parse_job(["--job", str(path)])
    assert list(job.testing.slowdowns) == [spec(1, 2.0, 5, 15)]
    job = parse_job(["--job", str(path), "--slowdown", "replica=1,factor=1.5,from_step=15"])
    assert list(job.testing.slowdowns) == [spec(1, 2.0, 5, 15), spec(1, 1.5, 15)]
    assert parse_job(job_to_args(job)) == job


@pytest.mark.parametrize(("argv", "phrase"), [
    pytest.param(["--slowdown", "replica=1,factor=0.5"],
                 "malformed --slowdown 'replica=1,factor=0.5': factor must be at least 1",
                 id="speedup"),
    pytest.param(["--slowdown", "replica=1,factor=100"], "factor must be at least 1 and below 100",
                 id="factor-100"),
    pytest.param(["--slowdown", "replica=1"], "missing ['factor']", id="no-factor"),
    pytest.param(["--slowdown", "replica=1,factor=2,colour=red"], "unknown key(s) ['colour']",
                 id="unknown-key"),
    pytest.param(["--steps", "10", "--slowdown", "replica=1,factor=2,from_step=10"],
                 "--slowdown 'replica=1,factor=2,from_step=10': from_step 10 is beyond the last "
                 "step (9)", id="beyond-the-last-step"),
    pytest.param(["--slowdown", "replica=1,factor=2", "--slowdown",
                  "replica=1,factor=3,from_step=5,until_step=9"],
                 "--slowdown 'replica=1,factor=2' and 'replica=1,factor=3,from_step=5,"
                 "until_step=9' slow replica 1 in the same steps", id="overlap"),
])
@pytest.mark.parametrize("command", ["run", "controller"])
def test_slowdown_mistakes_exit_2_with_one_line(capsys, tmp_path: Path, command: str,
                                                argv: list[str], phrase: str) -> None:
    argv = [command, *argv]
    if command == "run":
        argv += ["--out", str(tmp_path / "out"), "--quiet"]
    code, out, err = run_main(capsys, argv)
    assert code == 2 and out == ""
    assert_one_line(err, phrase)


def test_a_job_file_slowdown_mistake_is_one_line(capsys, tmp_path: Path) -> None:
    path = tmp_path / "job.toml"
    path.write_text('[testing]\nslowdown = "replica=1,factor=2"\n')
    code, out, err = run_main(capsys, ["controller", "--job", str(path)])
    assert code == 2 and out == ""
    assert_one_line(err, "[testing] slowdown must be a list of strings")


@pytest.mark.parametrize(("argv", "phrase"), [
    pytest.param(["bench", "throughput", "--schedule", "s.json", "--out", "o"],
                 "recover bench throughput: the ckpt-restart baseline does not emulate --slowdown",
                 id="throughput"),
    pytest.param(["bench", "overhead", "--out", "o"],
                 "recover bench overhead: the DDP baseline does not emulate --slowdown",
                 id="overhead"),
    pytest.param(["run", "--mode", "ckpt-restart", "--out", "o"],
                 "--mode ckpt-restart does not emulate --slowdown", id="ckpt-restart"),
])
def test_baselines_that_cannot_slow_a_replica_refuse_the_flag(capsys, tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch,
                                                               argv: list[str],
                                                               phrase: str) -> None:
    monkeypatch.chdir(tmp_path)
    code, out, err = run_main(capsys, [*argv, "--slowdown", "replica=0,factor=2"])
    assert code == 2 and out == ""
    assert_one_line(err, phrase)


# ---------------------------------------------------------------- the hooks

class FakeTime:
    """A clock that only moves when something sleeps on it or the test says so."""

    def __init__(self) -> None:
        self.now = 100.0
        self.slept: list[float] = []

    def clock(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept.append(round(seconds, 9))
        self.now += seconds


def microbatch(hooks: StepHooks, step: int, compute_s: float, fake: FakeTime,
               grads: GradientBuckets) -> None:
    """One microbatch as the executor drives it, whose real compute takes `compute_s`."""
    points = hooks.before_microbatch(step, 0, 2, recomputed=False, params=[])
    fake.now += compute_s / 2  # the forward pass
    points.before_backward()
    fake.now += compute_s / 2  # the backward pass
    points.after_backward()
    hooks.after_microbatch(step, 0, 2, grads)


@pytest.fixture
def grads() -> GradientBuckets:
    return GradientBuckets([torch.nn.Parameter(torch.ones(3))])


def test_a_slowed_microbatch_sleeps_factor_minus_one_times_its_compute(grads) -> None:
    fake = FakeTime()
    slowdown = SlowdownSchedule([spec(1, 3.0, 2, 4), spec(1, 1.5, 4)], replica=1)
    hooks = FaultHooks(FaultInjector([], 1, [].append), compute_ms=20, slowdown=slowdown,
                       clock=fake.clock, sleep=fake.sleep)
    took = {}
    for step in range(6):
        fake.slept.clear()
        started = fake.now
        microbatch(hooks, step, 0.030, fake, grads)
        took[step] = (round(fake.now - started, 9), list(fake.slept))
    # Real 30 ms + emulated 20 ms = 50 ms of compute; a factor F adds (F - 1) x 50 ms.
    assert took == {
        0: (0.05, [0.02]), 1: (0.05, [0.02]),
        2: (0.15, [0.02, 0.1]), 3: (0.15, [0.02, 0.1]),  # factor 3, from step 2 until 4
        4: (0.075, [0.02, 0.025]), 5: (0.075, [0.02, 0.025]),  # then 1.5, to the end
    }


def test_the_slowdown_stretches_real_compute_without_compute_ms(grads) -> None:
    fake = FakeTime()
    hooks = FaultHooks(FaultInjector([], 0, [].append), slowdown=SlowdownSchedule(
        [spec(0, 2.5)], 0), clock=fake.clock, sleep=fake.sleep)
    microbatch(hooks, 7, 0.2, fake, grads)
    assert fake.slept == [0.3]


def test_a_slow_faults_sleep_is_not_slowed(monkeypatch: pytest.MonkeyPatch, grads) -> None:
    fake = FakeTime()
    monkeypatch.setattr(faults_module.time, "sleep", fake.sleep)  # the slow fault's own sleep
    kill = pb.FaultSpec(step=1, replica=0, phase="slow", microbatch=-1, seconds=0.5)
    hooks = FaultHooks(FaultInjector([kill], 0, [].append), slowdown=SlowdownSchedule(
        [spec(0, 2.0)], 0), clock=fake.clock, sleep=fake.sleep)
    microbatch(hooks, 1, 0.04, fake, grads)
    assert fake.slept == [0.5, 0.04]  # the fault's 0.5 s, then (2 - 1) x 40 ms of compute


def test_hooks_for_slows_only_the_named_replica() -> None:
    note = [].append
    testing = pb.TestingConfig(slowdowns=[spec(2, 2.0, 5)])
    assert type(hooks_for(testing, 0, note)) is StepHooks  # the failure-free path: no-ops
    slowed = hooks_for(testing, 2, note)
    assert isinstance(slowed, FaultHooks) and slowed.slowdown.factor_at(5) == 2.0
    assert type(hooks_for(pb.TestingConfig(slowdowns=[spec(2, 1.0)]), 2, note)) is StepHooks
