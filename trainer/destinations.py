"""Where a joiner receives a donor's tensors: memory that is ready before the bytes come.

Receiving into freshly allocated tensors costs a page fault per 4 KiB page on
first touch, inside the receive loop; on the benchmark machine that cut a
transfer to a fifth of a raw socket copy (BENCHMARKS.md section 8). So the
donor sends its snapshot's layout first (a preview: the manifest without
bytes), and the joiner prepares a destination for every tensor before it
reads the bytes:

- its own tensor at the same place in its state, when dtype and shape match and
  it lives in CPU memory (a built model's parameters: already touched, and the
  load that follows is then a copy onto itself, which torch skips);
- else a view into one new allocation for all the rest, written once now so
  its pages exist.

Destinations from the joiner's own state are used only while that state is
worthless (the model as built, never loaded): a partly received snapshot then
cannot spoil a state the joiner could still enter with. A tensor the snapshot
describes differently from its preview gets fresh memory (still correct).
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from recover.proto import pb
from recover.trainer.statewire import empty_tensors, encode, meta_dtype


def tensor_paths(root: pb.StateNode) -> list[str]:
    """The place of every tensor in a state tree, in table order (as encode() names them)."""
    paths: dict[int, str] = {}

    def walk(node: pb.StateNode, path: str) -> None:
        kind = node.WhichOneof("value")
        if kind == "tensor":
            paths.setdefault(node.tensor, path)
        elif kind == "sequence":
            for i, item in enumerate(node.sequence.items):
                walk(item, f"{path}[{i}]")
        elif kind == "mapping":
            for key, value in zip(node.mapping.keys, node.mapping.values, strict=True):
                walk(value, f"{path}[{key!r}]")
        elif kind == "int_mapping":
            for int_key, value in zip(node.int_mapping.keys, node.int_mapping.values, strict=True):
                walk(value, f"{path}[{int_key}]")

    walk(root, "state")
    return [paths.get(i, "") for i in range(max(paths, default=-1) + 1)]


@dataclass
class OwnTensors:
    """A joiner's tensors offered to receive a snapshot in place, by place in its state."""

    by_path: dict[str, torch.Tensor] = field(default_factory=dict)
    used: bool = False
    """A snapshot was (being) received into some of them: their state is spoiled until the
    snapshot is loaded."""


def own_tensors(state: Any) -> OwnTensors:
    """A state's CPU tensors that bytes may be received into, by place. Tensors sharing
    memory with one already taken are left out (tied weights must not be written twice
    through two shapes)."""
    encoded = encode(state, check_only=True)  # the live tensors themselves, no copies
    seen: set[int] = set()
    usable = {}
    for path, tensor in zip(tensor_paths(encoded.root), encoded.tensors, strict=False):
        if tensor.device.type != "cpu" or not tensor.is_contiguous() or not tensor.numel():
            continue
        storage = tensor.untyped_storage().data_ptr()
        if storage in seen:
            continue
        seen.add(storage)
        usable[path] = tensor
    return OwnTensors(usable)


def _matches(tensor: torch.Tensor, meta: pb.TensorMeta) -> bool:
    return (str(tensor.dtype).removeprefix("torch.") == meta.dtype
            and list(tensor.shape) == list(meta.shape)
            and tensor.numel() * tensor.element_size() == meta.nbytes)


ALIGN = 64
"""Byte alignment of each tensor in a slab (any dtype's, and a cache line)."""


def slab_tensors(metas: Sequence[pb.TensorMeta]) -> list[torch.Tensor]:
    """Tensors for `metas` as views into one allocation, every page of it touched now: one
    large region faults in several times faster here than many small ones. The views keep
    the slab alive, so it is freed once the last of them is (an optimizer keeps its moments:
    those are the memory it needs anyway)."""
    offsets, total = [], 0
    for meta in metas:
        offsets.append(total)
        total += -(-meta.nbytes // ALIGN) * ALIGN
    slab = torch.zeros(total, dtype=torch.uint8)  # zeros: the pages are written, not just mapped
    tensors = []
    for meta, offset in zip(metas, offsets, strict=True):
        dtype = meta_dtype(meta)
        try:
            tensor = slab[offset:offset + meta.nbytes].view(dtype).view(list(meta.shape))
        except RuntimeError as exc:
            raise ValueError(f"tensor of shape {list(meta.shape)} and dtype {meta.dtype} cannot "
                             f"hold {meta.nbytes} bytes: {exc}") from None
        tensors.append(tensor)
    return tensors


class Destinations:
    """Tensors prepared from a preview, handed out for the snapshot that follows it."""

    def __init__(self, preview: pb.StateManifest, own: OwnTensors | None) -> None:
        started = time.monotonic()
        self._ready: dict[str, torch.Tensor] = {}
        self.reused_bytes = 0
        self.prepared_bytes = 0
        wanted: list[tuple[str, pb.TensorMeta]] = []
        for path, meta in zip(tensor_paths(preview.root), preview.tensors, strict=False):
            mine = own.by_path.get(path) if own is not None else None
            if mine is not None and _matches(mine, meta):
                own.used = True  # type: ignore[union-attr]
                self._ready[path] = mine
                self.reused_bytes += meta.nbytes
            else:
                wanted.append((path, meta))
        for (path, meta), tensor in zip(wanted, slab_tensors([m for _, m in wanted]), strict=True):
            self._ready[path] = tensor
            self.prepared_bytes += meta.nbytes
        self.prepared_at = time.monotonic()
        self.prepare_s = self.prepared_at - started

    def for_snapshot(self, manifest: pb.StateManifest) -> Iterator[torch.Tensor]:
        """A destination for each tensor the snapshot carries, in order: the prepared one for
        its place when it still fits, else fresh memory."""
        paths = tensor_paths(manifest.root)
        metas: Sequence[pb.TensorMeta] = manifest.tensors
        for i, meta in enumerate(metas):
            ready = self._ready.pop(paths[i], None) if i < len(paths) else None
            if ready is not None and _matches(ready, meta):
                yield ready
            else:
                yield from empty_tensors([meta])
