"""When does a worker's exit end the job? A pure, table-tested decision with its reason.

A worker that dies is a fault to recover from: another replica recomputes its
microbatches. But some exits are the workload's own bug, and recovering from
them would only lose replica after replica: a broken contract (a non-scalar
loss) fails the same everywhere; a loss function that raises on the same
microbatch on two replicas is deterministic, not a flaky GPU; and a worker
that exits on its own before training starts (a script that never calls the
API, an import error, a command that cannot run) would do so again. Those end
the job with one line that names the problem. A worker *killed* during
startup is a fault like any other: its agent restarts it, or the job starts
without it (admission.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from recover.proto import pb

ErrorKey = tuple[str, int, int]
"""(where, step, microbatch) of an error in the user's code."""
ANY_MICROBATCH = -2
"""The microbatch of an ErrorKey that stands for "any microbatch of that step"."""


@dataclass(frozen=True)
class ExitVerdict:
    fatal: bool
    """True: fail the job with `reason`. False: recover the replica like a crash."""
    reason: str


def error_keys(error: pb.WorkerError) -> tuple[ErrorKey, ...]:
    """The keys an error is remembered under: its microbatch, and (in a step) its step: two
    replicas failing in the same function of the same step are a bug even on different
    microbatches (each may raise on its own before it gets to the other's)."""
    exact = (error.where, error.step, error.microbatch)
    return (exact, (error.where, error.step, ANY_MICROBATCH)) if error.step >= 0 else (exact,)


def _how(exited: pb.WorkerExited) -> str:
    if exited.status_unknown:
        return "its exit status is unknown: its agent did not start it"
    return f"signal {exited.signal}" if exited.signal else f"exit code {exited.exit_code}"


def _last_line(exited: pb.WorkerExited) -> str:
    lines = [line for line in exited.output_tail.splitlines() if line.strip()]
    return f": {lines[-1].strip()}" if lines else ""


def failure_cause(exited: pb.WorkerExited) -> str:
    """The failure record's cause: error (the user's code), watchdog, injected or external."""
    if exited.HasField("error"):
        return "error"
    if exited.killed_by_agent:
        return "watchdog"
    return "injected" if exited.HasField("fault") else "external"


def determinism_mismatch(replica: int, digest: str, first_digest: str) -> str | None:
    """Why a replica's determinism-check gradient disqualifies the job, if it does: every
    replica computed the same microbatch, so any difference is the host's, not the data's."""
    if not digest or not first_digest or digest == first_digest:
        return None
    return (f"replica {replica} computed a different gradient for microbatch 0 than the first "
            "replica did (determinism check): different torch builds, thread counts or "
            "hardware? exact mode needs identical computation on every replica")


def judge_exit(exited: pb.WorkerExited, *, training: bool,
               earlier_errors: Mapping[ErrorKey, int]) -> ExitVerdict:
    """`training`: the job has started; `earlier_errors`: which replica first reported
    each error so far."""
    replica = exited.replica
    if exited.HasField("error"):
        error = exited.error
        if error.deterministic:
            return ExitVerdict(True, f"replica {replica}: {error.message}")
        first = next((earlier_errors[k] for k in error_keys(error)
                      if earlier_errors.get(k, replica) != replica), None)
        if first is not None:
            return ExitVerdict(True, f"replica {replica}: {error.message} (replica {first} failed "
                                     "the same way: a bug in the workload, not a fault)")
        if training:
            return ExitVerdict(False, f"replica {replica}: {error.message}")
        return ExitVerdict(True, f"replica {replica}: {error.message} (before training started)")
    if training:
        return ExitVerdict(False, f"replica {replica} exited ({_how(exited)})")
    if exited.signal or (exited.attached and exited.exit_code != 0):
        # Killed, or crashed inside the library before it could report: a fault, not the
        # script's mistake; its agent may restart it, or the job starts without it.
        return ExitVerdict(False, f"replica {replica} exited ({_how(exited)}) before training "
                                  "started")
    clean = exited.exit_code == 0
    if not exited.attached and clean:
        return ExitVerdict(True, f"replica {replica}: the worker command exited (exit code 0) "
                                 "without calling recover.trainer.init(): is it a ReCoVer "
                                 "training script?")
    if clean:
        return ExitVerdict(True, f"replica {replica}: the worker exited (exit code 0) before it "
                                 "was ready to train: does the script call recover.trainer.train()?")
    return ExitVerdict(True, f"replica {replica} exited ({_how(exited)}) before training "
                             f"started{_last_line(exited)}")
