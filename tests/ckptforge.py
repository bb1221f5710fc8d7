"""An attacker's checkpoint: an authentic file's bytes with its meta edited and its digests
recomputed the way someone without the folder's key can (plain sha256, or a key of their
own), for the unit and integration tests of checkpoint authentication."""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Callable
from pathlib import Path

from recover.common import ckptfile, ckptkey
from recover.proto import pb


def forge(authentic: Path, target: Path, edit: Callable[[pb.CheckpointMeta], None],
          *, attacker_key: bytes | None = None,
          tensors: Callable[[bytes], bytes] = lambda b: b) -> Path:
    """Write to `target` the file `authentic` with `edit` applied to its meta and
    `tensors` to its tensor bytes. Without `attacker_key` the digests are plain sha256 and
    the key id is kept (a forger copying what they can see); with it, they are that key's
    HMACs under that key's id (ReCoVer's own writer run with another key)."""
    data = authentic.read_bytes()
    start = len(ckptfile.MAGIC) + ckptfile.HEAD.size
    key_id, length = ckptfile.HEAD.unpack(data[len(ckptfile.MAGIC):start])
    meta = pb.CheckpointMeta.FromString(data[start:start + length])
    body = tensors(data[start + length + ckptfile.MAC_BYTES:-ckptfile.MAC_BYTES])
    edit(meta)

    def digest(payload: bytes) -> bytes:
        if attacker_key is None:
            return hashlib.sha256(payload).digest()
        return hmac.new(attacker_key, payload, hashlib.sha256).digest()

    if attacker_key is not None:
        key_id = ckptkey.key_id(attacker_key)
    head = meta.SerializeToString()
    prefix = ckptfile.MAGIC + ckptfile.HEAD.pack(key_id, len(head)) + head
    whole = prefix + digest(prefix) + body
    target.write_bytes(whole + digest(whole))
    return target


def payload_job(meta: pb.CheckpointMeta, marker: Path, elsewhere: Path) -> None:
    """What the issue's attacker wrote into a checkpoint: a command that leaves `marker`
    behind, checkpoints sent to a folder of theirs, a loss of their choosing."""
    meta.job.workload.ClearField("command")
    meta.job.workload.command.extend(["sh", "-c", f"touch {marker}"])
    meta.job.checkpoint.dir = str(elsewhere)
    for record in meta.ledger:
        record.loss = 999.0
