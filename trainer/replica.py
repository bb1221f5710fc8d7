"""A replica of several ranks: its own process group, the lockstep its ranks keep, and what
they agree on before rank 0 speaks for them.

With `--ranks-per-replica K` a replica is K worker processes that shard one model copy
(FSDP2 over `Job.replica_mesh`), on one host or spanning several agents. Their group is
torch's default process group, met where the agent says (`RECOVER_REPLICA_STORE`): a file
when the ranks share a host, else tcp://HOST:PORT, a TCPStore that rank 0 serves on the
listening socket its agent holds (`RECOVER_REPLICA_STORE_FD`). It never spans replicas, so
a fault in one replica cannot hang another, and it is built once per replica life. Each rank
reduces its own gradient shard across replicas over a per-generation group of its shard
index (`GroupSpec.shard`).

Every rank runs the same executor on the same commands, and the ranks must issue the same
collectives on the replica's group in the same order (FSDP's all-gathers and
reduce-scatters, the agreement below). Commands reach each rank on its own channel at
moments of their own, so rank 0 decides each move of the loop — handle this command, or
do the next piece of work — and sends it to the others (`Lockstep`), as a serialized
`WorkerCommand`: typed, never pickled. The ranks' own channels still carry every
generation to them, which is what aborts a rank's cross-replica collective at once.

After each cross-replica reduction the ranks agree (`Lockstep.agree`): the replica has
reduced only if every rank has, and then rank 0 reports the replica's loss and tokens
(summed over its ranks' slices). Its digests are the digest of every rank's digest.
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from recover.common.netaddr import interface_with, is_loopback, local_address_towards
from recover.proto import pb

REPLICA_GROUP_TIMEOUT = datetime.timedelta(days=7)
"""The replica's own group waits this long in a collective. Rank 0 may wait for the
controller for minutes (a start, a takeover) while the others wait for its next move; a
rank that dies closes its sockets (the others fail in ms) and the agent kills a hung one
and then its siblings, so this timeout never decides anything."""

WORK, COMMAND = 0, 1


class ReplicaBroken(RuntimeError):
    """A collective on the replica's own group failed: a sibling rank is gone, so is this
    replica (its agent kills what is left of it)."""


@dataclass(frozen=True)
class ReplicaRanks:
    """This process's place in its replica."""

    rank: int
    size: int
    mesh: Any
    """A 1-D DeviceMesh over the replica's ranks (for fully_shard)."""
    group: Any
    """The replica's process group (torch's default group in this process)."""

    @property
    def leads(self) -> bool:
        return self.rank == 0


def from_environment() -> tuple[int, int]:
    """(rank in replica, ranks per replica) as the agent set them; (0, 1) when unset."""
    try:
        rank = int(os.environ.get("RECOVER_RANK_IN_REPLICA", "0"))
        size = int(os.environ.get("RECOVER_RANKS_PER_REPLICA", "1"))
    except ValueError:
        return 0, 1
    return (rank, size) if 0 <= rank < size else (0, 1)


def replica_store(where: str, rank: int, size: int, replica: int) -> dist.Store:
    """The store the replica's ranks meet on. A spanning replica's TCP store outlives the
    replica on its agent's socket (the next replica on those slots serves it anew), so each
    replica's keys live under its own id."""
    if not where.startswith("tcp://"):
        return dist.PrefixStore("replica/", dist.FileStore(where, size))
    host, _, port = where.removeprefix("tcp://").rpartition(":")
    fd = os.environ.get("RECOVER_REPLICA_STORE_FD", "")
    serving = {"master_listen_fd": int(fd)} if rank == 0 and fd.isdigit() else {}
    # Rank 0 may start seconds after the others (imports on a busy host): the others wait
    # in the socket's backlog, bounded only by the replica group's own timeout.
    store = dist.TCPStore(host.strip("[]"), int(port), size, rank == 0,
                          timeout=REPLICA_GROUP_TIMEOUT, wait_for_workers=False, **serving)
    return dist.PrefixStore(f"replica/{replica}/", store)


