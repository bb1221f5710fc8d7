"""The checkpoint file: one self-contained file per checkpoint, authenticated end to end.

    "RCVRCKP2" | key id (8) | u64 length | CheckpointMeta | MAC of all before (32)
        | the state's tensor bytes | MAC of all before (32)

Both MACs are HMAC-SHA256 with the folder's key (common/ckptkey.py), one running MAC
whose state after the meta gives the first: a reader of the meta alone (the controller,
picking the ledger a resumed job starts from) authenticates it without reading the
tensors, and a full read costs what a plain sha256 did. A file is data, never
configuration: the job a resumed run is comes from its invocation, and the meta's copy of
it is only compared with that (cli/resume.py); nothing of a file is parsed before its
MAC holds.

`CheckpointMeta` holds the job, the step, the state tree (statewire) and the step
ledger, so a job that lost every replica resumes from the file alone. Files appear
atomically (written owner-only under a temporary name, synced, renamed), so a reader
never sees half a file; a file damaged later (a torn copy, a full disk, bit rot) or
planted or edited by someone without the key fails its MAC, and the newest authentic one
before it is used, saying so. This module reads and checks files without torch; the
trainer reads the tensors.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import re
import struct
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

from google.protobuf.message import DecodeError

from recover.common import ckptkey
from recover.proto import pb

MAGIC = b"RCVRCKP2"
UNAUTHENTICATED_MAGIC = b"RCVRCKPT"
"""The format before files were authenticated (a plain sha256 anyone can recompute)."""
HEAD = struct.Struct("<8sQ")
"""The key's id, the length of the meta."""
MAC_BYTES = 32
NAME = re.compile(r"^ckpt-(\d{10})\.rcv$")
DEFAULT_KEEP = 3
CHUNK = 8 << 20


class CheckpointError(Exception):
    """A checkpoint cannot be used; the message says which and why."""


RANK_NAME = re.compile(r"^ckpt-(\d{10})\.rank(\d+)\.rcv$")


def file_name(step: int) -> str:
    return f"ckpt-{step:010d}.rcv"


def rank_file(head: Path, rank: int) -> Path:
    """The file of rank `rank` of a checkpoint of a replica of several ranks, beside its head
    (the file rank 0 writes, last, once every other rank's is in place: a head in the folder
    means the whole set is). Rank 0's is the head itself."""
    if rank == 0:
        return head
    return head.with_name(head.name.removesuffix(".rcv") + f".rank{rank}.rcv")


def folder_key(folder: Path, create: bool = False) -> bytes:
    """The key of the checkpoints in `folder` (created with `create`); CheckpointError."""
    try:
        return ckptkey.ensure(folder) if create else ckptkey.load(folder)
    except ckptkey.KeyProblem as exc:
        raise CheckpointError(str(exc)) from None


def _mac(key: bytes) -> hmac.HMAC:
    return hmac.new(key, digestmod=hashlib.sha256)


def write(folder: Path, meta: pb.CheckpointMeta, chunks: Iterable[memoryview | bytes],
          key: bytes | None = None, rank: int = 0) -> Path:
    """Write a checkpoint atomically, owner-only; returns its path. `chunks`: the tensors'
    bytes in the order of `meta.state.tensors`. `key`: default the folder's (created when
    the folder has none). `rank`: of a replica of several ranks, each writes its own file
    (rank_file)."""
    if key is None:
        key = folder_key(folder, create=True)
    ckptkey.make_folder(folder)
    target = rank_file(folder / file_name(meta.step), rank)
    tmp = folder / f".{target.name}.{os.getpid()}.tmp"
    head = meta.SerializeToString()
    mac = _mac(key)
    tmp.unlink(missing_ok=True)  # a stale one of a dead process with this pid
    # O_EXCL | O_NOFOLLOW: a name planted in the folder (a symlink to a file of this user)
    # is never written through.
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, ckptkey.FILE_MODE)
    try:
        with os.fdopen(fd, "wb") as f:
            for part in (MAGIC, HEAD.pack(ckptkey.key_id(key), len(head)), head):
                mac.update(part)
                f.write(part)
            # The head's own MAC (the state of the running one, finalized on a copy): a
            # reader of the meta alone authenticates it without reading the tensors.
            head_mac = mac.copy().digest()
            mac.update(head_mac)
            f.write(head_mac)
            for chunk in chunks:
                mac.update(chunk)
                f.write(chunk)
            f.write(mac.digest())
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


@dataclass
class _Opened:
    meta: pb.CheckpointMeta
    offset: int
    """Where the tensors' bytes start."""
    mac: hmac.HMAC
    """The MAC of every byte before `offset`, to go on over the tensors."""
    size: int


