"""The gloo cross-replica group: one gloo process group per generation (the default backend).

Why (measured, DESIGN.md section 1): a stopped peer keeps its sockets open, so nothing
fails until the group timeout; gloo's ``abort()``/``shutdown()`` do not unblock an
in-flight collective, and destroying a group with one in flight hangs. What works in
milliseconds is ``shutdown(SHUT_RDWR)`` on the group's connected TCP sockets from
another thread: gloo's event loop sees the hang-up and fails the pending operation;
a rendezvous blocked on a missing peer's key fails likewise once the store client
socket is shut down. A rendezvous can also wait with no socket at all (a gloo pair
waiting for a stopped peer to connect to it), so connect() builds in a helper thread
and abort() just stops waiting for it.

Which sockets are ours: torch exposes neither the store client's nor gloo's fds, so
``connect()`` snapshots the process's socket inodes first; every inet socket that
appears while it runs belongs to this generation (store client, gloo listener and
pairs), except those registered with ``exclude_sockets`` (a join's state transfer,
which a donor runs on a thread of its own); the agent channel is a unix socket,
filtered out by family. Sockets are tracked by
inode, re-checked with ``fstat`` on a dup'd fd, so an fd closed by gloo and reused
by someone else is never touched.

Device buffers (a model on a GPU keeps its gradient buckets there) are staged through a
pinned host copy (groups/staging.py): gloo reduces host memory only.
"""

from __future__ import annotations

import atexit
import datetime
import os
import socket
import threading
import time
from collections.abc import Callable
from typing import Any, NoReturn

import torch
import torch.distributed as dist

from recover.common.netaddr import local_address_towards
from recover.trainer.groups import CollectiveAborted, GroupSpec, graveyard
from recover.trainer.groups.staging import HostStaging, staged_start

__all__ = ["GenerationGroup", "RendezvousServer", "exclude_sockets", "gloo_devices",
           "include_sockets"]

_FOREIGN: set[int] = set()
"""Inodes of inet sockets that belong to something else (a join's state transfer): a
generation group never claims or shuts them, even if they appear while it builds."""
_FOREIGN_LOCK = threading.Lock()


def _inode(sock: socket.socket) -> int | None:
    try:
        return os.fstat(sock.fileno()).st_ino
    except OSError:
        return None


def exclude_sockets(socks: list[socket.socket]) -> None:
    """Keep these sockets out of every generation group's abort sweep."""
    with _FOREIGN_LOCK:
        _FOREIGN.update(i for i in map(_inode, socks) if i is not None)


def include_sockets(socks: list[socket.socket]) -> None:
    """Forget sockets about to be closed (their inode numbers will be reused)."""
    with _FOREIGN_LOCK:
        _FOREIGN.difference_update(i for i in map(_inode, socks) if i is not None)


def _foreign() -> set[int]:
    with _FOREIGN_LOCK:
        return set(_FOREIGN)


def _socket_inodes() -> dict[int, int]:
    """Map socket inode -> fd for every socket fd of this process (any family)."""
    found = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{name}")
        except OSError:  # closed meanwhile
            continue
        if link.startswith("socket:["):
            found[int(link[8:-1])] = int(name)
    return found


def _shutdown_socket(fd: int, inode: int) -> None:
    """shutdown(SHUT_RDWR) the socket behind ``fd`` if it still is connected inet socket
    ``inode``.

    shutdown acts on the socket (shared by every fd that refers to it), so doing it
    through a dup is enough and leaves the owner's fd for the owner to close. Unix
    sockets (the agent channel) are never ours. The listening socket is skipped: it
    carries no collective, and an accept() error there is fatal in gloo's loop thread.
    """
    try:
        dup = os.dup(fd)
    except OSError:  # fd closed by gloo meanwhile
        return
    try:  # fstat: the fd number may have been reused by someone else since listed
        sock = socket.socket(fileno=dup) if os.fstat(dup).st_ino == inode else None
    except OSError:
        sock = None
    if sock is None:
        os.close(dup)
        return
    with sock:  # closes only the dup
        if (sock.family in (socket.AF_INET, socket.AF_INET6)
                and not sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN)):
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:  # not connected (yet / any more): nothing to unblock
                pass


