"""The checkpoint file: one self-contained file per checkpoint, checked end to end.

    "RCVRCKPT" | u64 length | CheckpointMeta | the state's tensor bytes | sha256 of all before

`CheckpointMeta` holds the job, the step, the state tree (statewire) and the
step ledger, so a job that lost every replica resumes from the file alone.
Files appear atomically (written under a temporary name, synced, renamed), so
a reader never sees half a file; a file damaged later (a torn copy, a full
disk, bit rot) fails its checksum and the one before it is used, saying so.
This module reads and checks files without torch (the controller picks the
checkpoint a job resumes from); the trainer reads the tensors.
"""

from __future__ import annotations

import hashlib
import os
import re
import struct
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from google.protobuf.message import DecodeError

from recover.proto import pb

MAGIC = b"RCVRCKPT"
LENGTH = struct.Struct("<Q")
DIGEST_BYTES = 32
NAME = re.compile(r"^ckpt-(\d{10})\.rcv$")
DEFAULT_KEEP = 3
CHUNK = 8 << 20


class CheckpointError(Exception):
    """A checkpoint cannot be used; the message says which and why."""


def file_name(step: int) -> str:
    return f"ckpt-{step:010d}.rcv"


def write(folder: Path, meta: pb.CheckpointMeta, chunks: Iterable[memoryview | bytes]) -> Path:
    """Write a checkpoint atomically; returns its path. `chunks`: the tensors' bytes in the
    order of `meta.state.tensors`."""
    folder.mkdir(parents=True, exist_ok=True)
    target = folder / file_name(meta.step)
    tmp = folder / f".{target.name}.{os.getpid()}.tmp"
    digest = hashlib.sha256()
    head = meta.SerializeToString()
    try:
        with open(tmp, "wb") as f:
            for chunk in (MAGIC, LENGTH.pack(len(head)), head, *chunks):
                digest.update(chunk)
                f.write(chunk)
            f.write(digest.digest())
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)  # a full disk must not fill up further with torn copies
        raise
    dir_fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(dir_fd)  # the rename itself survives a crash of the host
    finally:
        os.close(dir_fd)
    return target


def read_meta(path: Path, verify: bool = True) -> tuple[pb.CheckpointMeta, int]:
    """The file's meta and the offset of its tensor bytes; CheckpointError when the file is
    not a complete, intact checkpoint (with `verify`, the whole file's checksum is checked)."""
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if f.read(len(MAGIC)) != MAGIC:
                raise CheckpointError(f"{path.name} is not a ReCoVer checkpoint")
            (length,) = LENGTH.unpack(f.read(LENGTH.size))
            offset = len(MAGIC) + LENGTH.size + length
            if offset + DIGEST_BYTES > size:
                raise CheckpointError(f"{path.name} is truncated")
            meta = pb.CheckpointMeta.FromString(f.read(length))
            tensor_bytes = sum(t.nbytes for t in meta.state.tensors)
            if offset + tensor_bytes + DIGEST_BYTES != size:
                raise CheckpointError(f"{path.name} is truncated ({size} bytes, expected "
                                      f"{offset + tensor_bytes + DIGEST_BYTES})")
            if verify:
                f.seek(0)
                digest = hashlib.sha256()
                left = size - DIGEST_BYTES
                while left > 0:
                    chunk = f.read(min(CHUNK, left))
                    digest.update(chunk)
                    left -= len(chunk)
                if f.read(DIGEST_BYTES) != digest.digest():
                    raise CheckpointError(f"{path.name} fails its checksum (damaged)")
    except OSError as exc:
        raise CheckpointError(f"cannot read {path.name}: {exc.strerror}") from None
    except (DecodeError, struct.error):
        raise CheckpointError(f"{path.name} is damaged (its header does not parse)") from None
    return meta, offset


def listed(folder: Path) -> list[tuple[int, Path]]:
    """(step, path) of every checkpoint file in `folder`, newest first."""
    try:
        names = os.listdir(folder)
    except FileNotFoundError:
        return []
    found = [(int(m.group(1)), folder / n) for n in names if (m := NAME.match(n))]
    return sorted(found, reverse=True)


@dataclass
class Latest:
    path: Path
    meta: pb.CheckpointMeta
    skipped: list[str] = field(default_factory=list)
    """Why newer files were passed over (torn, damaged), for the user."""


def latest(folder: Path) -> Latest:
    """The newest intact checkpoint in `folder`; CheckpointError when there is none."""
    skipped = []
    for _, path in listed(folder):
        try:
            meta, _ = read_meta(path)
        except CheckpointError as exc:
            skipped.append(str(exc))
            continue
        return Latest(path, meta, skipped)
    detail = f" ({'; '.join(skipped)})" if skipped else ""
    raise CheckpointError(f"no intact checkpoint in {folder}{detail}")


def prune(folder: Path, keep: int) -> list[Path]:
    """Delete all but the newest `keep` checkpoints (and stale temporary files)."""
    removed = []
    for _, path in listed(folder)[max(keep, 1):]:
        path.unlink(missing_ok=True)
        removed.append(path)
    return removed