@contextlib.contextmanager
def gloo_interface_towards(where: str) -> Iterator[None]:
    """While the replica's group is built: gloo on the interface that reaches the replica's
    store, for a replica spanning hosts. Left alone, gloo binds to whatever the hostname
    resolves to (127.0.1.1 on many hosts, nothing at all inside a network namespace), which
    the other hosts' ranks cannot reach; GLOO_SOCKET_IFNAME, if set, wins as in torch."""
    interface = None
    if where.startswith("tcp://") and not os.environ.get("GLOO_SOCKET_IFNAME"):
        host, _, port = where.removeprefix("tcp://").rpartition(":")
        local = local_address_towards(host.strip("[]"), int(port))
        # Not loopback: the other hosts could not reach it (rank 0 beside the controller).
        interface = interface_with(local) if local and not is_loopback(local) else None
    if interface is None:
        yield
        return
    os.environ["GLOO_SOCKET_IFNAME"] = interface
    try:
        yield
    finally:
        del os.environ["GLOO_SOCKET_IFNAME"]  # the cross-replica groups choose their own


def join_replica(rank: int, size: int, where: str, replica: int = 0) -> ReplicaRanks:
    """Meet the replica's other ranks (blocks until all have come) and build its mesh."""
    from torch.distributed.device_mesh import DeviceMesh

    cuda = torch.cuda.is_available() and torch.cuda.device_count() > 0
    # NCCL for CUDA tensors where there are any (untested without a GPU), gloo for CPU ones.
    backend = "cpu:gloo,cuda:nccl" if cuda else "gloo"
    store = replica_store(where, rank, size, replica)
    with gloo_interface_towards(where):
        dist.init_process_group(backend, store=store, rank=rank, world_size=size,
                                timeout=REPLICA_GROUP_TIMEOUT)
    group = dist.group.WORLD
    assert group is not None  # just initialised
    mesh = DeviceMesh.from_group(group, "cuda" if cuda else "cpu")
    return ReplicaRanks(rank, size, mesh, group)


def split_batch(batch: Any, rank: int, size: int) -> Any:
    """This rank's slice of a microbatch: every tensor split along its first dimension into
    `size` equal parts, the same way on every replica (so a microbatch's gradient does not
    depend on which replica computes it); other values are passed on whole."""
    if isinstance(batch, torch.Tensor):
        if batch.dim() == 0 or batch.shape[0] % size:
            raise ValueError(f"a microbatch tensor of shape {list(batch.shape)} cannot be split "
                             f"evenly over the replica's {size} ranks: make the microbatch "
                             f"size a multiple of {size}")
        return batch.chunk(size)[rank]
    if isinstance(batch, Mapping):
        items = {k: split_batch(v, rank, size) for k, v in batch.items()}
        try:
            return type(batch)(items)  # type: ignore[call-arg]  # a dict, a BatchEncoding: the same kind back
        except TypeError:
            return items
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # a namedtuple
        return type(batch)(*(split_batch(v, rank, size) for v in batch))
    if isinstance(batch, list | tuple):
        return type(batch)(split_batch(v, rank, size) for v in batch)
    return batch


@dataclass(frozen=True)
class Agreement:
    """What the replica's ranks agreed after a cross-replica reduction."""

    reduced: bool
    """Every rank's reduction succeeded."""
    loss: float
    """The replica's loss: the mean over its shards' (each its slices' mean), or the sum
    over its pipeline stages' (the last stage's)."""
    tokens: int
    overflow: int


