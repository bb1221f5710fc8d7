"""Checkpoints for total loss: taken at committed step boundaries, written in the background.

A job survives losing replicas without checkpoints (joins copy state from a
live replica); a checkpoint is for losing all of them. At a step boundary the
first member copies its state in memory (the only time the training loop
pays), and a background thread writes the copy (common/ckptfile.py: atomic,
owner-only, authenticated with the folder's key, old ones pruned) while
training goes on. The schedule is keyed by the step (`every_steps`), so
whichever replica is first writes the same checkpoints; `every_s` uses the
writer's clock. A checkpoint still being written when the next is due makes
that one skipped, not queued.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from recover.common import ckptfile
from recover.common.ckptfile import CheckpointError
from recover.proto import pb
from recover.trainer.statewire import as_bytes, decode, empty_tensors, encode

log = logging.getLogger("recover.trainer")

FINAL_WRITE_WAIT_S = 600.0
"""How long the end of a job waits for its last checkpoint to be written (a big state on a
slow disk takes minutes; a hung one must not hold the job forever)."""


def checkpoint_due(next_step: int, *, every_steps: int, every_s: float, last_step: int,
                   last_at: float, now: float) -> bool:
    """Is the state before `next_step` due for a checkpoint? (last_step: the newest one
    written or being written, -1 if none; last_at: when it was taken.)"""
    if next_step <= last_step or next_step == 0:
        return False
    if every_steps > 0:
        return next_step % every_steps == 0
    return every_s > 0 and now - last_at >= every_s


RANK_FILES_WAIT_S = 600.0
"""How long rank 0 of a replica of several ranks waits for the others' files before it gives
up that checkpoint (the set stays headless: never resumed from, pruned later)."""


class CheckpointWriter:
    def __init__(self, config: pb.CheckpointConfig, job: pb.JobConfig, replica: int,
                 report: Callable[[pb.CheckpointWritten], None], first_step: int,
                 rank: int = 0, ranks: int = 1) -> None:
        self.rank, self.ranks = rank, ranks
        """A replica of several ranks: each writes its own file (ckptfile.rank_file), rank 0
        its head last, once the others' are in place."""
        self.config = config
        self.folder = Path(config.dir)
        self._job = job
        self._replica = replica
        self._report = report
        self._last_step = first_step  # a resumed job does not write its own starting point
        self._last_at = time.monotonic()
        self._thread: threading.Thread | None = None

    def due(self, next_step: int) -> bool:
        """Whether the schedule writes the checkpoint of `next_step` (maybe_write's test)."""
        return checkpoint_due(next_step, every_steps=self.config.every_steps,
                              every_s=self.config.every_s, last_step=self._last_step,
                              last_at=self._last_at, now=time.monotonic())

    def maybe_write(self, next_step: int, state: Callable[[], dict[str, Any]],
                    ledger: list[pb.StepRecord], force: bool = False) -> None:
        """`force`: the job stops after this step; write it whatever the schedule (after the
        write in progress, if any)."""
        now = time.monotonic()
        if not force and not checkpoint_due(next_step, every_steps=self.config.every_steps,
                                            every_s=self.config.every_s,
                                            last_step=self._last_step, last_at=self._last_at,
                                            now=now):
            return
        if force and self._thread is not None:
            self._thread.join()
        if force and next_step == self._last_step:
            return  # the schedule wrote this very step already
        if self._thread is not None and self._thread.is_alive():
            log.warning("checkpoint of step %d skipped: the previous one is still being written",
                        next_step)
            return
        started = time.perf_counter()
        encoded = encode(state())  # the in-memory copy: training may run past it now
        meta = pb.CheckpointMeta(job=self._job, step=next_step, state=encoded.manifest(),
                                 ledger=ledger, created_at=time.time(), writer=self._replica)
        meta.job.ClearField("resume")
        snapshot_s = time.perf_counter() - started
        self._last_step, self._last_at = next_step, now
        self._thread = threading.Thread(target=self._write, args=(meta, encoded.tensors, snapshot_s),
                                        daemon=True, name=f"checkpoint-{next_step}")
        self._thread.start()

    def _write(self, meta: pb.CheckpointMeta, tensors: list[torch.Tensor],
               snapshot_s: float) -> None:
        started = time.perf_counter()
        try:
            if self.rank == 0 and self.ranks > 1:
                self._wait_for_rank_files(meta.step)
            path = ckptfile.write(self.folder, meta, (as_bytes(t) for t in tensors),
                                  rank=self.rank)
            if self.rank > 0:
                log.info("checkpoint of step %d: rank %d's part written", meta.step, self.rank)
                return
            removed = ckptfile.prune(self.folder, self.config.keep or ckptfile.DEFAULT_KEEP)
        except (OSError, ckptfile.CheckpointError) as exc:  # a disk, or the folder's key
            log.error("checkpoint of step %d failed: %s", meta.step, exc)
            self._report(pb.CheckpointWritten(step=meta.step, error=str(exc)))
            return
        write_s = time.perf_counter() - started
        log.info("checkpoint of step %d written to %s in %.2fs (%d old ones pruned)", meta.step,
                 path, write_s, len(removed))
        self._report(pb.CheckpointWritten(step=meta.step, path=str(path),
                                          bytes=path.stat().st_size, write_s=write_s,
                                          snapshot_s=snapshot_s))

    def _wait_for_rank_files(self, step: int) -> None:
        """The other ranks write theirs in threads of their own processes: look for them in
        the folder (it is this host's, like the ranks) rather than on the replica's group,
        which belongs to the training loop."""
        head = self.folder / ckptfile.file_name(step)
        deadline = time.monotonic() + RANK_FILES_WAIT_S
        while not all(ckptfile.rank_file(head, r).exists() for r in range(1, self.ranks)):
            if time.monotonic() > deadline:
                raise OSError(f"the other ranks' files of checkpoint {step} did not appear "
                              f"within {RANK_FILES_WAIT_S:.0f}s")
            time.sleep(0.01)

    def close(self, timeout_s: float = 30.0) -> None:
        """Let a write in progress finish (a job that ends keeps its last checkpoint)."""
        if self._thread is not None:
            self._thread.join(timeout_s)


