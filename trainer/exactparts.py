"""The exact accumulator's parts: each gradient bucket's scratch and sum, the pieces of the
largest one that are reduced during the step's last backward (overlap.py), and the peaks
of a committed mean that set the next step's scales."""

from __future__ import annotations

import math

import torch

from recover.trainer.fastreduce import Piece
from recover.trainer.gradients import Bucket
from recover.trainer.limbs import SMALL


class ExactBucket:
    """Per-bucket scratch of the exact accumulator, allocated once."""

    def __init__(self, bucket: Bucket, reduced: torch.Tensor, offset: int) -> None:
        self.bucket = bucket
        self.scale_dtype = torch.float64 if bucket.dtype == torch.float64 else torch.float32
        self.offset = offset
        """Where its sum lies in its device's reduce buffer."""
        self.sum = reduced[offset:offset + bucket.numel]
        self.scaled = torch.empty(bucket.numel, dtype=self.scale_dtype, device=bucket.device)
        # float64 needs no widening: it is already the accumulator's dtype.
        self.wide = None if self.scale_dtype == torch.float64 else torch.empty_like(self.sum)
        self.integer = bucket.integer and self.scale_dtype == torch.float64
        """Integer buffers' deltas (whole numbers in float64): summed as they are, unscaled.
        The scaled path multiplied them by 2**e (e >= 0 while their mean is below 2**43 / M**2) and
        divided by it at the end, both exact: the same bits, without four small ops a
        microbatch (issue 23). Only a delta too large for e >= 0 differs: it was rounded
        there and is summed exactly here."""
        self.peak_list = self.integer and bucket.numel <= SMALL
        """Its bound checked on a Python list: one op instead of three for a few counters."""
        self.scale = torch.empty(0)
        self.filled: list[int | None] = []
        """The exponent each tensor's range of `scale` holds (None: not filled yet)."""


def add_range(part: ExactBucket, start: int, end: int) -> None:
    """Round `part`'s scaled gradient in [start, end) and add it to its sum."""
    rounded = part.scaled[start:end].round_()
    if part.wide is None:
        part.sum[start:end].add_(rounded)
    else:
        # Widen first: an in-place float64 += float32 takes a slow mixed-type path (5x).
        part.sum[start:end].add_(part.wide[start:end].copy_(rounded))


def exact_pieces(parts: list[ExactBucket], piece_bytes: int) -> list[Piece]:
    """The exact sum's pieces: the end of its largest non-integer bucket, cut at parameter
    boundaries into ranges of at least `piece_bytes` of float64, the last parameters first;
    the first parameter stays with the rest."""
    devices = list(dict.fromkeys(part.bucket.device for part in parts))
    candidates = [i for i, part in enumerate(parts) if part.bucket.params and not part.integer]
    if piece_bytes <= 0 or not candidates:
        return []
    index = max(candidates, key=lambda i: parts[i].bucket.numel)
    bucket = parts[index].bucket
    starts = [0]
    for n in bucket.sizes[:-1]:
        starts.append(starts[-1] + n)
    group = devices.index(bucket.device)
    pieces, end, last = [], bucket.numel, len(bucket.params)
    for i in range(len(bucket.params) - 1, 0, -1):
        if (end - starts[i]) * 8 >= piece_bytes:
            offset = parts[index].offset
            pieces.append(Piece(group, offset + starts[i], offset + end, index, starts[i], end,
                                tuple(range(i, last))))
            end, last = starts[i], i
    return pieces


def peaks(mean: torch.Tensor, sizes: list[int]) -> list[float]:
    """Each tensor's max |x| in a bucket's committed mean (NaN where it is not finite)."""
    bounds, offset = [], 0
    for n in sizes:
        # |x| max as max(-min, max): one pass, no temporary |x| copy of the tensor.
        bounds.extend(torch.aminmax(mean[offset:offset + n]) if n else
                      (mean.new_zeros(()), mean.new_zeros(())))
        offset += n
    # On a GPU read at once: each read waits for the device, and for the work another
    # replica sharing it queued (at 50M parameters on one H200, 3.1 ms a step in one
    # process; the step's time outside compute and reduce 23 -> 11.5 ms in a job). On the
    # host a stack costs more than the reads.
    values = [float(v) for v in bounds] if mean.device.type != "cuda" or not bounds \
        else torch.stack(bounds).tolist()
    peaks = []
    for low, high in zip(values[0::2], values[1::2], strict=True):
        peak = max(-low, high)
        peaks.append(peak if math.isfinite(peak) else math.nan)
    return peaks
