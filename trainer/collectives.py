"""Fault-tolerant cross-replica collectives: one gloo process group per generation.

Why (measured, DESIGN.md section 1): a stopped peer keeps its sockets open, so
nothing fails until the group timeout; gloo's ``abort()``/``shutdown()`` do not
unblock an in-flight collective, and destroying a group with a collective still
in flight hangs. What works in milliseconds is ``shutdown(SHUT_RDWR)`` on the
group's connected TCP sockets from another thread: gloo's event loop sees the
hang-up and fails the pending operation; a rendezvous blocked on a missing
peer's key fails the same way when the store client socket is shut down.

Which sockets are ours: torch exposes neither the store client's nor gloo's
socket fds, so ``connect()`` snapshots the process's socket inodes before it
builds anything; every inet socket that appears while it runs belongs to this
generation (store client, gloo listener, gloo pairs). Assumption: no other
thread of the worker opens inet sockets during ``connect()`` (the local agent
channel is a unix socket and is filtered out by family). Sockets are tracked by
inode, not fd number, and re-checked with ``fstat`` on a dup'd fd, so an fd
closed by gloo and reused by someone else is never touched.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import socket
import threading
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

__all__ = ["CollectiveAborted", "GroupSpec", "GenerationGroup", "RendezvousServer"]


class CollectiveAborted(RuntimeError):
    """The generation's group was aborted (by abort()) or a peer failed; the caller must
    drop the group and rebuild in a newer generation."""


@dataclass(frozen=True)
class GroupSpec:
    """Everything needed to join one generation's process group."""

    generation: int
    """Membership generation; the store prefix is ``gen/{generation}/`` so generations never mix."""
    rank: int
    """This replica's rank within the generation (0 .. world_size-1)."""
    world_size: int
    """Number of replicas in the generation."""
    store_host: str
    """Host of the rendezvous TCPStore (hosted outside the workers, e.g. by the controller)."""
    store_port: int
    """Port of the rendezvous TCPStore."""
    timeout_s: float = 30.0
    """Store and gloo timeout. Safety net only: the controller's abort is the fast path."""


def _socket_inodes() -> dict[int, int]:
    """Map socket inode -> fd for every socket fd of this process (any family)."""
    found: dict[int, int] = {}
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return found
    for name in names:
        try:
            link = os.readlink(f"/proc/self/fd/{name}")
        except OSError:  # closed meanwhile
            continue
        if link.startswith("socket:["):
            found[int(link[8:-1])] = int(name)
    return found


def _shutdown_socket(fd: int, inode: int) -> bool:
    """shutdown(SHUT_RDWR) the socket behind ``fd`` if it still is inet socket ``inode``.

    shutdown acts on the socket (shared by every fd that refers to it), so doing it
    through a dup is enough and leaves the owner's fd for the owner to close. Unix
    sockets (the agent channel) are never ours. The listening socket is skipped: it
    carries no collective, and shutting it would break gloo's accept loop. Returns
    True if a connected socket was shut down.
    """
    try:
        dup = os.dup(fd)
    except OSError:  # fd closed by gloo meanwhile
        return False
    try:  # fstat: the fd number may have been reused by someone else since listed
        sock = socket.socket(fileno=dup) if os.fstat(dup).st_ino == inode else None
    except OSError:
        sock = None
    if sock is None:
        os.close(dup)
        return False
    with sock:  # closes only the dup
        if (sock.family not in (socket.AF_INET, socket.AF_INET6)
                or sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN)):
            return False
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:  # not connected (yet / any more): nothing to unblock
            return False
        return True


def _is_loopback(host: str) -> bool:
    """True if ``host`` resolves to a loopback address (then every peer is local)."""
    try:
        return ipaddress.ip_address(socket.gethostbyname(host)).is_loopback
    except (OSError, ValueError):
        return False


