"""Training state as bytes on a wire, typed: a protobuf tree plus raw tensor bytes.

A join ships a replica's whole state (model, optimizer, scheduler, the user's
extra state, exact-reduction scales, the step) to another process; a
checkpoint writes the same thing to a file. Neither pickles: the structure
goes as a `StateNode` tree (dicts with string or int keys, lists and tuples,
ints, floats, strings, bools, None, bytes), and every tensor as a reference
into a table whose bytes follow the tree in order. Anything else in a state
dict is refused with the path that holds it, so a user learns at once which
piece of their extra state cannot travel.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from recover.proto import pb
from recover.trainer.digest import local_part

_DTYPES = {str(d).removeprefix("torch."): d for d in (
    torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32,
    torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128)}


class StateEncodingError(TypeError):
    """A state holds a value that cannot be sent; the message names where."""


@dataclass
class EncodedState:
    """A state tree with its tensors pulled out, ready to send or write."""

    root: pb.StateNode
    tensors: list[torch.Tensor] = field(default_factory=list)
    shards: list[pb.TensorShard | None] = field(default_factory=list)
    """Per tensor, when it is this rank's part of a sharded tensor: the whole's layout."""

    def manifest(self) -> pb.StateManifest:
        return pb.StateManifest(root=self.root, tensors=tensor_metas(self.tensors, self.shards))

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors)


def encode(state: Any, *, copy: bool = True, check_only: bool = False) -> EncodedState:
    """Pull the tensors out of `state` (contiguous CPU copies when `copy`: a snapshot that
    training may run past) and describe the rest as a tree. `check_only`: just find what
    cannot be sent (tensors stay where they are)."""
    tensors: list[torch.Tensor] = []
    shards: list[pb.TensorShard | None] = []

    def node(value: Any, path: str) -> pb.StateNode:
        if isinstance(value, torch.Tensor):
            shards.append(shard_layout(value))
            t = local_part(value).detach()  # a shard (DTensor) travels as this rank's part
            if t.dtype not in _DTYPES.values():
                raise StateEncodingError(f"{path}: tensors of dtype {t.dtype} cannot be sent")
            if not check_only:
                t = t.to("cpu", copy=copy).contiguous() if copy else t.to("cpu").contiguous()
            tensors.append(t)
            return pb.StateNode(tensor=len(tensors) - 1)
        if value is None:
            return pb.StateNode(none=True)
        if isinstance(value, bool):
            return pb.StateNode(bool_value=value)
        if isinstance(value, int):
            if not -(1 << 63) <= value < (1 << 63):
                raise StateEncodingError(f"{path}: integer {value} does not fit in 64 bits")
            return pb.StateNode(int_value=value)
        if isinstance(value, float):
            return pb.StateNode(float_value=value)
        if isinstance(value, str):
            return pb.StateNode(string_value=value)
        if isinstance(value, bytes):
            return pb.StateNode(bytes_value=value)
        if isinstance(value, list | tuple):
            return pb.StateNode(sequence=pb.StateSequence(
                tuple=isinstance(value, tuple),
                items=[node(v, f"{path}[{i}]") for i, v in enumerate(value)]))
        if isinstance(value, dict):
            keys = list(value)
            if all(isinstance(k, str) for k in keys):
                return pb.StateNode(mapping=pb.StateMapping(
                    keys=keys, values=[node(value[k], f"{path}[{k!r}]") for k in keys]))
            if all(isinstance(k, int) and not isinstance(k, bool) for k in keys):
                return pb.StateNode(int_mapping=pb.StateIntMapping(
                    keys=keys, values=[node(value[k], f"{path}[{k}]") for k in keys]))
            raise StateEncodingError(f"{path}: dict keys must be all strings or all ints")
        raise StateEncodingError(f"{path}: a {type(value).__name__} cannot be sent (state may hold "
                                 "tensors, numbers, strings, bytes, None, lists, tuples, dicts)")

    return EncodedState(node(state, "state"), tensors, shards)


def shard_layout(tensor: torch.Tensor) -> pb.TensorShard | None:
    """How this rank's part of a DTensor sits in the whole (None for a plain tensor, or a
    DTensor every rank holds whole)."""
    placements = getattr(tensor, "placements", None)
    if placements is None:
        return None
    from torch.distributed.tensor import Shard

    sharded = [p for p in placements if not p.is_replicate()]
    if not sharded:
        return None
    simple = len(placements) == 1 and type(sharded[0]) is Shard
    return pb.TensorShard(global_shape=list(tensor.shape),
                          dim=sharded[0].dim if simple else -1)


def decode(root: pb.StateNode, tensors: list[torch.Tensor]) -> Any:
    """The state tree back, its tensor references replaced by `tensors`."""
    kind = root.WhichOneof("value")
    if kind == "tensor":
        return tensors[root.tensor]
    if kind == "none":
        return None
    if kind == "sequence":
        items = [decode(v, tensors) for v in root.sequence.items]
        return tuple(items) if root.sequence.tuple else items
    if kind == "mapping":
        return {k: decode(v, tensors)
                for k, v in zip(root.mapping.keys, root.mapping.values, strict=True)}
    if kind == "int_mapping":
        return {k: decode(v, tensors)
                for k, v in zip(root.int_mapping.keys, root.int_mapping.values, strict=True)}
    if kind is None:
        raise ValueError("empty state node")
    return getattr(root, kind)


def tensor_metas(tensors: list[torch.Tensor],
                 shards: list[pb.TensorShard | None] | None = None) -> list[pb.TensorMeta]:
    """How a frame describes the tensors that follow it."""
    layouts = shards or [None] * len(tensors)
    return [pb.TensorMeta(dtype=str(t.dtype).removeprefix("torch."), shape=list(t.shape),
                          nbytes=t.numel() * t.element_size(), shard=layout)
            for t, layout in zip(tensors, layouts, strict=True)]


def meta_dtype(meta: pb.TensorMeta) -> torch.dtype:
    dtype = _DTYPES.get(meta.dtype)
    if dtype is None:
        raise ValueError(f"unknown tensor dtype {meta.dtype!r} in a state manifest")
    return dtype


def empty_tensors(metas: Iterable[pb.TensorMeta]) -> Iterator[torch.Tensor]:
    """Tensors to receive the described bytes into, in order (checked against their sizes)."""
    for meta in metas:
        t = torch.empty(list(meta.shape), dtype=meta_dtype(meta))
        if t.numel() * t.element_size() != meta.nbytes:
            raise ValueError(f"tensor of shape {list(meta.shape)} and dtype {meta.dtype} cannot "
                             f"hold {meta.nbytes} bytes")
        yield t


def as_bytes(tensor: torch.Tensor) -> memoryview:
    """The raw bytes of a contiguous CPU tensor, without a copy (any dtype, bfloat16 too)."""
    if not tensor.numel():
        return memoryview(b"")
    return memoryview(tensor.reshape(-1).view(torch.uint8).numpy())
