"""Gloo groups closed while a collective they gave up on is still running in gloo.

Why this exists: a generation's wait for a collective returns as soon as the group is
aborted (gloo.py, `wait_or_abort`), but gloo cannot cancel an operation, and destroying a
group with one in flight blocks (its destructor joins the worker thread running it) until
gloo's own timeout ends it: 30 s by default, on the training thread, in the middle of a
recovery. So such a group is kept here, referenced, and destroyed by a later call once
every operation it gave up on has ended. One still here when the process exits is left
alone (the exit reclaims it) rather than blocking the interpreter's finalization.
"""

from __future__ import annotations

import atexit
import ctypes
import threading
from collections.abc import Sequence
from typing import Any

_LOCK = threading.Lock()
_BURIED: list[tuple[tuple[Any, ...], tuple[Any, ...]]] = []
"""(what to keep alive: the group, its store; the works still running in gloo)."""


def bury(keep: Sequence[Any], works: Sequence[Any]) -> None:
    """Keep `keep` alive until every one of `works` (c10d Work objects) has completed."""
    with _LOCK:
        _BURIED.append((tuple(keep), tuple(works)))
    purge()


def purge() -> None:
    """Destroy what no running operation holds any longer (on this thread: each has none
    in flight, so its destructor returns at once)."""
    with _LOCK:
        ended = [entry for entry in _BURIED if all(w.is_completed() for w in entry[1])]
        _BURIED[:] = [entry for entry in _BURIED if not any(entry is e for e in ended)]
    del ended  # destroyed here, outside the lock


def buried() -> int:
    """Groups still waiting for an operation to end (for tests and logs)."""
    with _LOCK:
        return len(_BURIED)


@atexit.register
def _left_alone_at_exit() -> None:
    purge()
    with _LOCK:
        if _BURIED:
            # An extra reference: finalization drops the module's, never this one, so no
            # destructor waits for gloo's timeout on the way out.
            ctypes.pythonapi.Py_IncRef(ctypes.py_object(_BURIED))