_BUILDERS: set[threading.Thread] = set()  # connect() helper threads still running

WAIT_SLICE = datetime.timedelta(milliseconds=10)
"""How often a wait for a collective looks whether its group was aborted. gloo fails an
operation whose peers hang up, which abort() makes happen, yet a test run here once
had a survivor sit 30 s (the group timeout) in a dead generation's allreduce, gloo saying
"timed out waiting for send operation to complete", while every other survivor had
moved on within milliseconds. Not reproduced on demand; whatever gloo waits on then, an
aborted group's waits now return within this slice."""


def wait_or_abort(work: Any, aborted: Callable[[], bool]) -> bool:
    """Wait for a c10d Work; True once it succeeded (its failure is raised), False as soon as
    `aborted()` while it still runs (the caller gives it up: graveyard.py)."""
    while True:
        try:
            work.wait(WAIT_SLICE)
            return True
        except RuntimeError:
            if work.is_completed():
                work.wait()  # its own result: raises the operation's failure
                return True
            if aborted():
                return False


@atexit.register
def _join_builders_at_exit() -> None:
    """Give abandoned connect() builders a bounded chance to finish before exit: a
    daemon thread returning from c10d into Python after finalization began is torn
    down by pthread_exit, which aborts the process ("terminate called without an
    active exception", measured). One stuck in gloo just dies with the process."""
    deadline = time.monotonic() + 2.0
    for thread in list(_BUILDERS):
        thread.join(max(0.0, deadline - time.monotonic()))


def gloo_devices(store_host: str, store_port: int) -> list[object]:
    """Where gloo listens and connects from.

    GLOO_SOCKET_IFNAME (comma-separated interface names) wins, as in torch's own
    init_process_group. Otherwise the address that reaches the rendezvous store:
    gloo's default device binds to whatever the hostname resolves to, which on many
    hosts is 127.0.1.1 and inside a network namespace not an address at all (found
    by tests/integration/test_partition.py: peers on other hosts could not connect).
    """
    names = [n for n in os.environ.get("GLOO_SOCKET_IFNAME", "").split(",") if n.strip()]
    if names:
        return [dist.ProcessGroupGloo.create_device(interface=n.strip()) for n in names]
    local = local_address_towards(store_host, store_port)
    if local is None:
        return [dist.ProcessGroupGloo.create_default_device()]
    return [dist.ProcessGroupGloo.create_device(hostname=local)]