def _open(f: BinaryIO, path: Path, key: bytes) -> _Opened:
    """Read and authenticate the head: nothing of a file is parsed before its MAC holds."""
    size = os.fstat(f.fileno()).st_size
    magic = f.read(len(MAGIC))
    if magic == UNAUTHENTICATED_MAGIC:
        raise CheckpointError(f"{path.name} was written without authentication (an older "
                              "ReCoVer): refused")
    if magic != MAGIC:
        raise CheckpointError(f"{path.name} is not a ReCoVer checkpoint")
    fixed = f.read(HEAD.size)
    if len(fixed) != HEAD.size:
        raise CheckpointError(f"{path.name} is truncated")
    written_by, length = HEAD.unpack(fixed)
    offset = len(MAGIC) + HEAD.size + length + MAC_BYTES
    if offset + MAC_BYTES > size:
        raise CheckpointError(f"{path.name} is truncated")
    if written_by != ckptkey.key_id(key):
        raise CheckpointError(f"{path.name} was not written with this folder's key (another "
                              "job's file, or the key was replaced): refused")
    head = f.read(length)
    mac = _mac(key)
    for part in (magic, fixed, head):
        mac.update(part)
    head_mac = mac.copy().digest()
    if not hmac.compare_digest(head_mac, f.read(MAC_BYTES)):
        raise CheckpointError(f"{path.name} fails authentication with the folder's key "
                              "(edited, forged or damaged): refused")
    mac.update(head_mac)
    meta = pb.CheckpointMeta.FromString(head)
    tensor_bytes = sum(t.nbytes for t in meta.state.tensors)
    if offset + tensor_bytes + MAC_BYTES != size:
        raise CheckpointError(f"{path.name} is truncated ({size} bytes, expected "
                              f"{offset + tensor_bytes + MAC_BYTES})")
    return _Opened(meta, offset, mac, size)


def _check_end(f: BinaryIO, path: Path, mac: hmac.HMAC) -> None:
    if not hmac.compare_digest(f.read(MAC_BYTES), mac.digest()):
        raise CheckpointError(f"{path.name} fails authentication with the folder's key "
                              "(edited, forged or damaged): refused")


def read_meta(path: Path, verify: bool = True,
              key: bytes | None = None) -> tuple[pb.CheckpointMeta, int]:
    """The file's meta (always authenticated) and the offset of its tensor bytes;
    CheckpointError when the file is not a complete checkpoint written with `key` (default:
    its folder's). With `verify`, every byte of the file is authenticated too."""
    try:
        if key is None:
            key = folder_key(path.parent)
        with open(path, "rb") as f:
            opened = _open(f, path, key)
            if verify:
                left = opened.size - MAC_BYTES - opened.offset
                while left > 0:
                    chunk = f.read(min(CHUNK, left))
                    if not chunk:
                        raise CheckpointError(f"{path.name} is truncated")
                    opened.mac.update(chunk)
                    left -= len(chunk)
                _check_end(f, path, opened.mac)
    except OSError as exc:
        raise CheckpointError(f"cannot read {path.name}: {exc.strerror}") from None
    except (DecodeError, struct.error):
        raise CheckpointError(f"{path.name} is damaged (its header does not parse)") from None
    return opened.meta, opened.offset


def read(path: Path, buffers: Callable[[pb.CheckpointMeta], Iterable[memoryview]],
         key: bytes | None = None) -> pb.CheckpointMeta:
    """Read a checkpoint in one pass: `buffers(meta)` gives where each tensor's bytes go
    (in the order of `meta.state.tensors`); the whole file is authenticated as it is read,
    so a caller uses the buffers only when this returns."""
    try:
        if key is None:
            key = folder_key(path.parent)
        with open(path, "rb") as f:
            opened = _open(f, path, key)
            f.seek(opened.offset)
            for view in buffers(opened.meta):
                if len(view) and f.readinto(view) != len(view):
                    raise CheckpointError(f"{path.name} is truncated")
                opened.mac.update(view)
            _check_end(f, path, opened.mac)
    except OSError as exc:
        raise CheckpointError(f"cannot read {path.name}: {exc.strerror}") from None
    except (DecodeError, struct.error):
        raise CheckpointError(f"{path.name} is damaged (its header does not parse)") from None
    return opened.meta


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
    """The newest authentic, intact checkpoint in `folder`; CheckpointError when there is
    none (or the folder's key cannot be used: then none of its files can be trusted)."""
    found = listed(folder)
    if not found:
        raise CheckpointError(f"no checkpoint in {folder}")
    key = folder_key(folder)
    skipped = []
    for _, path in found:
        try:
            meta, _ = read_meta(path, key=key)
        except CheckpointError as exc:
            skipped.append(str(exc))
            continue
        return Latest(path, meta, skipped)
    raise CheckpointError(f"no authentic, intact checkpoint in {folder} ({'; '.join(skipped)})")


def prune(folder: Path, keep: int, key: bytes | None = None) -> list[Path]:
    """Delete the checkpoints older than the newest `keep` authentic ones (only their meta's
    MAC is checked: that is cheap, and enough to tell ours). Unauthenticated files newer
    than those are left alone: counted by name, files planted with large step numbers
    would otherwise make every new checkpoint the one deleted."""
    if key is None:
        key = folder_key(folder)
    kept, removed, oldest_kept = 0, [], None
    for step, path in listed(folder):
        if kept >= max(keep, 1):
            path.unlink(missing_ok=True)
            removed.append(path)
            continue
        try:
            read_meta(path, verify=False, key=key)
        except CheckpointError:
            continue
        kept += 1
        oldest_kept = step
    if oldest_kept is not None:  # other ranks' files of the sets deleted (or never finished)
        for name in os.listdir(folder):
            if (m := RANK_NAME.match(name)) and int(m.group(1)) < oldest_kept:
                (folder / name).unlink(missing_ok=True)
                removed.append(folder / name)
    return removed
