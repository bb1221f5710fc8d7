"""Errors in the user's part of a job, told apart from faults ReCoVer recovers from.

When the user's code raises (in the loss, the microbatch source, a callback),
the worker reports where, with the user's own traceback (ReCoVer's frames cut
off), and exits; the controller recovers it like a crash, but the same
microbatch failing on a second replica, or a broken contract that would fail
anywhere (a non-scalar loss), ends the job with that one line.
"""

from __future__ import annotations

import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from recover.proto import pb

T = TypeVar("T")

_OWN_DIRS = tuple(str(Path(__file__).resolve().parent.parent / name) for name in
                  ("trainer", "common", "proto"))
"""ReCoVer's own source folders: their frames are left out of a user's traceback."""
TRACEBACK_LIMIT = 8000
"""Characters of a user traceback carried to the controller (the full one is in the log)."""


class WorkloadError(Exception):
    """The user's code raised, or broke the trainer's contract; the message says what and where."""

    def __init__(self, message: str, *, where: str, step: int = -1, microbatch: int = -1,
                 deterministic: bool = False, user_traceback: str = "") -> None:
        super().__init__(message)
        self.where = where
        self.step = step
        self.microbatch = microbatch
        self.deterministic = deterministic
        """True when the failure does not depend on the replica (a contract violation):
        retrying the microbatch elsewhere would fail the same way."""
        self.user_traceback = user_traceback

    def report(self) -> pb.WorkerError:
        return pb.WorkerError(where=self.where, step=self.step, microbatch=self.microbatch,
                              message=str(self), traceback=self.user_traceback[-TRACEBACK_LIMIT:],
                              deterministic=self.deterministic)


def _is_own(filename: str) -> bool:
    return str(Path(filename).resolve()).startswith(_OWN_DIRS)


def user_traceback(exc: BaseException) -> str:
    """The traceback from the first frame outside ReCoVer on: what the user's own code did."""
    tb = exc.__traceback__
    while tb is not None and _is_own(tb.tb_frame.f_code.co_filename):
        tb = tb.tb_next
    lines = traceback.format_exception(type(exc), exc, tb)
    if tb is None:  # raised by ReCoVer itself on the user's behalf: the message is enough
        lines = traceback.format_exception_only(type(exc), exc)
    return "".join(lines)


def call_user(where: str, fn: Callable[..., T], *args: Any, step: int = -1,
              microbatch: int = -1) -> T:
    """Call user code; anything it raises becomes a WorkloadError saying where it happened."""
    try:
        return fn(*args)
    except WorkloadError:
        raise
    except Exception as exc:  # noqa: BLE001 - any error of the user's code is reported as such
        at = f" at step {step}" if step >= 0 else ""
        at += f", microbatch {microbatch}" if microbatch >= 0 else ""
        raise WorkloadError(f"{where} raised{at}: {type(exc).__name__}: {exc}", where=where,
                            step=step, microbatch=microbatch,
                            user_traceback=user_traceback(exc)) from None


def contract_error(message: str, *, where: str, step: int = -1,
                   microbatch: int = -1) -> WorkloadError:
    """A broken contract (e.g. a non-scalar loss): the same on every replica, so fatal at once."""
    return WorkloadError(message, where=where, step=step, microbatch=microbatch, deterministic=True)
