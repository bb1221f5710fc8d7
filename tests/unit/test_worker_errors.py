"""When a worker's exit ends the job (controller/worker_errors.py): the decision and its reason."""

from __future__ import annotations

import pytest

from recover.controller.worker_errors import (
    ANY_MICROBATCH,
    determinism_mismatch,
    error_keys,
    failure_cause,
    judge_exit,
)
from recover.proto import pb


def error(where: str = "loss_fn", step: int = 3, microbatch: int = 5, deterministic: bool = False,
          message: str = "loss_fn raised at step 3, microbatch 5: ZeroDivisionError: x"
          ) -> pb.WorkerError:
    return pb.WorkerError(where=where, step=step, microbatch=microbatch, message=message,
                          deterministic=deterministic)


def exited(replica: int = 1, code: int = 0, signal: int = 0, attached: bool = True,
           err: pb.WorkerError | None = None, tail: str = "") -> pb.WorkerExited:
    report = pb.WorkerExited(replica=replica, exit_code=code, signal=signal, attached=attached,
                             output_tail=tail)
    if err is not None:
        report.error.CopyFrom(err)
    return report


ROWS = [
    # (exit, training, earlier errors) -> (fatal, reason fragment)
    pytest.param(exited(signal=9), True, {}, False, "replica 1 exited (signal 9)", id="crash"),
    pytest.param(exited(err=error()), True, {}, False, "replica 1: loss_fn raised at step 3",
                 id="first-error-is-recovered"),
    pytest.param(exited(err=error()), True, {("loss_fn", 3, 5): 0}, True,
                 "(replica 0 failed the same way: a bug in the workload, not a fault)",
                 id="same-microbatch-on-another-replica"),
    pytest.param(exited(err=error()), True, {("loss_fn", 3, ANY_MICROBATCH): 2}, True,
                 "replica 2 failed the same way", id="same-step-other-microbatch"),
    pytest.param(exited(err=error()), True, {("loss_fn", 3, 5): 1}, False, "replica 1:",
                 id="same-replica-again-is-not-two"),
    pytest.param(exited(err=error()), True, {("loss_fn", 4, ANY_MICROBATCH): 0}, False,
                 "replica 1:", id="another-step-is-not-the-same-bug"),
    pytest.param(exited(err=error(deterministic=True, message="loss_fn returned a loss of shape "
                                  "[8]")), True, {}, True, "replica 1: loss_fn returned a loss",
                 id="broken-contract-is-fatal-at-once"),
    pytest.param(exited(err=error(where="determinism check", step=0, microbatch=0,
                                  deterministic=True, message="determinism check failed")),
                 False, {}, True, "determinism check failed", id="check-fails-at-start"),
    pytest.param(exited(err=error()), False, {}, True, "(before training started)",
                 id="error-before-start"),
    pytest.param(exited(attached=False), False, {}, True,
                 "without calling recover.trainer.init(): is it a ReCoVer training script?",
                 id="never-called-the-api"),
    pytest.param(exited(attached=True), False, {}, True,
                 "does the script call recover.trainer.train()?", id="never-called-train"),
    pytest.param(exited(code=1, attached=False, tail="Traceback...\n  ...\nImportError: no foo\n"),
                 False, {}, True, "exited (exit code 1) before training started: ImportError: no foo",
                 id="crash-at-import-shows-its-last-line"),
    pytest.param(exited(signal=9), False, {}, False, "exited (signal 9) before training started",
                 id="killed-during-startup-is-a-fault"),
    pytest.param(exited(signal=9, attached=False), False, {}, False, "(signal 9)",
                 id="killed-while-importing-is-a-fault"),
    pytest.param(exited(code=1, attached=True), False, {}, False, "exited (exit code 1)",
                 id="library-crash-at-start-is-a-fault"),
    pytest.param(pb.WorkerExited(replica=1, exit_code=1, attached=True, status_unknown=True),
                 True, {}, False, "replica 1 exited (its exit status is unknown: its agent did "
                 "not start it)", id="an-attached-process-status-is-not-made-up"),
    pytest.param(exited(code=127, attached=False, tail="cannot run the worker command 'x'"),
                 False, {}, True, "cannot run the worker command 'x'", id="command-cannot-run"),
]


@pytest.mark.parametrize("report, training, earlier, fatal, reason", ROWS)
def test_judge_exit(report: pb.WorkerExited, training: bool, earlier: dict, fatal: bool,
                    reason: str) -> None:
    verdict = judge_exit(report, training=training, earlier_errors=earlier)
    assert verdict.fatal is fatal, verdict.reason
    assert reason in verdict.reason


def test_error_keys_remember_the_microbatch_and_the_step() -> None:
    assert error_keys(error()) == (("loss_fn", 3, 5), ("loss_fn", 3, ANY_MICROBATCH))
    assert error_keys(error(where="train", step=-1, microbatch=-1)) == (("train", -1, -1),)


@pytest.mark.parametrize("report, cause", [
    (exited(err=error()), "error"),
    (pb.WorkerExited(killed_by_agent="watchdog: no beat"), "watchdog"),
    (pb.WorkerExited(fault=pb.FaultNote(step=1, phase="forward")), "injected"),
    (pb.WorkerExited(signal=9), "external"),
])
def test_failure_cause(report: pb.WorkerExited, cause: str) -> None:
    assert failure_cause(report) == cause


@pytest.mark.parametrize("digest, first, problem", [
    ("a", "a", False), ("", "a", False), ("a", "", False), ("b", "a", True),
])
def test_determinism_mismatch(digest: str, first: str, problem: bool) -> None:
    reason = determinism_mismatch(3, digest, first)
    assert (reason is not None) is problem
    if problem:
        assert "replica 3 computed a different gradient" in reason
