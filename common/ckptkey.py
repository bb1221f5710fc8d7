"""The checkpoint key: a secret per checkpoint folder that authenticates its files.

A checkpoint is trusted only when its HMAC-SHA256 (common/ckptfile.py) verifies with the
key in `FOLDER/checkpoint.key`: 32 random bytes, created once, owner-only. The key lives
in the folder because the folder is the one thing every host that may write a checkpoint
already shares (whichever replica is first writes), so no new secret has to be handed to
each host, and because it then goes wherever the folder is copied for a resume. Beside
TLS certificates it would not do: `recover run --tls` makes new ones every run, and a
cluster's certificates are per host while any host's worker writes checkpoints.

What that buys: someone who can put files into the folder but is not the job's user (a
group-writable share, a sync job, a file handed over from elsewhere) cannot make a file
the job accepts, because they cannot read the key, and a key they swap in is not owned by
the job's user and is refused (as ssh refuses a key file others can read or write). The
job's own user, and root, can read the key: they could run anything as the job anyway.
"""

from __future__ import annotations

import errno
import hashlib
import hmac
import os
import secrets
import stat
from pathlib import Path

KEY_NAME = "checkpoint.key"
KEY_BYTES = 32
FOLDER_MODE = 0o700
FILE_MODE = 0o600


class KeyProblem(Exception):
    """The folder's key cannot be used; the message says which file and why."""


class MissingKey(KeyProblem):
    """The folder has no key (it never held checkpoints of this ReCoVer, or it was deleted)."""


def key_path(folder: Path) -> Path:
    return folder / KEY_NAME


def key_id(key: bytes) -> bytes:
    """8 bytes a file carries to say which key wrote it, for a clearer refusal ("another
    key") than a failed MAC; it reveals nothing of the key."""
    return hmac.new(key, b"recover checkpoint key id", hashlib.sha256).digest()[:8]


def load(folder: Path) -> bytes:
    """The folder's key; KeyProblem when it is missing or could have been read or planted
    by another user."""
    path = key_path(folder)
    try:
        # O_NOFOLLOW: a symlink planted in the key's place would make any file the "key".
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:
        raise MissingKey(f"no checkpoint key {path}: the folder's checkpoints cannot be "
                         "authenticated") from None
    except OSError as exc:
        if exc.errno == errno.ELOOP:  # what O_NOFOLLOW says of a symbolic link
            raise KeyProblem(f"the checkpoint key {path} is a symbolic link: refused (a link "
                             "could make any file the key)") from None
        raise KeyProblem(f"cannot read the checkpoint key {path}: "
                         f"{exc.strerror or exc}") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):  # before fdopen, which refuses a folder
        os.close(fd)
        raise KeyProblem(f"the checkpoint key {path} is not a regular file")
    with os.fdopen(fd, "rb") as f:
        info = os.fstat(f.fileno())
        if info.st_uid not in (os.geteuid(), 0):
            raise KeyProblem(f"the checkpoint key {path} belongs to uid {info.st_uid}, not to "
                             f"this user ({os.geteuid()}): refused")
        if info.st_mode & 0o077:
            raise KeyProblem(f"the checkpoint key {path} is open to other users (mode "
                             f"{stat.S_IMODE(info.st_mode):04o}): `chmod 600 {path}`")
        key = f.read(KEY_BYTES + 1)
    if len(key) != KEY_BYTES:
        raise KeyProblem(f"the checkpoint key {path} holds {len(key)} bytes, not {KEY_BYTES}")
    return key


def make_folder(folder: Path) -> None:
    """Create the folder owner-only (parents as the umask says); an existing one is left as
    it is: its files are owner-only and authenticated whatever the folder's mode."""
    folder.mkdir(mode=FOLDER_MODE, parents=True, exist_ok=True)


def ensure(folder: Path) -> bytes:
    """The folder's key, created (with the folder) when there is none yet. Writers on two
    hosts may race here: the key is linked into place, which never replaces one, so both
    end up with the same key."""
    make_folder(folder)
    try:
        return load(folder)
    except MissingKey:
        pass
    path = key_path(folder)
    key = secrets.token_bytes(KEY_BYTES)
    tmp = folder / f".{KEY_NAME}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
    try:
        _create_exclusive(tmp, key)
        try:
            os.link(tmp, path)
        except FileExistsError:
            pass  # another writer's key came first: that one is the key
        except OSError:
            _create_exclusive(path, key)  # no hard links here: O_EXCL never replaces a key
    finally:
        tmp.unlink(missing_ok=True)
    _sync_folder(folder)
    return load(folder)


def _create_exclusive(path: Path, data: bytes) -> None:
    """Write a new owner-only file; nothing when the name exists (never through a link)."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, FILE_MODE)
    except FileExistsError:
        return
    with os.fdopen(fd, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _sync_folder(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)  # the key's name survives a crash of the host, as a checkpoint's does
    finally:
        os.close(fd)
