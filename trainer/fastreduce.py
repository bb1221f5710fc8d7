"""Fast (float) gradient accumulation and reduction, and the result every reduction gives.

Backward sums each microbatch's gradient into `.grad` (the flat buckets of
trainer/gradients.py); the step's reduction packs the buckets into one buffer per dtype and
device (each allreduce more costs ~1.5 ms of a 9 ms step on this machine), a model's
integer buffers riding in the float32 buffer as exact digits (trainer/limbs.py), and the
step's statistics (loss sum, microbatch count) in the last buffer when its dtype holds them
exactly. With `piece_bytes`, the end of a large gradient bucket is reduced in pieces first,
each by a collective of its own, so that they can start during the last microbatch's
backward (trainer/overlap.py). Exact mode is trainer/reduction.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from recover.trainer.gradients import BucketSet
from recover.trainer.limbs import LIMBS, join, split

REDUCE_DTYPES = ("grad", "float32")


@dataclass
class Reduced:
    """A reduction's result, divided and ready to apply."""

    grads: list[torch.Tensor]
    """Mean gradient over the reduced microbatches, one flat tensor per bucket, in its dtype."""
    loss: float
    """Mean loss over the reduced microbatches."""
    microbatches: int
    overflow: int
    """Microbatches whose gradient did not fit the exact scale (exact mode; then redo)."""


@dataclass(frozen=True)
class Piece:
    """A range of one gradient bucket reduced by a collective of its own."""

    group: int
    """The reduce buffer it is in."""
    start: int
    end: int
    """Its range in that buffer."""
    bucket: int
    """The bucket it copies (an index of the accumulator's buckets)."""
    bucket_start: int
    bucket_end: int
    """Its range in the bucket's flat gradient."""
    params: tuple[int, ...]
    """Indices (in the bucket's `params`) of the parameters whose gradients it holds."""


def _holds_counts(dtype: torch.dtype) -> bool:
    return dtype in (torch.float32, torch.float64)