class Lockstep:
    """Rank 0 decides the loop's moves; the other ranks make the same ones."""

    def __init__(self, ranks: ReplicaRanks) -> None:
        self.ranks = ranks
        self.losses_add_up = False
        """Pipeline stages: only the last has the loss, the replica's is the sum. Shards
        (FSDP): each holds its slices' mean loss, the replica's is the mean."""
        self.buffers_averaged = False
        """Shards (FSDP) of a model with buffers in the guarantee: each rank updated its copy
        of the buffers from its slice of each microbatch, so the replica's update is the
        mean over its ranks (`average`). Pipeline stages own their buffers: nothing to do."""

    def _run(self, collective: Any, *args: Any) -> None:
        """One collective on the replica's group, called on the group object itself (no
        global c10d bookkeeping: any ProcessGroup works, the tests' too)."""
        try:
            collective(*args).wait()
        except (RuntimeError, ValueError) as exc:  # gloo: "Connection closed by peer"
            raise ReplicaBroken(f"the replica's rank group failed: {exc}") from None

    def _broadcast(self, tensor: torch.Tensor) -> None:
        options = dist.BroadcastOptions()
        options.rootRank = 0
        self._run(self.ranks.group.broadcast, [tensor], options)

    def lead(self, command: pb.WorkerCommand | None) -> None:
        """Rank 0: the next move is `command` (None: the next piece of work)."""
        payload = command.SerializeToString() if command is not None else b""
        header = torch.tensor([COMMAND if command is not None else WORK, len(payload)],
                              dtype=torch.int64)
        self._broadcast(header)
        if payload:
            self._broadcast(torch.frombuffer(bytearray(payload), dtype=torch.uint8))

    def follow(self) -> pb.WorkerCommand | None:
        """Ranks 1..: wait for rank 0's next move."""
        header = torch.zeros(2, dtype=torch.int64)
        self._broadcast(header)
        kind, size = int(header[0]), int(header[1])
        if kind == WORK:
            return None
        payload = torch.empty(size, dtype=torch.uint8)
        if size:
            self._broadcast(payload)
        return pb.WorkerCommand.FromString(payload.numpy().tobytes())

    def agree(self, reduced: bool, loss: float, tokens: int, overflow: int) -> Agreement:
        """Every rank, after its cross-replica reduction (succeeded or not)."""
        tally = torch.tensor([0.0 if reduced else 1.0, loss, float(tokens), float(overflow)],
                             dtype=torch.float64)
        self._run(self.ranks.group.allreduce, [tally], dist.AllreduceOptions())
        failed, loss_sum, tokens_sum, overflow_sum = tally.tolist()
        loss = loss_sum if self.losses_add_up else loss_sum / self.ranks.size
        return Agreement(failed == 0, loss, int(tokens_sum), int(overflow_sum))

    def average(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """Each of `tensors` summed over the replica's ranks, then divided by their number:
        every rank ends with the same bits, and every replica too (the same collective over
        the same inputs), so the result depends on the step's microbatches only."""
        averaged = []
        for tensor in tensors:
            total = tensor.clone()
            self._run(self.ranks.group.allreduce, [total], dist.AllreduceOptions())
            averaged.append(total.div_(self.ranks.size))
        return averaged

    def gather_text(self, text: str, size: int = 200) -> list[str]:
        """Every rank's `text` (at most `size` bytes of UTF-8), in rank order."""
        data = text.encode()
        if len(data) > size:
            raise ValueError(f"{text[:40]!r}... is longer than {size} bytes")
        mine = torch.zeros(size + 1, dtype=torch.uint8)
        mine[0] = len(data)
        mine[1:1 + len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data \
            else mine[1:1]
        parts = [torch.empty_like(mine) for _ in range(self.ranks.size)]
        self._run(self.ranks.group.allgather, [parts], [mine])
        return [bytes(p[1:1 + int(p[0])].tolist()).decode() for p in parts]

    def combine_digest(self, digest: str) -> str:
        """The replica's digest: sha256 over its ranks' digests in rank order (every rank
        calls it at the same point and gets the same answer)."""
        mine = torch.frombuffer(bytearray(hashlib.sha256(digest.encode()).digest()),
                                dtype=torch.uint8)
        parts = [torch.empty_like(mine) for _ in range(self.ranks.size)]
        self._run(self.ranks.group.allgather, [parts], [mine])
        return hashlib.sha256(b"".join(p.numpy().tobytes() for p in parts)).hexdigest()