def load(path: str) -> tuple[pb.CheckpointMeta, Any]:
    """The checkpoint's meta and its state tree, every byte authenticated (one pass)."""
    meta, tensors = _read(Path(path))
    return meta, decode(meta.state.root, tensors)


def _read(path: Path) -> tuple[pb.CheckpointMeta, list[torch.Tensor]]:
    tensors: list[torch.Tensor] = []

    def buffers(meta: pb.CheckpointMeta) -> list[memoryview]:
        tensors.extend(empty_tensors(meta.state.tensors))
        return [as_bytes(t) for t in tensors]

    return ckptfile.read(path, buffers), tensors


def merge_set(head: Path, meta: pb.CheckpointMeta, tensors: list[torch.Tensor]) -> Any:
    """The whole state of a checkpoint set (a replica of several ranks, each rank's file its
    shards): each sharded tensor's parts put back together in rank order along the dimension
    they split, every other value as rank 0 holds it. The ranks' workloads must have one
    structure: a pipeline set (each rank a stage of its own) is no one model."""
    ranks = [(meta, tensors)]
    for rank in range(1, meta.job.ranks_per_replica):
        path = ckptfile.rank_file(head, rank)
        if not path.exists():
            raise CheckpointError(f"{head.name}: rank {rank}'s file {path.name} is missing")
        other = _read(path)
        if other[0].step != meta.step:
            raise CheckpointError(f"{head.name}: rank {rank}'s file is of step {other[0].step}")
        ranks.append(other)
    # Each rank's tree with its tensors as references, so that the walk below knows, for a
    # tensor at a place, every rank's part and how the parts fit.
    trees = [decode(m.state.root, [_Part(rank, i) for i in range(len(t))])
             for rank, (m, t) in enumerate(ranks)]

    def merged(part: _Part) -> torch.Tensor:
        layout = meta.state.tensors[part.index].shard if \
            meta.state.tensors[part.index].HasField("shard") else None
        if layout is None:
            return tensors[part.index]
        if layout.dim < 0:
            raise CheckpointError(f"{head.name}: a tensor is sharded in a layout that rank files "
                                  "cannot be put back together from (several mesh dimensions or "
                                  "strided shards)")
        whole = torch.cat([ranks[rank][1][part.index] for rank in range(len(ranks))],
                          dim=layout.dim)
        if list(whole.shape) != list(layout.global_shape):
            raise CheckpointError(f"{head.name}: a tensor's parts make {list(whole.shape)}, not "
                                  f"the {list(layout.global_shape)} they were cut from")
        return whole

    def walk(values: list[Any], where: str) -> Any:
        first = values[0]
        if isinstance(first, _Part):
            if not all(isinstance(v, _Part) and v.index == first.index for v in values):
                raise CheckpointError(f"{head.name}: {where} differs between the ranks' files")
            return merged(first)
        if isinstance(first, dict):
            if any(not isinstance(v, dict) or list(v) != list(first) for v in values):
                raise CheckpointError(f"{head.name}: {where} differs between the ranks' files "
                                      "(pipeline stages?): there is no one model to merge; each "
                                      "rank's file resumes its own rank")
            return {k: walk([v[k] for v in values], f"{where}[{k!r}]") for k in first}
        if isinstance(first, list | tuple):
            if any(not isinstance(v, list | tuple) or len(v) != len(first) for v in values):
                raise CheckpointError(f"{head.name}: {where} differs between the ranks' files")
            items = [walk([v[i] for v in values], f"{where}[{i}]") for i in range(len(first))]
            return tuple(items) if isinstance(first, tuple) else items
        return first  # a number, a string: rank 0's

    state = dict(trees[0])
    state["workload"] = walk([tree["workload"] for tree in trees], "the workload")
    return state