class GenerationGroup:
    """Owns one generation's TCPStore client + PrefixStore(spec.store_prefix) +
    torch.distributed.ProcessGroupGloo built directly (no init_process_group, no global
    c10d state). A `CrossReplicaGroup`.

    `force_staging` sends even a CPU buffer through the host staging copy: the staging
    path is then tested where there is no device.
    """

    meets_in_background = True  # connect() already builds on a helper thread of its own

    def __init__(self, spec: GroupSpec, *, staging: HostStaging | None = None,
                 force_staging: bool = False) -> None:
        graveyard.purge()  # groups of earlier generations whose given-up operations ended
        self.spec = spec
        self._staging = staging
        self._force_staging = force_staging
        # The lock orders abort() against the socket snapshots and close(): once
        # close() has run, abort() must not touch fds that may belong to others.
        self._lock = threading.Lock()
        self._wake = threading.Event()  # set by the builder thread or by abort()
        self._aborted = False
        self._closed = False
        self._in_flight = 0  # collectives started and not yet waited for
        self._given_up: list[Any] = []  # works an abort() stopped waiting for, maybe running
        self._unwaited: list[Any] = []
        """Works started and not yet waited for (an early reduction's pieces wait later)."""
        self._before: set[int] | None = None  # socket inodes that existed before connect()
        self._owned: set[int] | None = None  # socket inodes this generation may shut down
        self._error: str | None = None
        self._store: dist.Store | None = None
        self._pg: dist.ProcessGroupGloo | None = None

    @property
    def aborted(self) -> bool:
        return self._aborted

    def _check(self) -> None:
        if self._aborted or self._closed:
            raise CollectiveAborted(self._error or f"generation {self.spec.generation} aborted")

    def connect(self) -> None:
        """Build the store client and the gloo group (blocks until all ranks join).

        The build runs in a helper thread and this call waits for it *or* abort().
        Measured: a gloo pair whose peer published its address and then stopped
        waits, socketless, for that peer to connect to our listener (~5x timeout_s),
        so shutting sockets cannot always unblock a rendezvous. An abandoned builder
        drops what it built when it ends: within ms in the common case, where
        abort() shut the store socket it waits on.
        """
        with self._lock:
            self._check()
            if self._before is not None:
                raise RuntimeError("connect() may be called only once")
            self._before = set(_socket_inodes())
        # A daemon: a builder stuck in a socketless gloo wait lingers ~5x timeout_s
        # (measured), which must not delay process exit; see _join_builders_at_exit.
        builder = threading.Thread(target=self._build, daemon=True,
                                   name=f"gloo-connect-gen{self.spec.generation}")
        _BUILDERS.add(builder)
        builder.start()
        self._wake.wait()
        self._check()  # aborted, closed, or the build failed

    def _build(self) -> None:
        spec = self.spec
        timeout = datetime.timedelta(seconds=spec.timeout_s)
        store: dist.Store | None = None
        pg: dist.ProcessGroupGloo | None = None
        error: str | None = None
        try:
            store = dist.TCPStore(spec.store_host, spec.store_port, is_master=False,
                                  timeout=timeout, wait_for_workers=False)
            opts = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]  # not in stubs
            opts._timeout = timeout
            opts._devices = gloo_devices(spec.store_host, spec.store_port)
            pg = dist.ProcessGroupGloo(dist.PrefixStore(spec.store_prefix, store),
                                       spec.rank, spec.world_size, opts)
        except Exception as e:  # noqa: BLE001 - any rendezvous failure means "rebuild"
            # Keep only the message: the exception's traceback would keep the
            # half-built store/group (and their sockets) alive.
            error = f"generation {spec.generation} connect failed: {e}"
        with self._lock:
            if self._owned is None and self._before is not None:
                # Freeze ownership (also on failure), so sockets that other threads
                # or newer generations open later are never touched by abort().
                self._owned = {i for i in _socket_inodes() if i not in self._before} - _foreign()
            if error is None and not (self._aborted or self._closed):
                self._pg, self._store, store, pg = pg, store, None, None
            elif error is not None:
                self._aborted = True
                self._error = self._error or error
        self._wake.set()
        del pg, store  # an aborted or failed build is destroyed here, off the lock
        _BUILDERS.discard(threading.current_thread())

    def allreduce_sum_(self, buffer: torch.Tensor) -> None:
        """In-place SUM allreduce of a contiguous CPU tensor, or of a device tensor through
        pinned host copies pipelined with the reduction of its pieces (groups/staging.py).

        After a failure the buffer may be partially reduced: callers pass a copy.
        """
        self.start_allreduce_sum_(buffer)()

    def start_allreduce_sum_(self, buffer: torch.Tensor) -> Callable[[], None]:
        """`allreduce_sum_` started (a device buffer's copy to the host done), its wait
        returned: several in flight at once complete in the order started."""
        if not buffer.is_contiguous():
            raise ValueError("allreduce_sum_ needs a contiguous tensor")
        return staged_start(buffer, self._start_allreduce, self._staging, self._force_staging)

    def _start_allreduce(self, host: torch.Tensor) -> Callable[[], None]:
        """Start reducing a host tensor; the returned function waits for it. Collectives
        started one after the other complete in that order on every member."""
        with self._lock:
            self._check()
            pg = self._pg
            if pg is None:
                raise RuntimeError("allreduce_sum_() before connect()")
            self._in_flight += 1
        started: str | None = None
        try:
            work = pg.allreduce([host], dist.AllreduceOptions())  # type: ignore[attr-defined]
        except Exception as e:  # noqa: BLE001
            started = f"generation {self.spec.generation} allreduce failed: {e}"
        del pg
        if started is not None:
            self._failed(started)
        with self._lock:
            self._unwaited.append(work)
        waited = False

        def wait() -> None:
            nonlocal work, waited
            if waited:
                return
            waited = True
            with self._lock:
                self._unwaited.remove(work)
            error: str | None = None
            finished = True
            try:
                finished = wait_or_abort(work, lambda: self._aborted)
            except Exception as e:  # noqa: BLE001
                error = f"generation {self.spec.generation} allreduce failed: {e}"
            if not finished:
                with self._lock:
                    self._given_up.append(work)  # its buffer is a copy, never read again
            del work
            if error is not None:
                self._failed(error)
            with self._lock:
                self._in_flight -= 1
            self._check()  # abort() raced with a successful reduction: result not trusted

        return wait

    def _failed(self, error: str) -> NoReturn:
        # Shut our own sockets too: every peer then fails in ms instead of waiting for its
        # timeout. Raised outside any except block, so no __context__ chain keeps the
        # failed group's frames alive.
        with self._lock:
            self._in_flight -= 1
            self._error = self._error or error
        self.abort()
        raise CollectiveAborted(error)

    def abort(self) -> None:
        """Thread-safe, idempotent, returns within milliseconds; fails a blocked connect()
        or allreduce_sum_() in another thread and every future call."""
        with self._lock:
            self._aborted = True
            self._sweep()
        self._wake.set()

    def _sweep(self) -> None:
        """Shut down this generation's connected sockets (caller holds the lock)."""
        if self._closed or self._before is None:
            return  # nothing built yet, or our fds may already belong to others
        sockets = _socket_inodes()
        if self._owned is None:
            # Build still running: everything new since the snapshot is ours. Freeze
            # it, so a later abort() never touches a newer generation's sockets.
            self._owned = {i for i in sockets if i not in self._before} - _foreign()
        for inode in self._owned - _foreign():
            if inode in sockets:
                _shutdown_socket(sockets[inode], inode)

    def close(self) -> None:
        """Drop every reference (group, store) so sockets are released; never hangs."""
        with self._lock:
            if self._in_flight or (self._before is not None and self._owned is None):
                # An operation or build is in flight in another thread: fail it first
                # (destroying a group with a collective in flight hangs).
                self._aborted = True
                self._sweep()
            self._closed = self._aborted = True
            pg, store, self._pg, self._store = self._pg, self._store, None, None
            # A work started and not yet waited for is in flight as much as a given-up one:
            # destroying the group under it waits for gloo's timeout (a 30 s recovery).
            running = [work for work in self._given_up + self._unwaited
                       if not work.is_completed()]
            self._given_up = []
        self._wake.set()
        if running:  # destroying it now would wait for gloo's timeout to end them
            graveyard.bury((pg, store), running)
        # Destroyed outside the lock: gloo's destructor joins its worker threads,
        # which return at once because no operation is left in flight.
        del pg, store


class RendezvousServer:
    """Hosts the rendezvous TCPStore that generation groups connect to (controller side)."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0) -> None:
        # wait_for_workers=False: never block waiting for clients (controller side).
        self._store: dist.TCPStore | None = dist.TCPStore(
            host, port, is_master=True, wait_for_workers=False,
            timeout=datetime.timedelta(seconds=30))
        self._port = int(self._store.port)

    @property
    def port(self) -> int:
        return self._port

    def close(self) -> None:
        store, self._store = self._store, None
        del store
