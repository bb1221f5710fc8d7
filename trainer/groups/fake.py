"""An in-process cross-replica group, for unit tests of the executor only. Not for training.

A `FakeWorld` is one generation's group among N participants that are threads of one
process: its `allreduce_sum_` really sums the N buffers (in rank order, so a fast-mode
result is reproducible) behind a barrier, and its failures are injected on purpose,
never by timing:

- `world.kill(rank)`: the member is gone; every pending and later collective (and
  connect) of the others raises `CollectiveAborted`, as a dead peer's closed sockets
  make gloo's do.
- `group.abort()` (any participant): its own call in flight fails, and so do the
  others', as when a real group shuts its sockets.
- `world.fail_connect(rank)`: that rank's `connect()` fails (and so the others' too,
  who would otherwise wait for it until the controller moves on).
- `world.crash_during_allreduce(rank, call)`: the member dies inside its `call`-th
  allreduce once every member has contributed its buffer: that thread gets
  `MemberKilled`, the others `CollectiveAborted` and a partially reduced buffer.

A collective that fails leaves the buffers of the members still waiting *partially
reduced* (their own data plus whatever had arrived), as gloo does: a caller that
reduces its only copy of the accumulation is caught by the tests.

A `FakeRendezvous` plays the rendezvous store: it is a `GroupFactory` that gives each
generation's members one shared `FakeWorld`, made on first use (or beforehand by a test
that wants to inject into it). A timeout (default 30 s) is only a safety net against a
broken test: it fails the world instead of hanging.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import torch

from recover.trainer.groups import CollectiveAborted, GroupSpec

DEFAULT_TIMEOUT_S = 30.0


class MemberKilled(BaseException):
    """Raised in a member's own thread when the fake kills it: the thread must end as a
    killed process would. A BaseException, so that no `except Exception` in the code under
    test takes it for an error it can handle."""


class FakeWorld:
    """One generation's group of `world_size` in-process participants."""

    def __init__(self, world_size: int, generation: int = 1,
                 timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        if world_size < 1:
            raise ValueError("a world has at least one member")
        self.world_size = world_size
        self.generation = generation
        self.timeout_s = timeout_s
        self._cond = threading.Condition()
        self._broken: str | None = None
        self._groups: dict[int, FakeGroup] = {}
        self._joined: set[int] = set()
        self._calls = [0] * world_size  # allreduces entered, per rank
        self._contributions: dict[int, dict[int, torch.Tensor]] = {}
        self._results: dict[int, torch.Tensor] = {}
        self._taken: dict[int, int] = {}
        self._fail_connect: set[int] = set()
        self._crash: set[tuple[int, int]] = set()
        self.completed = 0
        """Collectives that completed on every member."""

    # ------------------------------------------------------------ building and injecting

    def group(self, rank: int, spec: GroupSpec | None = None) -> FakeGroup:
        """Member `rank`'s group (one per rank; a second call returns the same one)."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside a world of {self.world_size}")
        with self._cond:
            if rank not in self._groups:
                self._groups[rank] = FakeGroup(self, spec or GroupSpec(
                    self.generation, rank, self.world_size, "fake", 0, self.timeout_s))
            return self._groups[rank]

    def kill(self, rank: int) -> None:
        self._break(f"member {rank} of generation {self.generation} died")

    def fail_connect(self, rank: int) -> None:
        with self._cond:
            self._fail_connect.add(rank)

    def crash_during_allreduce(self, rank: int, call: int = 0) -> None:
        with self._cond:
            self._crash.add((rank, call))

    def wait_inside(self, call: int, members: int, timeout_s: float | None = None) -> bool:
        """Block until `members` members are inside collective number `call` (or have been),
        so that a test injects its failure at a known point; False on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: sum(c > call for c in self._calls) >= members,
                                       timeout_s if timeout_s is not None else self.timeout_s)

    @property
    def broken(self) -> str | None:
        """Why the world failed, or None while it works."""
        return self._broken

    def _break(self, reason: str) -> None:
        with self._cond:
            if self._broken is None:
                self._broken = reason
            self._cond.notify_all()

    # ------------------------------------------------------------ what the groups call

    def _usable(self, group: FakeGroup) -> None:
        """Caller holds the lock."""
        if group._aborted:
            raise CollectiveAborted(f"generation {self.generation}: this member's group was "
                                    "aborted")
        if self._broken is not None:
            raise CollectiveAborted(f"generation {self.generation}: {self._broken}")

    def _wait(self, group: FakeGroup, done: Callable[[], bool]) -> None:
        """Wait (lock held) until `done()` or a failure; the timeout fails the world."""
        deadline = time.monotonic() + self.timeout_s
        while not done() and self._broken is None and not group._aborted:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                self._broken = f"timed out after {self.timeout_s}s (a test waits forever?)"
                self._cond.notify_all()
                break
            self._cond.wait(remaining)

    def _connect(self, group: FakeGroup) -> None:
        rank = group.spec.rank
        with self._cond:
            self._usable(group)
            if rank in self._fail_connect:
                self._broken = f"rank {rank}'s connect failed (injected)"
                self._cond.notify_all()
                self._usable(group)
            self._joined.add(rank)
            self._cond.notify_all()
            self._wait(group, lambda: len(self._joined) == self.world_size)
            self._usable(group)

    def _allreduce(self, group: FakeGroup, buffer: torch.Tensor) -> None:
        rank = group.spec.rank
        with self._cond:
            self._usable(group)
            if rank not in self._joined:
                raise RuntimeError("allreduce_sum_() before connect()")
            call = self._calls[rank]
            self._calls[rank] += 1
            arrived = self._contributions.setdefault(call, {})
            arrived[rank] = buffer.detach().clone()
            self._cond.notify_all()  # for wait_inside()
            if (rank, call) in self._crash:
                # Once every other member is inside the collective, so that each of them
                # is left with a partially reduced buffer: the worst case, made certain.
                self._wait(group, lambda: len(arrived) == self.world_size)
                self._broken = self._broken or f"member {rank} died in allreduce {call} (injected)"
                self._cond.notify_all()
                raise MemberKilled(self._broken)
            doomed = any((member, call) in self._crash for member in arrived)
            if len(arrived) == self.world_size and not doomed:
                total = arrived[0].clone()
                for other in range(1, self.world_size):
                    total += arrived[other]
                self._results[call] = total
                self.completed += 1
                self._cond.notify_all()
            self._wait(group, lambda: call in self._results)
            result = self._results.get(call)
            if result is None:
                # What a real in-place allreduce leaves behind when it fails midway.
                for other, contribution in arrived.items():
                    if other != rank:
                        buffer += contribution
                self._usable(group)
                raise CollectiveAborted(f"generation {self.generation}: allreduce {call} failed")
            buffer.copy_(result)
            self._taken[call] = self._taken.get(call, 0) + 1
            if self._taken[call] == self.world_size:  # everyone has it: free the round
                del self._results[call], self._contributions[call], self._taken[call]
            if group._aborted:  # aborted meanwhile: the result is not trusted (like gloo)
                raise CollectiveAborted(f"generation {self.generation}: this member's group "
                                        "was aborted")

    def _abort(self, group: FakeGroup) -> None:
        with self._cond:
            group._aborted = True
            if self._broken is None:
                self._broken = f"member {group.spec.rank}'s group was aborted"
            self._cond.notify_all()


