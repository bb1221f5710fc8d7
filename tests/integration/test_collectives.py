"""Integration tests for recover.trainer.groups.gloo: real processes, real signals, gloo on CPU.

Each worker is this file run as a script (``python test_collectives.py <json>``): it
prints one JSON event per line on stdout (times from ``time.monotonic()``, which is
system-wide on Linux, so parent and child times compare) and reads commands
("abort") from stdin. The parent hosts the RendezvousServer, like the controller.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

WORKER_TIMEOUT_S = 20.0  # group safety-net timeout in the workers; tests must beat it
pytestmark = pytest.mark.timeout(60)  # each test takes ~3-5 s; never hang CI


# --------------------------------------------------------------------------- worker side


_EMIT_LOCK = threading.Lock()


def _emit(ev: str, **kw: Any) -> None:
    # One write per line under a lock: two threads printing at once (the abort
    # thread and the main thread) would otherwise interleave and corrupt the JSON.
    line = json.dumps({"ev": ev, "t": time.monotonic(), **kw}) + "\n"
    with _EMIT_LOCK:
        sys.stdout.write(line)
        sys.stdout.flush()


def _worker(cfg: dict[str, Any]) -> None:
    import torch

    from recover.trainer.groups import CollectiveAborted, GroupSpec, gloo, graveyard
    from recover.trainer.groups.gloo import GenerationGroup

    torch.set_num_threads(1)
    port, rank, world, mode = cfg["port"], cfg["rank"], cfg["world"], cfg["mode"]
    # `staged`: through host staging, as a GPU bucket would go: in pieces whose reductions
    # are in flight together (groups/staging.py); 52 MB, so five pieces.
    staged = cfg.get("staged", False)
    group = GenerationGroup(GroupSpec(1, rank, world, "127.0.0.1", port, WORKER_TIMEOUT_S),
                            force_staging=staged)

    def on_stdin() -> None:  # the "controller says abort" thread
        for line in sys.stdin:
            if line.strip() == "abort":
                t0 = time.monotonic()
                group.abort()
                _emit("aborted", call_s=time.monotonic() - t0)
        os._exit(3)  # stdin closed: the test process is gone, do not linger

    threading.Thread(target=on_stdin, daemon=True).start()

    if mode == "connect_abort":  # world 3 but only 2 ever connect
        _emit("connecting")
        try:
            group.connect()
            _emit("connected")
        except CollectiveAborted as e:
            _emit("raised", where="connect", msg=str(e)[:200])
        t0 = time.monotonic()
        group.close()
        _emit("closed", close_s=time.monotonic() - t0)
        return

    t0 = time.monotonic()
    group.connect()
    _emit("connected", connect_s=time.monotonic() - t0)
    if mode == "victim":  # never reduces; gets killed or stopped by the parent
        time.sleep(600)
        return

    pattern = torch.arange(13_000_000 if staged else 100_000, dtype=torch.float32) % 1000 + 1
    buf = pattern * (rank + 1)
    _emit("allreduce_start")
    try:
        group.allreduce_sum_(buf)
        # Every element the sum of the ranks' (each piece where it belongs, reduced once).
        _emit("sum", value=buf[0].item(),
              exact=bool(torch.equal(buf, pattern * (world * (world + 1) // 2))))
    except CollectiveAborted as e:
        _emit("raised", where="allreduce", msg=str(e)[:200], aborted=group.aborted)
    t0 = time.monotonic()
    group.close()
    close_s = time.monotonic() - t0
    # A collective given up on may still be ending in gloo (its sockets shut down by the
    # abort, it fails at once, but on gloo's thread): the group then waits in the graveyard
    # until it has, and the next group's build destroys it. Wait for that as the next build
    # would (a bound far above the milliseconds it takes), then every socket of the
    # generation must be gone (nothing, e.g. an exception's traceback, may keep it alive).
    deadline = time.monotonic() + 10.0
    graveyard.purge()
    while graveyard.buried() and time.monotonic() < deadline:
        time.sleep(0.01)
        graveyard.purge()
    owned = group._owned or set()
    leaked = len(owned & set(gloo._socket_inodes()))
    _emit("closed", close_s=close_s, owned=len(owned), leaked=leaked, buried=graveyard.buried())
    if mode == "sum":
        return

    # Survivor: rebuild generation 2 without the victim on the same rendezvous server.
    t0 = time.monotonic()
    g2 = GenerationGroup(GroupSpec(2, cfg["rank2"], cfg["world2"], "127.0.0.1", port,
                                   WORKER_TIMEOUT_S))
    g2.connect()
    t1 = time.monotonic()
    buf = torch.full((100_000,), float(cfg["rank2"] + 1))
    g2.allreduce_sum_(buf)
    _emit("sum2", value=buf[0].item(), uniform=bool((buf == buf[0]).all()),
          connect_s=t1 - t0, total_s=time.monotonic() - t0)
    g2.close()


# --------------------------------------------------------------------------- parent side


class Worker:
    """One child process with a reader thread that queues its JSON events."""

    def __init__(self, cfg: dict[str, Any]) -> None:
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), json.dumps(cfg)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        self.events: queue.Queue[dict[str, Any]] = queue.Queue()
        self.log: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.log.append(line.rstrip())
            try:
                self.events.put(json.loads(line))
            except ValueError:
                pass

    def expect(self, ev: str, timeout: float = 15.0) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            try:
                got = self.events.get(timeout=max(left, 0.0))
            except queue.Empty:
                raise AssertionError(f"no {ev!r} from pid {self.proc.pid}; log: {self.log}") \
                    from None
            if got["ev"] == ev:
                return got
            if got["ev"] in ("raised", "sum", "sum2") and ev != got["ev"]:
                raise AssertionError(f"expected {ev!r}, got {got}; log: {self.log}")

    def send(self, line: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()  # SIGKILL also ends a SIGSTOPped process
        self.proc.wait(timeout=10)
        if self.proc.stdin is not None:
            self.proc.stdin.close()


@pytest.fixture
def server() -> Iterator[Any]:
    from recover.trainer.groups.gloo import RendezvousServer

    srv = RendezvousServer()
    yield srv
    srv.close()


@pytest.fixture
def spawn() -> Iterator[Any]:
    workers: list[Worker] = []

    def start(**cfg: Any) -> Worker:
        w = Worker(cfg)
        workers.append(w)
        return w

    yield start
    for w in workers:  # never leak children, whatever the test did
        w.kill()


@pytest.mark.parametrize("staged", [False, True], ids=["in-place", "staged-in-pieces"])
def test_allreduce_sum_three_ranks(server: Any, spawn: Any, staged: bool) -> None:
    # Staged: the pipelined pieces of a GPU bucket's path, summed by real gloo processes
    # (each piece's reduction started before the earlier ones are waited for).
    ws = [spawn(port=server.port, rank=r, world=3, mode="sum", staged=staged) for r in range(3)]
    for w in ws:
        got = w.expect("sum")
        assert got["value"] == 6.0 and got["exact"]
        assert w.expect("closed")["close_s"] < 2.0
    for w in ws:
        assert w.proc.wait(timeout=10) == 0


def _survivors_and_victim(server: Any, spawn: Any, n: int,
                          staged: bool = False) -> tuple[list[Worker], Worker]:
    """n survivors plus a victim in the middle of the ring (rank 1) for generation 1."""
    survivors = [spawn(port=server.port, rank=r if r < 1 else r + 1, world=n + 1,
                       mode="survivor", rank2=r, world2=n, staged=staged) for r in range(n)]
    victim = spawn(port=server.port, rank=1, world=n + 1, mode="victim")
    for w in [*survivors, victim]:
        w.expect("connected")
    for w in survivors:
        w.expect("allreduce_start")
    time.sleep(0.3)  # let the survivors block inside the collective
    return survivors, victim


def _check_rebuild(survivors: list[Worker]) -> None:
    n = len(survivors)
    for w in survivors:
        got = w.expect("closed")
        print(f"close() of the failed group: {got['close_s'] * 1e3:.1f} ms")
        assert got["close_s"] < 2.0
        assert got["owned"] >= 2 and got["leaked"] == 0, got  # store client + gloo
    for w in survivors:
        got = w.expect("sum2")
        assert got["value"] == n * (n + 1) / 2 and got["uniform"]
        print(f"rebuild {n} ranks: connect {got['connect_s'] * 1e3:.1f} ms, "
              f"connect+allreduce {got['total_s'] * 1e3:.1f} ms")
    for w in survivors:
        assert w.proc.wait(timeout=10) == 0


def test_killed_peer_fails_survivors_then_rebuild(server: Any, spawn: Any) -> None:
    # Staged in pieces: the survivors fail with a piece's reduction in flight and the later
    # pieces' started; every one must end (no hang, no leaked socket) before the rebuild.
    survivors, victim = _survivors_and_victim(server, spawn, 3, staged=True)
    t_kill = time.monotonic()
    victim.proc.send_signal(signal.SIGKILL)
    for w in survivors:
        got = w.expect("raised")
        assert got["where"] == "allreduce" and got["aborted"]
        latency = got["t"] - t_kill
        print(f"kill -> survivor raised: {latency * 1e3:.1f} ms")
        assert latency < 2.0
    _check_rebuild(survivors)


def test_stopped_peer_abort_unblocks_then_rebuild(server: Any, spawn: Any) -> None:
    survivors, victim = _survivors_and_victim(server, spawn, 2)
    victim.proc.send_signal(signal.SIGSTOP)  # hung: its sockets stay open
    time.sleep(0.5)
    for w in survivors:
        assert w.events.empty(), w.log  # still blocked: nothing fails on its own
    t_abort = time.monotonic()
    for w in survivors:
        w.send("abort")
    for w in survivors:
        got = w.expect("raised")
        assert got["where"] == "allreduce"
        latency = got["t"] - t_abort
        print(f"abort -> raised: {latency * 1e3:.1f} ms")
        assert latency < 3.0  # loose; measured in the tens of ms
    _check_rebuild(survivors)
    victim.kill()


def test_abort_during_blocked_connect(server: Any, spawn: Any) -> None:
    ws = [spawn(port=server.port, rank=r, world=3, mode="connect_abort") for r in range(2)]
    for w in ws:
        w.expect("connecting")
    time.sleep(1.0)  # both blocked waiting for rank 2's address in the store
    t_abort = time.monotonic()
    for w in ws:
        w.send("abort")
    for w in ws:
        got = w.expect("raised")
        assert got["where"] == "connect"
        latency = got["t"] - t_abort
        print(f"abort -> connect raised: {latency * 1e3:.1f} ms")
        assert latency < 3.0
        assert w.expect("closed")["close_s"] < 2.0
    for w in ws:
        assert w.proc.wait(timeout=10) == 0


def test_abort_connect_to_unreachable_store() -> None:
    """No store listening (its host died): TCPStore retries with no socket to shut
    down; connect() must still raise as soon as abort() is called."""
    import socket

    from recover.trainer.groups import CollectiveAborted, GroupSpec, gloo
    from recover.trainer.groups.gloo import GenerationGroup

    with socket.socket() as s:  # a free port that nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    group = GenerationGroup(GroupSpec(1, 0, 2, "127.0.0.1", port, timeout_s=1.5))
    timer = threading.Timer(0.3, group.abort)
    timer.start()
    t0 = time.monotonic()
    with pytest.raises(CollectiveAborted):
        group.connect()
    elapsed = time.monotonic() - t0
    print(f"unreachable store: connect raised {(elapsed - 0.3) * 1e3:.1f} ms after abort")
    assert elapsed < 1.5
    timer.join()
    group.close()
    # White-box: the abandoned builder keeps retrying until timeout_s, then ends.
    for builder in list(gloo._BUILDERS):
        builder.join(timeout=10)
    assert not gloo._BUILDERS


def test_rendezvous_server_free_port() -> None:
    import datetime

    import torch.distributed as dist

    from recover.trainer.groups.gloo import RendezvousServer

    a, b = RendezvousServer(), RendezvousServer()
    try:
        assert a.port > 0 and b.port > 0 and a.port != b.port
        client = dist.TCPStore("127.0.0.1", a.port, is_master=False,
                               timeout=datetime.timedelta(seconds=5))
        client.set("k", "v")
        assert client.get("k") == b"v"
        del client
    finally:
        a.close()
        b.close()
        a.close()  # idempotent


if __name__ == "__main__":
    import ctypes

    # PR_SET_PDEATHSIG(SIGKILL): the kernel kills this worker if the test process
    # dies, even while it is SIGSTOPped, so no run can leak processes.
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)
    _worker(json.loads(sys.argv[1]))
