"""The cross-replica group: one interface, built per generation, with gloo, NCCL and a fake.

The executor reduces each step's gradient over a group of the generation's members and
must be able to give that group up in milliseconds when the membership changes
(DESIGN.md "Fault-tolerant collectives"). It sees only what is here: a `GroupSpec`, the
`CrossReplicaGroup` protocol (small on purpose, like torchft's ProcessGroup) and
`build_group`, so that a unit test can hand it the in-process fake (`groups.fake`) and a
GPU job the NCCL group (`groups.nccl`) without the executor knowing which it got.

Implementations: `groups.gloo` (the default; CPU buffers, CUDA ones staged through pinned
host memory), `groups.nccl` (CUDA buffers, one GPU per member; a job selects it with
`--group-backend nccl`: `group_factory`), `groups.fake` (threads of one process; a
unit-test seam only).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch

__all__ = ["BACKENDS", "CollectiveAborted", "CrossReplicaGroup", "GroupFactory", "GroupSpec",
           "build_group", "group_factory"]

BACKENDS = ("gloo", "nccl")
"""What `build_group` builds; the fake is built by its own `FakeRendezvous`."""


class CollectiveAborted(RuntimeError):
    """The generation's group was aborted (by abort()) or a peer failed; the caller must
    drop the group and rebuild in a newer generation."""


@dataclass(frozen=True)
class GroupSpec:
    """Everything needed to join one generation's cross-replica group."""
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
    """Store and collective timeout. Safety net only: the controller's abort is the fast path."""
    secret: str = ""
    """The generation's secret key prefix (controller/rendezvous.py): strangers who reach the
    store cannot find, read or write this group's keys."""
    shard: int = 0
    """Which shard (or pipeline stage) index of a multi-rank replica this group reduces: rank
    k of every replica meets rank k of the others in a group of its own, on a store prefix
    of its own. Always 0 while replicas are one process each."""

    @property
    def store_prefix(self) -> str:
        """Where this group's keys live in the rendezvous store. Shard 0 keeps the prefix
        that single-process replicas have always used."""
        prefix = f"gen/{self.generation}/{self.secret}/" if self.secret else f"gen/{self.generation}/"
        return prefix if self.shard == 0 else f"{prefix}shard/{self.shard}/"


@runtime_checkable
class CrossReplicaGroup(Protocol):
    """One generation's group as the executor uses it.

    A group is used once: connect(), any number of allreduce_sum_(), then close(). Any
    failure (a peer lost, abort() from another thread, a timeout) raises CollectiveAborted
    from the call in flight and from every later one; the caller then drops the group and
    waits for a newer generation.
    """

    spec: GroupSpec
    meets_in_background: bool
    """connect() may run on a thread of its own while the worker computes (groups/meeting.py):
    nothing it sets up is bound to the thread that calls it."""

    @property
    def aborted(self) -> bool:
        """True once the group can no longer be trusted (aborted, failed or closed)."""
        ...

    def connect(self) -> None:
        """Meet the other members (blocks until all have joined, or the group is aborted)."""
        ...

    def allreduce_sum_(self, buffer: torch.Tensor) -> None:
        """In-place SUM over the members. After a failure the buffer is partially reduced:
        callers pass a copy of what they must keep."""
        ...

    def start_allreduce_sum_(self, buffer: torch.Tensor) -> Callable[[], None]:
        """allreduce_sum_ in two halves: start it, and wait for it with what it returns
        (which raises CollectiveAborted as allreduce_sum_ would). Several may be in flight;
        they are issued, and must be waited for, in order. A backend without asynchronous
        collectives reduces here and returns a wait with nothing left to do."""
        ...

    def abort(self) -> None:
        """Thread-safe, idempotent, returns within milliseconds; fails a connect() or
        allreduce_sum_() blocked in another thread, and every later call."""
        ...

    def close(self) -> None:
        """Release everything the group holds; never hangs."""
        ...


GroupFactory = Callable[[GroupSpec], CrossReplicaGroup]
"""How the executor gets a generation's group: `build_group` in production, a fake in tests."""


def build_group(spec: GroupSpec, backend: str = "gloo") -> CrossReplicaGroup:
    """The group for `spec` on `backend` ("gloo" or "nccl"), not yet connected."""
    # Imported here: each backend pulls in torch.distributed machinery the others and the
    # fake do not need.
    if backend == "gloo":
        from recover.trainer.groups.gloo import GenerationGroup
        return GenerationGroup(spec)
    if backend == "nccl":
        from recover.trainer.groups.nccl import NcclGroup
        return NcclGroup(spec)
    raise ValueError(f"unknown group backend {backend!r} (one of {', '.join(BACKENDS)})")


def group_factory(backend: str, devices: Iterable[torch.device]) -> GroupFactory:
    """The groups of a job's `--group-backend` (gloo when unset), checked against the devices
    its reduced buffers live on: ValueError, one line saying what to change, when they
    cannot work. The setting is the job's, so every member builds the same kind of group."""
    if backend in ("", "gloo"):
        return build_group
    if backend != "nccl":
        raise ValueError(f"unknown group backend {backend!r} (one of {', '.join(BACKENDS)})")
    from recover.trainer.groups.nccl import nccl_available

    if not nccl_available():
        raise ValueError("--group-backend nccl needs a CUDA build of torch with NCCL and a "
                         "visible GPU on every host; use --group-backend gloo")
    host = sorted({str(d) for d in devices if d.type != "cuda"})
    if host:
        raise ValueError(f"--group-backend nccl reduces CUDA tensors, but this model's "
                         f"gradients or buffers are on {', '.join(host)}: put the model on "
                         "its GPU (recover.trainer's Job.device) or use --group-backend gloo")
    return functools.partial(build_group, backend="nccl")