class FastAccumulator:
    """Float accumulation: backward sums microbatch gradients into `.grad` directly."""

    def __init__(self, grads: BucketSet, reduce_dtype: str = "grad", piece_bytes: int = 0) -> None:
        if reduce_dtype not in REDUCE_DTYPES:
            raise ValueError(f"reduce dtype must be one of {', '.join(REDUCE_DTYPES)}, "
                             f"got {reduce_dtype!r}")
        self.grads = grads
        dtypes = [b.dtype if reduce_dtype == "grad" or b.dtype == torch.float64
                  else torch.float32 for b in grads.buckets]
        # One reduce buffer per (dtype, device), its buckets one after the other: one
        # allreduce each, where a model whose buffers are reduced has two or three buckets
        # (each allreduce more cost ~1.5 ms of a 9 ms step here).
        self._groups: list[tuple[torch.dtype, torch.device]] = []
        self._digits: list[bool] = []
        """Per bucket: integers carried as float32 digits (limbs.py) in its device's float32
        buffer, so that counters cost no allreduce of their own."""
        members: list[list[int]] = []
        for index, (bucket, dtype) in enumerate(zip(grads.buckets, dtypes, strict=True)):
            digits = bucket.integer and (torch.float32, bucket.device) in self._groups
            key = (torch.float32 if digits else dtype, bucket.device)
            if key not in self._groups:
                self._groups.append(key)
                members.append([])
            members[self._groups.index(key)].append(index)
            self._digits.append(digits)
        # The statistics ride in the last bucket's buffer when it holds small integers
        # exactly, else in a float64 buffer of their own.
        self._stats_group = self._groups.index(
            (torch.float32 if self._digits[-1] else dtypes[-1], grads.buckets[-1].device))
        self._separate_stats = not _holds_counts(self._groups[self._stats_group][0])
        split = [self._split_bucket(ids, group, piece_bytes) for group, ids in enumerate(members)]
        self._layout: list[tuple[int, int]] = [(0, 0)] * len(grads.buckets)
        """Per bucket: its reduce buffer's index and its offset there."""
        self._sizes: list[int] = []
        self._stats_offset = 0
        self.pieces: list[Piece] = []
        """Ranges of the gradient reduced first, each by a collective of its own, in this
        order (empty unless `piece_bytes`): the end of a big gradient bucket, whose
        parameters backward finishes first. overlap.py starts them during the last
        microbatch's backward; `schedule` lists them first either way."""
        self._rest_end: list[int] = []
        """Per reduce buffer: it is reduced as `[:end]` after the pieces."""
        for group, ids in enumerate(members):
            # The split bucket goes last, so that its pieces end the buffer and what is
            # left (other buckets, the statistics, its head) is one range before them.
            order = [i for i in ids if i != split[group]] + \
                ([split[group]] if split[group] is not None else [])
            size = 0
            for index in order:
                if index == split[group] and group == self._stats_group \
                        and not self._separate_stats:
                    self._stats_offset, size = size, size + 2
                self._layout[index] = (group, size)
                size += grads.buckets[index].numel * (LIMBS if self._digits[index] else 1)
            if group == self._stats_group and not self._separate_stats \
                    and split[group] is None:
                self._stats_offset, size = size, size + 2
            self._sizes.append(size)
            self._rest_end.append(size)
            if split[group] is not None:
                self._cut(split[group], piece_bytes)
        self.loss_sum = 0.0
        self.count = 0

    def _split_bucket(self, ids: list[int], group: int, piece_bytes: int) -> int | None:
        """The bucket of a reduce buffer whose end is reduced in pieces: its largest gradient
        bucket (never integers carried as digits: those are made after the step's last
        microbatch), if at least one piece fits after its first parameter."""
        candidates = [i for i in ids if self.grads.buckets[i].params and not self._digits[i]]
        if piece_bytes <= 0 or not candidates:
            return None
        index = max(candidates, key=lambda i: self.grads.buckets[i].numel)
        bucket = self.grads.buckets[index]
        width = self._groups[group][0].itemsize
        return index if (bucket.numel - bucket.sizes[0]) * width >= piece_bytes else None

    def _cut(self, index: int, piece_bytes: int) -> None:
        """Cut bucket `index`'s end into pieces of at least `piece_bytes` at parameter
        boundaries, the last parameters first; its first parameter always stays with the
        rest (what backward produces last, and what a fault hook writes after it)."""
        bucket = self.grads.buckets[index]
        group, base = self._layout[index]
        width = self._groups[group][0].itemsize
        starts = [0]
        for n in bucket.sizes[:-1]:
            starts.append(starts[-1] + n)
        end, last = bucket.numel, len(bucket.params)
        for i in range(len(bucket.params) - 1, 0, -1):
            if (end - starts[i]) * width >= piece_bytes:
                self.pieces.append(Piece(group, base + starts[i], base + end, index, starts[i],
                                         end, tuple(range(i, last))))
                end, last = starts[i], i
        self._rest_end[group] = base + end

    def reset(self, scale_epoch: int = 0) -> None:
        self.grads.zero()
        self.loss_sum = 0.0
        self.count = 0

    def before_microbatch(self) -> None:
        pass

    def defer_pieces(self) -> None:
        """Nothing to do: backward accumulates into `.grad`, which the pieces copy."""

    def piece_ready(self, index: int) -> None:
        """Nothing to do (see `defer_pieces`)."""

    def after_microbatch(self, loss: float) -> None:
        self.loss_sum += loss
        self.count += 1

    def buffers(self) -> list[torch.Tensor]:
        """Copies to reduce: an interrupted allreduce leaves its buffer partially reduced."""
        out = self.new_buffers()
        for piece in self.pieces:
            self.fill_piece(out, piece)
        self.fill_rest(out)
        return out

    def new_buffers(self) -> list[torch.Tensor]:
        """The reduce buffers, not yet filled (`fill_piece`, `fill_rest`)."""
        out = [torch.empty(size, dtype=dtype, device=device)
               for (dtype, device), size in zip(self._groups, self._sizes, strict=True)]
        if self._separate_stats:
            out.append(torch.empty(2, dtype=torch.float64, device=self._groups[self._stats_group][1]))
        return out

    def fill_piece(self, out: list[torch.Tensor], piece: Piece) -> None:
        """Copy a piece of the accumulated gradient into its place in `out`."""
        flat = self.grads.buckets[piece.bucket].flat
        out[piece.group][piece.start:piece.end].copy_(flat[piece.bucket_start:piece.bucket_end])

    def fill_rest(self, out: list[torch.Tensor]) -> None:
        """Copy everything the pieces do not hold into `out`: buckets, digits, statistics."""
        split_at = {p.bucket: p.bucket_start for p in self.pieces}  # the last piece: the lowest
        for index, (bucket, (group, offset), digits) in enumerate(zip(
                self.grads.buckets, self._layout, self._digits, strict=True)):
            if digits:
                split(bucket.flat, out[group][offset:offset + bucket.numel * LIMBS])
            else:
                n = split_at.get(index, bucket.numel)
                out[group][offset:offset + n].copy_(bucket.flat[:n])  # cast if it must
        stats = torch.tensor([self.loss_sum, float(self.count)],
                             dtype=torch.float64 if self._separate_stats
                             else self._groups[self._stats_group][0],
                             device=self._groups[self._stats_group][1])
        if self._separate_stats:
            out[-1].copy_(stats)
        else:
            out[self._stats_group][self._stats_offset:self._stats_offset + 2] = stats

    def schedule(self, out: list[torch.Tensor]) -> list[torch.Tensor]:
        """What each collective of the reduction reduces, in the order every member issues
        them: the pieces, then the rest of each buffer."""
        rest = [buffer[:end] for buffer, end in zip(out, self._rest_end, strict=False)]
        return [out[p.group][p.start:p.end] for p in self.pieces] + rest + out[len(rest):]

    def finish(self, reduced: list[torch.Tensor]) -> Reduced:
        stats = reduced[-1] if self._separate_stats else \
            reduced[self._stats_group][self._stats_offset:self._stats_offset + 2]
        loss_sum, count = float(stats[0]), int(round(float(stats[1])))
        divisor = max(count, 1)
        means = []
        for bucket, (group, offset), digits in zip(self.grads.buckets, self._layout,
                                                   self._digits, strict=True):
            if digits:
                mean = join(reduced[group][offset:offset + bucket.numel * LIMBS],
                            bucket.numel).div_(divisor)
            else:
                mean = reduced[group][offset:offset + bucket.numel].div_(divisor)
            means.append(mean if mean.dtype == bucket.dtype else mean.to(bucket.dtype))
        return Reduced(means, loss_sum / divisor, count, 0)

    def observe_committed(self, means: list[torch.Tensor]) -> None:
        pass

    def loss_scale_changed(self, factor: float) -> None:
        pass

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass
