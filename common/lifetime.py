"""A process that must not outlive the one that started it (Linux parent-death signal)."""

from __future__ import annotations

import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1


def die_with_parent(expected_parent: int | None, sig: int = signal.SIGKILL) -> bool:
    """Arrange for `sig` when this process's parent dies. Returns False when the expected
    parent is gone already (the signal would never come). `expected_parent` None: whatever
    the parent is (it may be a wrapper between the two, whose own end brings ours)."""
    if not sys.platform.startswith("linux"):
        return True
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, sig)
    if os.getppid() == 1:  # orphaned before the signal was armed
        return False
    if expected_parent is None:
        return True
    try:
        os.kill(expected_parent, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True