def committed_digest(meta: pb.CheckpointMeta) -> str | None:
    """The parameter digest the ledger committed for the state a checkpoint holds (after
    step `meta.step - 1`: its writer's, else any member's); None when the ledger has none."""
    if not meta.ledger or meta.ledger[-1].step != meta.step - 1:
        return None
    digests = meta.ledger[-1].param_sha256
    own = [d.param_sha256 for d in digests if d.replica == meta.writer]
    return (own or [d.param_sha256 for d in digests] or [None])[0]


@dataclass(frozen=True)
class _Part:
    """A tensor of rank `rank`'s file, by its index there (merge_set's placeholder)."""
    rank: int
    index: int


@dataclass(frozen=True)
class Checkpoint:
    """A checkpoint as plain torch objects (`recover.trainer.load_checkpoint`)."""

    path: Path
    """The file it was read from."""
    step: int
    """Committed steps it holds: the state after step `step - 1`, before step `step`."""
    job_id: str
    model: dict[str, torch.Tensor]
    """`model.state_dict()`: parameters and buffers, on the CPU (`model.load_state_dict`)."""
    optimizer: dict[str, Any]
    """`optimizer.state_dict()`."""
    lr_scheduler: dict[str, Any] | None
    """`lr_scheduler.state_dict()`, None when the job had none."""
    extra: dict[str, Any]
    """name -> `state_dict()` of what the job passed as `extra_state`."""


def load_checkpoint(path: str | os.PathLike[str]) -> Checkpoint:
    """Read a checkpoint file, or the newest authentic one of a checkpoint folder, for use
    outside ReCoVer (evaluation, export, fine-tuning). Every byte is authenticated with the
    folder's key first (`checkpoint.key` beside the files: readable by its owner only), so a
    planted or damaged file is refused; no pickle is involved. A sharded replica's set (a
    file per rank) comes back as one model: each FSDP2 shard put back in place. CheckpointError
    (a one-line reason) when it cannot be used."""
    where = Path(path)
    if where.is_dir():
        latest = ckptfile.latest(where)
        for reason in latest.skipped:
            log.warning("passed over: %s", reason)
        where = latest.path
    elif not where.exists():
        raise CheckpointError(f"no checkpoint file or folder {str(where)!r}")
    if ".rank" in where.name:
        raise CheckpointError(f"{where.name} is one rank's part of a checkpoint set: name the "
                              f"set's head ({where.name.split('.rank')[0]}.rcv) or its folder")
    meta, tensors = _read(where)
    # A replica of several ranks wrote a set, a file per rank: the model is all of them.
    state = merge_set(where, meta, tensors) if meta.job.ranks_per_replica > 1 \
        else decode(meta.state.root, tensors)
    workload = state["workload"]
    return Checkpoint(path=where, step=meta.step, job_id=meta.job.job_id,
                      model=dict(workload["model"]), optimizer=workload["optimizer"],
                      lr_scheduler=workload.get("lr_scheduler"),
                      extra=dict(workload.get("extra", {})))
