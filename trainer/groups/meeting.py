"""A generation's group meeting its members on a thread while the worker computes.

Why: a survivor of a failure has work it can do before the new generation's group exists
(its own microbatches and the lost replica's, recomputed): the group is first needed by
the step's reduction. Building it first made every survivor wait for the slowest member's
full-mesh build (each member connects to each other: it grows with the members, and on a
loaded host it was most of a recovery at 32 replicas, BENCHMARKS.md section 3c) before
computing again. So the executor starts `connect()` here and computes; the reduction (or
a reduction hooked into the last backward) waits for the meeting first.

Nothing about the outcome changes: a group that fails to meet fails the step's reduction
exactly as a collective that fails does (the worker drops the group and waits for a newer
generation), and `abort()` from the receiver thread ends a meeting in flight as it ends a
blocked `connect()`.
"""

from __future__ import annotations

import threading
import time

from recover.trainer.groups import CollectiveAborted, CrossReplicaGroup


class Meeting:
    """`group.connect()` running on a daemon thread, started at once."""

    def __init__(self, group: CrossReplicaGroup) -> None:
        self.group = group
        self.error: str | None = None
        """Why the group did not meet (None: met, or still meeting)."""
        self.took_s: float | None = None
        """How long the meeting took, once it ended either way."""
        self._started = time.monotonic()
        self._done = threading.Event()
        # A daemon, as gloo's own builder is: one stuck in a socketless wait must not delay
        # the process's exit (groups/gloo.py).
        threading.Thread(target=self._meet, daemon=True,
                         name=f"meet-gen{group.spec.generation}").start()

    def _meet(self) -> None:
        try:
            self.group.connect()
        except CollectiveAborted as exc:
            self.error = str(exc) or f"generation {self.group.spec.generation} aborted"
        except Exception as exc:  # noqa: BLE001 - any failure to meet fails the reduction
            self.error = f"generation {self.group.spec.generation} connect failed: {exc}"
        finally:
            self.took_s = time.monotonic() - self._started
            self._done.set()

    @property
    def met(self) -> bool:
        """The group is connected and usable now (no waiting)."""
        return self._done.is_set() and self.error is None

    def wait(self) -> str | None:
        """Block until the meeting ended; None when the group met, else why it did not."""
        self._done.wait()
        return self.error