class FakeGroup:
    """One member's view of a `FakeWorld` (a `CrossReplicaGroup`)."""

    meets_in_background = True

    def __init__(self, world: FakeWorld, spec: GroupSpec) -> None:
        self.world = world
        self.spec = spec
        self._aborted = False
        self._connected = False

    @property
    def aborted(self) -> bool:
        return self._aborted or self.world.broken is not None

    def connect(self) -> None:
        if self._connected:
            raise RuntimeError("connect() may be called only once")
        self._connected = True
        self.world._connect(self)

    def allreduce_sum_(self, buffer: torch.Tensor) -> None:
        self.world._allreduce(self, buffer)

    def start_allreduce_sum_(self, buffer: torch.Tensor) -> Callable[[], None]:
        self.world._allreduce(self, buffer)  # synchronous: nothing left to wait for
        return _done

    def abort(self) -> None:
        self.world._abort(self)

    def close(self) -> None:
        self.world._abort(self)  # a member that leaves is, to the others, a member gone


def _done() -> None:
    pass


class FakeRendezvous:
    """The fake's rendezvous store and a `GroupFactory`: `rendezvous(spec)` is member
    `spec.rank`'s group of generation `spec.generation`."""

    def __init__(self, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        self.timeout_s = timeout_s
        self._lock = threading.Lock()
        self.worlds: dict[int, FakeWorld] = {}

    def world(self, generation: int, world_size: int) -> FakeWorld:
        """Generation `generation`'s world, made now if it does not exist yet."""
        with self._lock:
            world = self.worlds.get(generation)
            if world is None:
                world = self.worlds[generation] = FakeWorld(world_size, generation,
                                                            self.timeout_s)
        if world.world_size != world_size:
            raise ValueError(f"generation {generation} has {world.world_size} members, "
                             f"not {world_size}")
        return world

    def __call__(self, spec: GroupSpec) -> FakeGroup:
        return self.world(spec.generation, spec.world_size).group(spec.rank, spec)
