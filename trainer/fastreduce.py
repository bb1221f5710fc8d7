"""Fast (float) gradient accumulation and reduction, and the result every reduction gives.

Backward sums each microbatch's gradient into `.grad` (the flat buckets of
trainer/gradients.py); the step's reduction packs the buckets into one buffer per dtype and
device (each allreduce more costs ~1.5 ms of a 9 ms step on this machine), a model's
integer buffers riding in the float32 buffer as exact digits (trainer/limbs.py), and the
step's statistics (loss sum, microbatch count) at the end of the last buffer when its dtype
holds them exactly. Exact mode is trainer/reduction.py.
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


def _holds_counts(dtype: torch.dtype) -> bool:
    return dtype in (torch.float32, torch.float64)


class FastAccumulator:
    """Float accumulation: backward sums microbatch gradients into `.grad` directly."""

    def __init__(self, grads: BucketSet, reduce_dtype: str = "grad") -> None:
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
        self._layout: list[tuple[int, int]] = []
        """Per bucket: its reduce buffer's index and its offset there."""
        self._digits: list[bool] = []
        """Per bucket: integers carried as float32 digits (limbs.py) in its device's float32
        buffer, so that counters cost no allreduce of their own."""
        sizes: list[int] = []
        for bucket, dtype in zip(grads.buckets, dtypes, strict=True):
            digits = bucket.integer and (torch.float32, bucket.device) in self._groups
            key = (torch.float32 if digits else dtype, bucket.device)
            if key not in self._groups:
                self._groups.append(key)
                sizes.append(0)
            group = self._groups.index(key)
            self._layout.append((group, sizes[group]))
            self._digits.append(digits)
            sizes[group] += bucket.numel * (LIMBS if digits else 1)
        self._sizes = sizes
        # The statistics ride at the end of the last bucket's buffer when it holds small
        # integers exactly, else in a float64 buffer of their own.
        self._stats_group = self._layout[-1][0]
        self._separate_stats = not _holds_counts(self._groups[self._stats_group][0])
        self.loss_sum = 0.0
        self.count = 0

    def reset(self, scale_epoch: int = 0) -> None:
        self.grads.zero()
        self.loss_sum = 0.0
        self.count = 0

    def before_microbatch(self) -> None:
        pass

    def after_microbatch(self, loss: float) -> None:
        self.loss_sum += loss
        self.count += 1

    def buffers(self) -> list[torch.Tensor]:
        """Copies to reduce: an interrupted allreduce leaves its buffer partially reduced."""
        out = []
        for group, ((dtype, device), size) in enumerate(zip(self._groups, self._sizes,
                                                            strict=True)):
            extra = 2 if group == self._stats_group and not self._separate_stats else 0
            buffer = torch.empty(size + extra, dtype=dtype, device=device)
            out.append(buffer)
        for bucket, (group, offset), digits in zip(self.grads.buckets, self._layout,
                                                   self._digits, strict=True):
            if digits:
                split(bucket.flat, out[group][offset:offset + bucket.numel * LIMBS])
            else:
                out[group][offset:offset + bucket.numel].copy_(bucket.flat)  # cast if it must
        stats = torch.tensor([self.loss_sum, float(self.count)],
                             dtype=torch.float64 if self._separate_stats
                             else self._groups[self._stats_group][0],
                             device=self._groups[self._stats_group][1])
        if self._separate_stats:
            out.append(stats)
        else:
            out[self._stats_group][-2:] = stats
        return out

    def finish(self, reduced: list[torch.Tensor]) -> Reduced:
        stats = reduced[-1] if self._separate_stats else reduced[self._stats_group][-2:]
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
