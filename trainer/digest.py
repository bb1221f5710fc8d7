"""Digests that let replicas prove they hold the same bits without shipping them."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence

import torch


def tensor_digest(named: Iterable[tuple[str, torch.Tensor]]) -> str:
    """Hex sha256 over names, dtypes, shapes and raw bytes; dtype and shape are hashed
    too, so a reinterpretation of the same bytes cannot collide."""
    h = hashlib.sha256()
    for name, tensor in named:
        tensor = local_part(tensor)
        t = tensor.detach().to("cpu").contiguous().reshape(-1)
        h.update(f"{name}|{t.dtype}|{tuple(tensor.shape)}|".encode())
        # Viewing as uint8 lets numpy expose the buffer for any dtype (bfloat16 included).
        h.update(memoryview(t.view(torch.uint8).numpy()))
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
                buffers: Sequence[tuple[str, torch.Tensor]] = ()) -> str:
    """The step digest: the parameters' digest, then ``+`` and the digest of the buffers in
    the guarantee when there are any. A model without them keeps exactly its parameter
    digest; one with them gets two parts, so `recover verify` can say which differs."""
    digest = tensor_digest(params)
    return f"{digest}+{tensor_digest(buffers)}" if buffers else digest
