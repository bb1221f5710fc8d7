"""The NCCL cross-replica group: one ProcessGroupNCCL per generation, aborted with `abort()`.

Run on one H100 by its own tests (a one-member reduce; abort() freeing a member whose peer
never came); a job selects it with `--group-backend nccl` (groups.group_factory), never run
in a job yet (scripts/gpu_check.sh does on the next GPU machine). It follows the regime that is
known to work elsewhere (torchft's ProcessGroupNCCL): a communicator built directly on a
PrefixStore per generation (no global c10d state), non-blocking (`config.blocking =
False`) so that `abort()` from another thread can end an init or a collective in flight,
built eagerly at connect() rather than at the first collective, and our own timer: the
CPU polls the collective's completion and gives up at the timeout, instead of trusting
NCCL's watchdog. DESIGN.md prefers the upstream revoke + reconfigure regime (torch 2.15)
for NCCL once it is available; this is the slot it goes into.

Importing this module is safe on a CPU-only torch; building a group there raises a
`RuntimeError` that says why.
"""

from __future__ import annotations

import datetime
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from recover.trainer.groups import CollectiveAborted, GroupSpec

POLL_S = 0.0005
"""How often the CPU looks at a collective in flight (it must notice abort() in ms)."""


def nccl_available() -> bool:
    return (dist.is_available() and dist.is_nccl_available() and torch.cuda.is_available()
            and hasattr(dist, "ProcessGroupNCCL"))


class NcclGroup:
    """One generation's NCCL group (a `CrossReplicaGroup`) on this process's current GPU."""

    # The current GPU is a per-thread setting: a communicator made on another thread would
    # be made for that thread's device. Not tried on a GPU since: connect where it is called.
    meets_in_background = False

    def __init__(self, spec: GroupSpec, device: torch.device | None = None) -> None:
        if not nccl_available():
            raise RuntimeError("the NCCL group needs a CUDA build of torch with NCCL and a "
                               "visible GPU (torch.distributed.is_nccl_available() is "
                               f"{dist.is_available() and dist.is_nccl_available()}, "
                               f"torch.cuda.is_available() is {torch.cuda.is_available()}); "
                               "use the gloo group")
        self.spec = spec
        self._device = device or torch.device("cuda", torch.cuda.current_device())
        self._lock = threading.Lock()
        self._aborted = False
        self._closed = False
        self._connected = False
        self._pg: Any = None
        self._store: dist.Store | None = None

    @property
    def aborted(self) -> bool:
        return self._aborted

    def _check(self) -> None:
        if self._aborted or self._closed:
            raise CollectiveAborted(f"generation {self.spec.generation} aborted")

    def connect(self) -> None:
        spec = self.spec
        timeout = datetime.timedelta(seconds=spec.timeout_s)
        with self._lock:
            self._check()
            if self._connected:
                raise RuntimeError("connect() may be called only once")
            self._connected = True
        try:
            store = dist.TCPStore(spec.store_host, spec.store_port, is_master=False,
                                  timeout=timeout, wait_for_workers=False)
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = timeout
            opts.config.blocking = False  # an abort() can then end a pending init/collective
            pg = dist.ProcessGroupNCCL(dist.PrefixStore(spec.store_prefix, store), spec.rank,
                                       spec.world_size, opts)
            with self._lock:  # abort() either sees this pg, or we see it aborted
                self._pg, self._store = pg, store
                aborted = self._aborted
            if aborted:
                pg.abort()
                raise CollectiveAborted(f"generation {spec.generation} aborted")
            pg.eager_connect_single_device(self._device)
        except CollectiveAborted:
            raise
        except Exception as e:  # noqa: BLE001 - any rendezvous failure means "rebuild"
            self.abort()
            raise CollectiveAborted(f"generation {spec.generation} connect failed: {e}") from None
        self._check()

    def allreduce_sum_(self, buffer: torch.Tensor) -> None:
        """In-place SUM of a CUDA tensor; returns once the result is in `buffer`."""
        if buffer.device.type != "cuda":
            raise ValueError("the NCCL group reduces CUDA tensors; use the gloo group for others")
        with self._lock:
            self._check()
            pg = self._pg
            if pg is None:
                raise RuntimeError("allreduce_sum_() before connect()")
        error: str | None = None
        try:
            work = pg.allreduce([buffer], dist.AllreduceOptions())
            deadline = time.monotonic() + self.spec.timeout_s
            while not work.is_completed() and not self._aborted:
                if time.monotonic() > deadline:
                    error = f"generation {self.spec.generation} allreduce timed out"
                    break
                time.sleep(POLL_S)
            if error is None and not self._aborted:
                work.wait()  # raises the collective's own error, if it failed
            del work
        except Exception as e:  # noqa: BLE001
            error = f"generation {self.spec.generation} allreduce failed: {e}"
        if error is not None:
            self.abort()
            raise CollectiveAborted(error)
        self._check()

    def start_allreduce_sum_(self, buffer: torch.Tensor) -> Callable[[], None]:
        """Reduced at once (NCCL's own stream runs it beside the compute already); the wait
        returned has nothing left to do."""
        self.allreduce_sum_(buffer)
        return _done

    def abort(self) -> None:
        """Thread-safe and idempotent: `ProcessGroupNCCL.abort()` ends the communicator's
        pending work (non-blocking communicators), without waiting for the peers."""
        with self._lock:
            if self._aborted:
                return
            self._aborted = True
            pg = self._pg
        if pg is not None:
            try:
                pg.abort()
            except Exception:  # noqa: BLE001 - already broken: nothing left to end
                pass

    def close(self) -> None:
        with self._lock:
            aborted, self._closed = self._aborted, True
            pg, store, self._pg, self._store = self._pg, self._store, None, None
        if pg is not None and not aborted:
            try:
                pg.shutdown()  # nothing in flight: a clean release of the communicator
            except Exception:  # noqa: BLE001
                pass
        self._aborted = True
        del pg, store


def _done() -> None:
    pass