class GenerationGroup:
    """Owns one generation's TCPStore client + PrefixStore(f"gen/{generation}/") +
    torch.distributed.ProcessGroupGloo built directly (no init_process_group, no global
    c10d state)."""

    def __init__(self, spec: GroupSpec) -> None:
        self.spec = spec
        # The lock orders abort() against connect()'s snapshots and close(): once
        # close() has run, abort() must not touch fds that may belong to others.
        self._lock = threading.Lock()
        self._aborted = False
        self._closed = False
        self._busy = False  # connect() or allreduce_sum_() in flight
        self._resweeping = False
        self._before: set[int] | None = None  # socket inodes that existed before connect()
        self._owned: set[int] | None = None  # socket inodes created by connect()
        self._store: dist.Store | None = None
        self._pg: dist.ProcessGroupGloo | None = None

    @property
    def aborted(self) -> bool:
        return self._aborted

    def _check(self) -> None:
        if self._aborted or self._closed:
            raise CollectiveAborted(f"generation {self.spec.generation} group aborted")

    def connect(self) -> None:
        """Build the store client and the gloo group (blocks until all ranks join)."""
        spec = self.spec
        with self._lock:
            self._check()
            if self._before is not None:
                raise RuntimeError("connect() may be called only once")
            self._before = set(_socket_inodes())
            self._busy = True
        timeout = datetime.timedelta(seconds=spec.timeout_s)
        pg: dist.ProcessGroupGloo | None = None
        error: str | None = None
        try:
            store = self._open_store(timeout)
            with self._lock:
                if not self._closed:
                    self._store = store
            del store
            # abort() may have swept before the store socket existed: check again
            # before the only step that can block for long.
            self._check()
            opts = dist.ProcessGroupGloo._Options()
            opts._timeout = timeout
            # On loopback every peer is local: bind there and skip hostname lookup;
            # otherwise use gloo's default device (honours GLOO_SOCKET_IFNAME).
            opts._devices = [dist.ProcessGroupGloo.create_device(hostname=spec.store_host)
                             if _is_loopback(spec.store_host)
                             else dist.ProcessGroupGloo.create_default_device()]
            prefix = dist.PrefixStore(f"gen/{spec.generation}/", self._store)
            pg = dist.ProcessGroupGloo(prefix, spec.rank, spec.world_size, opts)
            del prefix
        except CollectiveAborted as e:
            error = str(e)
        except Exception as e:  # noqa: BLE001 - any rendezvous failure means "rebuild"
            error = f"generation {spec.generation} connect failed: {e}"
        with self._lock:
            self._busy = False
            # Freeze ownership now (also on failure, for the abort() below), so
            # sockets that other threads open later are never touched by abort().
            self._owned = {i for i in _socket_inodes() if i not in self._before}
            if error is None and not (self._aborted or self._closed):
                self._pg = pg
            elif error is None:
                error = f"generation {spec.generation} group aborted during connect"
        del pg  # an aborted group is destroyed here, outside the lock
        if error is not None:
            # Raised outside the except block: no __context__ chain that keeps the
            # failed store/group frames (and their sockets) alive.
            self.abort()
            raise CollectiveAborted(error)

    def _open_store(self, timeout: datetime.timedelta) -> dist.TCPStore:
        # An unreachable store (ECONNREFUSED: its host is gone) has no socket to shut
        # down, and TCPStore retries until its timeout: connect in short attempts so
        # abort() is seen within ~1-2 s, then restore the full timeout for the rest.
        deadline = time.monotonic() + self.spec.timeout_s
        while True:
            self._check()
            step = max(min(1.0, deadline - time.monotonic()), 0.05)
            try:
                store = dist.TCPStore(self.spec.store_host, self.spec.store_port,
                                      is_master=False, wait_for_workers=False,
                                      timeout=datetime.timedelta(seconds=step))
            except Exception:
                if time.monotonic() >= deadline:
                    raise
                continue
            store.set_timeout(timeout)
            return store

    def allreduce_sum_(self, buffer: torch.Tensor) -> None:
        """In-place SUM allreduce of a contiguous CPU float tensor.

        After a failure the buffer is partially reduced: callers pass a copy.
        """
        if buffer.device.type != "cpu" or not buffer.is_contiguous():
            raise ValueError("allreduce_sum_ needs a contiguous CPU tensor")
        with self._lock:
            self._check()
            pg = self._pg
            if pg is None:
                raise RuntimeError("allreduce_sum_() before connect()")
            self._busy = True
        error: str | None = None
        try:
            work = pg.allreduce([buffer], dist.AllreduceOptions())
            del pg
            work.wait()  # no timeout here: gloo's own timeout fails the op cleanly
            del work
        except Exception as e:  # noqa: BLE001
            error = f"generation {self.spec.generation} allreduce failed: {e}"
        with self._lock:
            self._busy = False
        if error is not None:
            # Shut our own sockets too: every peer then fails in ms instead of
            # waiting for its timeout; raised outside except (see connect()).
            self.abort()
            raise CollectiveAborted(error)
        self._check()  # abort() raced with a successful reduction: result not trusted

    def abort(self) -> None:
        """Thread-safe, idempotent, returns within milliseconds; fails a blocked connect()
        or allreduce_sum_() in another thread and every future call."""
        with self._lock:
            self._aborted = True
            self._sweep()
            if self._owned is None and not self._resweeping:
                # connect() may open a socket just after this sweep (e.g. a gloo pair
                # right after its store lookup) and block on it: keep sweeping in
                # the background until connect() returns.
                self._resweeping = True
                threading.Thread(target=self._resweep, daemon=True,
                                 name=f"abort-gen{self.spec.generation}").start()

    def _resweep(self) -> None:
        deadline = time.monotonic() + self.spec.timeout_s + 5.0
        while time.monotonic() < deadline:
            time.sleep(0.05)
            with self._lock:
                if self._owned is not None or self._closed:  # connect() returned
                    return
                self._sweep()

    def _sweep(self) -> None:
        """Shut down this generation's connected sockets (caller holds the lock).

        While connect() runs, that is every socket new since its snapshot; after it
        returned, the frozen set it recorded."""
        if self._closed or self._before is None:
            return  # nothing built yet, or our fds may already belong to others
        owned, before = self._owned, self._before
        for inode, fd in _socket_inodes().items():
            if (inode in owned) if owned is not None else (inode not in before):
                _shutdown_socket(fd, inode)

    def close(self) -> None:
        """Drop every reference (group, store) so sockets are released; never hangs."""
        with self._lock:
            if self._busy:
                # An operation is in flight in another thread: destroying the group
                # under it would hang (gloo joins its workers), so fail it first.
                self._aborted = True
                self._sweep()
            self._closed = self._aborted = True
            pg, store, self._pg, self._store = self._pg, self._store, None, None
        # Destroyed outside the lock: gloo's destructor joins its worker threads,
        # which return at once because no operation is left in flight.
        del pg, store


class RendezvousServer:
    """Hosts the rendezvous TCPStore that generation groups connect to (controller side)."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0) -> None:
        # wait_for_workers=False: the server never blocks waiting for clients.
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
