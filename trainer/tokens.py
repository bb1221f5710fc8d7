"""A token-stream dataset over a memory-mapped token file (nanoGPT-style ``.bin``).

The file is a flat array of token ids, uint16 (vocabularies up to 65,536) or
uint32, native little-endian, no header. Sample ``i`` is the window of
``seq_len + 1`` tokens starting at ``i * seq_len`` (inputs and their shifted
targets), so windows do not overlap and every token but the last is a
target exactly once per epoch.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

import numpy as np
import torch

TOKEN_DTYPES = {"uint16": np.uint16, "uint32": np.uint32}


class TokenFileDataset:
    """``len()`` windows of ``seq_len + 1`` int64 tokens, read lazily from ``path``."""

    def __init__(self, path: str | os.PathLike[str], seq_len: int, dtype: str = "uint16") -> None:
        if dtype not in TOKEN_DTYPES:
            raise ValueError(f"token dtype must be one of {', '.join(TOKEN_DTYPES)}, got {dtype!r}")
        if seq_len < 1:
            raise ValueError(f"seq_len must be at least 1, got {seq_len}")
        self.path = Path(path)
        self.seq_len = seq_len
        self.dtype = dtype
        try:
            size = self.path.stat().st_size
        except OSError as exc:
            raise ValueError(f"cannot read token file {self.path}: {exc.strerror}") from None
        itemsize = np.dtype(TOKEN_DTYPES[dtype]).itemsize
        if size % itemsize:
            raise ValueError(f"{self.path} is {size} bytes, not a whole number of {dtype} tokens "
                             "(wrong dtype?)")
        self.num_tokens = size // itemsize
        if self.num_tokens < seq_len + 1:
            raise ValueError(f"{self.path} holds {self.num_tokens} tokens; a window of seq_len "
                             f"{seq_len} needs at least {seq_len + 1}")
        # Read-only map: pages come in on demand and are shared by every worker of a host.
        self._tokens = np.memmap(self.path, dtype=TOKEN_DTYPES[dtype], mode="r")

    def __len__(self) -> int:
        return (self.num_tokens - 1) // self.seq_len

    def __getitem__(self, index: int) -> torch.Tensor:
        if not 0 <= index < len(self):
            raise IndexError(f"window {index} outside [0, {len(self)})")
        start = index * self.seq_len
        window = np.asarray(self._tokens[start:start + self.seq_len + 1], dtype=np.int64)
        return torch.from_numpy(window)


def write_token_file(path: str | os.PathLike[str], tokens: Iterable[int] | np.ndarray,
                     dtype: str = "uint16") -> Path:
    """Write ``tokens`` as a token file, atomically: concurrent writers of the same
    content (every worker preparing the same corpus) never expose a partial file."""
    if dtype not in TOKEN_DTYPES:
        raise ValueError(f"token dtype must be one of {', '.join(TOKEN_DTYPES)}, got {dtype!r}")
    array = np.asarray(tokens if isinstance(tokens, np.ndarray) else list(tokens), dtype=np.int64)
    limit = np.iinfo(TOKEN_DTYPES[dtype]).max
    if array.size and (array.min() < 0 or array.max() > limit):
        raise ValueError(f"token ids must be in [0, {limit}] for {dtype}")
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    array.astype(TOKEN_DTYPES[dtype]).tofile(tmp)
    os.replace(tmp, target)
    return target
