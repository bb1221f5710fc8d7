"""Digests that let replicas prove they hold the same bits without shipping them."""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Iterable, Sequence
from concurrent.futures import Executor

import torch

DIGEST_SCHEME = "sha256/16MiB"
"""How a digest is made (reported in each run's summary, so that `recover verify` never
compares digests made two ways): per tensor, its name, dtype, shape and byte count, then the
sha256 of each 16 MiB chunk of its bytes; the sha256 of all that is the digest. The chunks
are independent, so a large model is hashed on several threads (`pool`) with the same
result as on one: a single sha256 stream over 200 MB took longer than a GPU step
(BENCHMARKS.md section 13). Before it ("sha256"): one stream over every tensor's bytes."""

CHUNK_BYTES = 16 << 20


_NUMPY_VIEWS = frozenset((torch.float32, torch.float64, torch.float16, torch.int64, torch.int32,
                          torch.int16, torch.int8, torch.uint8, torch.bool))
"""Dtypes numpy can view in place (bfloat16 is not one)."""

_PLAIN = (torch.Tensor, torch.nn.Parameter)
"""Types that are never sharded: no `to_local` to look up."""


@functools.lru_cache(maxsize=65536)
def _header(name: str, dtype: torch.dtype, shape: torch.Size, nbytes: int) -> bytes:
    """A tensor's header in the digest. The same few hundred tensors are hashed every step:
    made once each (formatting it cost as much as hashing a small tensor's bytes)."""
    return f"{name}|{dtype}|{tuple(shape)}|{nbytes}|".encode()


def _header_and_bytes(name: str, tensor: torch.Tensor) -> tuple[bytes, memoryview]:
    if type(tensor) not in _PLAIN:
        tensor = local_part(tensor)
    if tensor.is_cpu and tensor.dtype in _NUMPY_VIEWS and tensor.is_contiguous():
        # The same bytes through numpy: one or two torch ops instead of six. Every parameter and
        # buffer is hashed every step, and each op costs a few microseconds.
        array = (tensor.detach() if tensor.requires_grad else tensor).numpy()
        raw = memoryview(array).cast("B")
        return _header(name, tensor.dtype, tensor.shape, len(raw)), raw
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    # Viewing as uint8 lets numpy expose the buffer for any dtype (bfloat16 included).
    raw = memoryview(flat.view(torch.uint8).numpy())
    return _header(name, flat.dtype, tensor.shape, len(raw)), raw


def _sha256(chunk: memoryview) -> bytes:
    return hashlib.sha256(chunk).digest()  # releases the GIL: chunks hash in parallel


def tensor_digest(named: Iterable[tuple[str, torch.Tensor]], pool: Executor | None = None) -> str:
    """Hex digest (DIGEST_SCHEME) over names, dtypes, shapes and raw bytes; dtype and shape
    are hashed too, so a reinterpretation of the same bytes cannot collide. `pool`: threads
    to hash the chunks on (the same digest either way)."""
    headers, chunks, counts = [], [], []
    for name, tensor in named:
        header, raw = _header_and_bytes(name, tensor)
        headers.append(header)
        if 0 < len(raw) <= CHUNK_BYTES:  # one chunk (an empty tensor has none)
            chunks.append(raw)
            counts.append(1)
            continue
        pieces = [raw[at:at + CHUNK_BYTES] for at in range(0, len(raw), CHUNK_BYTES)]
        chunks.extend(pieces)
        counts.append(len(pieces))
    hashed = iter(pool.map(_sha256, chunks) if pool is not None and len(chunks) > 1
                  else map(_sha256, chunks))
    h = hashlib.sha256()
    for header, count in zip(headers, counts, strict=True):
        h.update(header)
        for _ in range(count):
            h.update(next(hashed))
    return h.hexdigest()


def legacy_tensor_digest(named: Iterable[tuple[str, torch.Tensor]]) -> str:
    """The digest of builds before DIGEST_SCHEME (one sha256 stream): what checkpoints
    written by those builds recorded, checked when such a checkpoint is resumed."""
    h = hashlib.sha256()
    for name, tensor in named:
        header, raw = _header_and_bytes(name, tensor)
        h.update(header.rsplit(b"|", 2)[0] + b"|")  # this scheme's header had no byte count
        h.update(raw)
    return h.hexdigest()


def local_part(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a sharded (DTensor) tensor, a plain tensor as it is: a digest or
    a gradient bucket covers what this process holds (replica.py combines the ranks')."""
    to_local = getattr(tensor, "to_local", None)
    return to_local() if callable(to_local) else tensor


def parameter_digest(model: torch.nn.Module) -> str:
    """The digest of every parameter of `model` (tied parameters once)."""
    return tensor_digest(model.named_parameters())


def step_digest(params: Iterable[tuple[str, torch.Tensor]],
                buffers: Sequence[tuple[str, torch.Tensor]] = (),
                pool: Executor | None = None) -> str:
    """The step digest: the parameters' digest, then ``+`` and the digest of the buffers in
    the guarantee when there are any. A model without them keeps exactly its parameter
    digest; one with them gets two parts, so `recover verify` can say which differs."""
    digest = tensor_digest(params, pool)
    return f"{digest}+{tensor_digest(buffers, pool)}" if buffers else digest


def legacy_step_digest(params: Iterable[tuple[str, torch.Tensor]],
                       buffers: Sequence[tuple[str, torch.Tensor]] = ()) -> str:
    """step_digest as builds before DIGEST_SCHEME made it."""
    digest = legacy_tensor_digest(params)
    return f"{digest}+{legacy_tensor_digest(buffers)}" if buffers else digest
