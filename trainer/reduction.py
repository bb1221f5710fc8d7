"""Gradient accumulation and the buffers a step reduces: exact (fixed point) here, fast
(float) in trainer/fastreduce.py; `make_accumulator` picks one.

Both work on :class:`GradientBuckets` (one flat gradient buffer per device and
dtype; for a model whose buffers are reduced, followed by its buffer-delta buckets,
buffers.py, summed, scaled and divided exactly like gradients); the step's statistics
(loss sum, microbatch count, overflow count) ride at the end of the last buffer whenever
its dtype holds them exactly, so a one-dtype model does one allreduce per step.

Exact reduction (DESIGN.md "Determinism"): each microbatch's gradient is
turned into integer fixed point with a power-of-two scale per tensor — the
same on every replica — and summed exactly, so the reduced sum does not
depend on which replica computed which microbatch, on the number of
replicas, nor on the reduction order; dividing by M afterwards gives
bitwise-identical gradients. float32, bfloat16 and float16 gradients are
scaled in float32 (which holds the narrower two exactly), float64 ones in
float64; the mean is rounded back to the parameter's dtype once, the same
way everywhere.

The integers are held in float64 rather than int64: every quantized value
is kept below 2**53 / M, so every partial sum of at most M of them is an
integer below 2**53, which float64 represents exactly — addition is then
exact and associative in any order, in the accumulation and in gloo's
allreduce alike. That saves the int64 conversion pass per microbatch
(measured: ~40% of the exact path's cost) at the price of 9 bits of range,
which still leaves ~35 bits of resolution at M=16 (float32 has 24).

How the scale is agreed, without an extra collective: it is *predicted*
from the previous committed step's reduced gradient (bitwise equal on every
replica by induction), with headroom. Each microbatch whose scaled gradient
would not fit is counted in an overflow slot of the same buffer; a
nonzero global count makes the controller redo the step at a lower scale
(`scale_epoch`). Measured cost and rate: see bench/README.md.
"""

from __future__ import annotations

import math
from typing import Any, TypeAlias

import torch

from recover.trainer.exactparts import ExactBucket, add_range, exact_pieces, peaks
from recover.trainer.fastreduce import REDUCE_DTYPES, FastAccumulator, Piece, Reduced
from recover.trainer.gradients import BucketSet

EXACT_BITS = 53
"""float64 holds every integer below 2**53 exactly: the reduced sum must stay below it."""
HEADROOM_BITS = 10
"""A microbatch's gradient may grow to 2**10 x (M x the previous step's mean) before it overflows."""
EPOCH_STEP_BITS = 16
"""Each redo lowers every tensor's scale by 2**16."""
LOSS_SCALE_BITS = 32
"""Fixed-point scale of the per-microbatch loss (losses are O(1..10); M up to 2**16)."""
EXPONENT_RANGE = (-60, 120)
"""Bounds of a predicted per-tensor scale exponent."""
MIN_EXPONENT = -126
"""Smallest scale exponent after redos (float32's smallest normal power of two)."""
"""Fast mode: reduce in each gradient's own dtype, or in (at least) float32."""


class ExactAccumulator:
    """Fixed-point accumulation (integers held exactly in float64), power-of-two scale per tensor."""

    STATS = 4  # loss (fixed point), microbatch count, overflow count, non-finite count

    def __init__(self, grads: BucketSet, global_microbatches: int,
                 loss_scaled_buckets: int = 0, loss_scale: float = 1.0,
                 piece_bytes: int = 0) -> None:
        self.grads = grads
        self.global_microbatches = global_microbatches
        self._loss_scaled = loss_scaled_buckets
        """The leading buckets that hold a loss-scaled gradient (lossscale.py): a microbatch
        whose gradient there is not finite does not count as an overflow (no redo would make
        it fit) but makes the step's mean there NaN, the same on every replica, as a float
        sum would be: the step is then skipped and the loss scale backs off."""
        self._limit = 2.0 ** EXACT_BITS / global_microbatches
        self._loss_limit = self._limit / 2.0 ** LOSS_SCALE_BITS  # the loss is fixed point too
        # One float64 buffer per device holds every bucket's sum (the statistics at the end
        # of the last one): one allreduce per step, where a model whose buffers are reduced
        # has two or three buckets (measured: each allreduce more cost ~1.5 ms of a 9 ms step).
        sizes: dict[torch.device, int] = {}
        for b in grads.buckets:
            sizes[b.device] = sizes.get(b.device, 0) + b.numel
        last = list(sizes)[-1]
        self._reduced = {d: torch.zeros(n + (self.STATS if d == last else 0), dtype=torch.float64,
                                        device=d) for d, n in sizes.items()}
        self._stats = self._reduced[last][sizes[last]:]
        offsets = dict.fromkeys(sizes, 0)
        self._parts = []
        for b in grads.buckets:
            self._parts.append(ExactBucket(b, self._reduced[b.device], offsets[b.device]))
            offsets[b.device] += b.numel
        # The first step has no previous gradient: assume a mean of 1.0 per tensor (times
        # the loss scale where the gradient is scaled).
        self._base_exponents = [[self._exponent(loss_scale if i < loss_scaled_buckets else 1.0)]
                                * len(b.sizes) for i, b in enumerate(grads.buckets)]
        self.scale_epoch = 0
        self._rescale()
        self.loss_acc = 0
        self.count = 0
        self.overflow = 0
        self.nonfinite = 0
        self.pieces: list[Piece] = exact_pieces(self._parts, piece_bytes) \
            if loss_scaled_buckets == 0 else []
        """Ranges of the largest bucket's sum reduced first, by a collective each (overlap.py
        starts them in the last backward). None with loss scaling (its rule needs the whole)."""
        self._deferred = False
        """The current microbatch is hooked: its pieces are quantized as backward completes
        them (`piece_ready`), the rest by `after_microbatch`."""
        self._pieces_done: set[int] = set()
        self._piece_fits: list[torch.Tensor] = []
        """Per piece of the deferred microbatch: did it fit (a 0-d bool where the bucket lives)?
        Read once, after the microbatch: a read per piece would stop backward's thread on a
        GPU until the device caught up, every piece."""
        self._cut = {self._parts[p.bucket]: min(q.bucket_start for q in self.pieces
                                                if q.bucket == p.bucket) for p in self.pieces}
        """The split bucket -> where its pieces begin: a deferred microbatch adds its head."""

    def _exponent(self, mean_abs_max: float) -> int:
        bound = max(mean_abs_max, 1e-30) * self.global_microbatches * 2.0 ** HEADROOM_BITS
        exponent = math.floor(math.log2(self._limit / bound))
        return min(max(exponent, EXPONENT_RANGE[0]), EXPONENT_RANGE[1])

    def _exponents_now(self, base: list[int]) -> list[int]:
        """Each tensor's scale exponent at the current epoch, clamped to float32's normal range
        (a lower scale would flush gradients to zero)."""
        return [max(e - EPOCH_STEP_BITS * self.scale_epoch, MIN_EXPONENT) for e in base]

    def _rescale(self) -> None:
        for part, base in zip(self._parts, self._base_exponents, strict=True):
            # Multiplying by a power of two only shifts the exponent, so g * 2**e and
            # its rounding are exact in the scale dtype. Filled where the bucket lives:
            # building it on the host and copying it over cost a bucket-sized transfer
            # every step (a suspect of exact mode's 0.3 s per step at 50M parameters on a
            # GPU), and a fill in place is also faster on the CPU than pieces and a cat.
            # Only the tensors whose exponent changed: most keep theirs from step to step,
            # and each fill is an op (a few microseconds on a small tensor).
            if part.integer:
                continue  # never scaled
            exponents = self._exponents_now(base)
            if len(part.filled) != len(exponents):  # the first time
                part.scale = torch.empty(part.bucket.numel, dtype=part.scale_dtype,
                                         device=part.bucket.device)
                part.filled = [None] * len(exponents)
            offset = 0
            for index, (n, e) in enumerate(zip(part.bucket.sizes, exponents, strict=True)):
                if part.filled[index] != e:
                    part.scale[offset:offset + n].fill_(2.0 ** e)
                    part.filled[index] = e
                offset += n

    def reset(self, scale_epoch: int = 0) -> None:
        if scale_epoch != self.scale_epoch:
            self.scale_epoch = scale_epoch
            self._rescale()
        for buffer in self._reduced.values():
            buffer.zero_()
        self.grads.zero()
        self.loss_acc = 0
        self.count = 0
        self.overflow = 0
        self.nonfinite = 0

    def before_microbatch(self) -> None:
        self.grads.zero()  # each microbatch's gradient is quantized on its own
        self._deferred, self._pieces_done, self._piece_fits = False, set(), []

    def defer_pieces(self) -> None:
        """The coming microbatch is the step's last and hooked (overlap.py): its pieces are
        quantized and added as backward completes them, to be reduced meanwhile (the same ops
        on the same elements: the same integers). A piece that does not fit makes the
        microbatch an overflow: the step is redone and its sums discarded (the piece is added
        all the same: whether it fits is known only after the microbatch)."""
        self._deferred = True

    def piece_ready(self, index: int) -> None:
        """Backward completed piece `index` of a deferred microbatch: quantize and add it."""
        if not self._deferred or index in self._pieces_done:
            return
        self._pieces_done.add(index)
        piece = self.pieces[index]
        part = self._parts[piece.bucket]
        self._piece_fits.append(self._scaled_fit(part, piece.bucket_start, piece.bucket_end))
        add_range(part, piece.bucket_start, piece.bucket_end)

    def after_microbatch(self, loss: float) -> None:
        if self._deferred:
            self._after_deferred(loss)
            return
        # Preallocated buffers: this runs once per microbatch on the whole model.
        # A non-finite or huge loss (a diverged model) counts as overflow like a
        # non-finite gradient: the step is redone, then fails saying so.
        loss_fits = abs(loss) < self._loss_limit  # False for NaN too
        misfit = self._misfit(0) if loss_fits else 0
        # A finite gradient may still overflow once scaled: only the raw one says it is not.
        if loss_fits and misfit is not None and misfit < self._loss_scaled and not bool(
                torch.isfinite(self._parts[misfit].bucket.flat).all()):
            # Loss scaling skips this step; its buffers' updates are summed as in any step.
            self.nonfinite += 1
            if self._misfit(self._loss_scaled) is None:
                self._add(self._parts[self._loss_scaled:])
            else:
                self.overflow += 1
        elif misfit is None:
            self._add(self._parts)
        else:
            self.overflow += 1
        if loss_fits:
            self.loss_acc += round(loss * 2.0 ** LOSS_SCALE_BITS)
        self.count += 1

    def _after_deferred(self, loss: float) -> None:
        """`after_microbatch` of a hooked microbatch: the pieces backward did not reach, then
        everything outside them, each added only if the whole microbatch fits (loss scaling,
        whose rule needs the whole gradient, has no pieces)."""
        for index in range(len(self.pieces)):
            self.piece_ready(index)
        loss_fits = abs(loss) < self._loss_limit
        pieces_fit = bool(torch.stack(self._piece_fits).all()) if self._piece_fits else True
        fits = loss_fits and pieces_fit and self._misfit(0, self._cut) is None
        if fits:
            self._add(self._parts, self._cut)
        else:
            self.overflow += 1
        if loss_fits:
            self.loss_acc += round(loss * 2.0 ** LOSS_SCALE_BITS)
        self.count += 1
        self._deferred = False

    def _misfit(self, start: int, cut: dict[ExactBucket, int] | None = None) -> int | None:
        """The index of the first part from `start` whose gradient does not fit its scale,
        None when all fit; each part's scaled gradient is left in its `scaled` buffer."""
        for index in range(start, len(self._parts)):
            part = self._parts[index]
            n = (cut or {}).get(part)
            if n is not None:  # a bucket whose end went in pieces: its head only
                if not bool(self._scaled_fit(part, 0, n)):
                    return index
                continue
            if part.peak_list:
                # Whole numbers (or a NaN/inf, which fails the test): the sum of every
                # microbatch's stays below 2**53 when each is below the limit.
                if not all(-self._limit < v < self._limit for v in part.bucket.flat.tolist()):
                    return index
                continue
            scaled = part.bucket.flat if part.integer else torch.mul(
                part.bucket.flat, part.scale, out=part.scaled)
            low, high = torch.aminmax(scaled)  # one pass; vector_norm(inf) was 20x slower here
            # Written so that a NaN in either bound fails the test: NaN/inf count as overflow.
            if not (-self._limit < float(low) and float(high) < self._limit):
                return index
        return None

    def _scaled_fit(self, part: ExactBucket, start: int, end: int) -> torch.Tensor:
        """Scale `part`'s gradient in [start, end) into its `scaled` buffer; does it fit? (A
        0-d bool where the bucket lives: reading it waits for the device.)"""
        scaled = torch.mul(part.bucket.flat[start:end], part.scale[start:end],
                           out=part.scaled[start:end])
        low, high = torch.aminmax(scaled)
        return (low > -self._limit) & (high < self._limit)  # NaN fails too

    @staticmethod
    def _add(parts: list[ExactBucket], cut: dict[ExactBucket, int] | None = None) -> None:
        for part in parts:
            if part.integer:
                part.sum.add_(part.bucket.flat)  # whole numbers: nothing to round
                continue
            add_range(part, 0, (cut or {}).get(part, part.bucket.numel))

    def buffers(self) -> list[torch.Tensor]:
        self._stats.copy_(torch.tensor(
            [self.loss_acc, self.count, self.overflow, self.nonfinite], dtype=torch.float64))
        return [buffer.clone() for buffer in self._reduced.values()]

    @property
    def _devices(self) -> list[torch.device]:
        return list(self._reduced)

    def new_buffers(self) -> list[torch.Tensor]:
        """The reduce buffers, not yet filled (`fill_piece`, `fill_rest`)."""
        return [torch.empty_like(buffer) for buffer in self._reduced.values()]

    def fill_piece(self, out: list[torch.Tensor], piece: Piece) -> None:
        """Copy a piece of the sum (its microbatch quantized and added: `piece_ready`)."""
        source = self._reduced[self._devices[piece.group]]
        out[piece.group][piece.start:piece.end].copy_(source[piece.start:piece.end])

    def fill_rest(self, out: list[torch.Tensor]) -> None:
        """Copy everything the pieces do not hold: the other sums and the statistics."""
        self._stats.copy_(torch.tensor(
            [self.loss_acc, self.count, self.overflow, self.nonfinite], dtype=torch.float64))
        for group, buffer in enumerate(self._reduced.values()):
            for start, end in self._rest(group, buffer.numel()):
                out[group][start:end].copy_(buffer[start:end])

    def _rest(self, group: int, size: int) -> list[tuple[int, int]]:
        """The ranges of buffer `group` outside the pieces (one run of them), in order."""
        spans = sorted((p.start, p.end) for p in self.pieces if p.group == group)
        if not spans:
            return [(0, size)]
        return [(0, spans[0][0]), (spans[-1][1], size)]

    def schedule(self, out: list[torch.Tensor]) -> list[torch.Tensor]:
        """What each collective reduces, in the order every member issues them: the pieces,
        then what is left of each buffer (two ranges around the pieces where it has some)."""
        pieces = [out[p.group][p.start:p.end] for p in self.pieces]
        rest = [out[group][start:end] for group, buffer in enumerate(out)
                for start, end in self._rest(group, buffer.numel()) if end > start]
        return pieces + rest

    def finish(self, reduced: list[torch.Tensor]) -> Reduced:
        loss_acc, count, overflow, nonfinite = (int(v) for v in reduced[-1][-self.STATS:])
        divisor = max(count, 1)
        means: list[torch.Tensor] = []
        by_device = dict(zip(self._reduced, reduced, strict=True))
        for part, base in zip(self._parts, self._base_exponents, strict=True):
            # Any fixed function of the (bitwise-identical) integer sum keeps runs identical;
            # this one is the cheapest measured (float64 division passes cost 4x): one
            # conversion, an exact power-of-two rescale per tensor, one division.
            buffer = by_device[part.bucket.device]
            mean = buffer[part.offset:part.offset + part.bucket.numel].to(part.scale_dtype)
            if not part.integer:  # an integer part is not scaled
                offset = 0
                for n, e in zip(part.bucket.sizes, self._exponents_now(base), strict=True):
                    mean[offset:offset + n].mul_(2.0 ** -e)
                    offset += n
            mean.div_(divisor)
            if nonfinite and len(means) < self._loss_scaled:
                mean.fill_(math.nan)
            means.append(mean if mean.dtype == part.bucket.dtype else mean.to(part.bucket.dtype))
        return Reduced(means, loss_acc / 2.0 ** LOSS_SCALE_BITS / divisor, count, overflow)

    def observe_committed(self, means: list[torch.Tensor]) -> None:
        """Predict the next step's scales from this step's (replica-independent) mean gradient."""
        predicted = []
        for part, mean, previous in zip(self._parts, means, self._base_exponents, strict=True):
            if part.integer:  # never scaled: nothing to predict
                predicted.append(previous)
                continue
            exponents = []
            for peak, before in zip(peaks(mean, part.bucket.sizes), previous, strict=True):
                # A non-finite peak has no meaningful scale: keep the previous prediction.
                exponents.append(self._exponent(peak) if math.isfinite(peak) else before)
            predicted.append(exponents)
        self._base_exponents = predicted
        self.scale_epoch = 0
        self._rescale()

    def loss_scale_changed(self, factor: float) -> None:
        """The loss scale was multiplied by `factor` after the committed step: so are the
        next step's loss-scaled gradients, and their predicted fixed-point scales follow
        (a step skipped for a non-finite gradient predicted nothing new)."""
        shift = round(math.log2(factor))
        if not shift:
            return
        for exponents in self._base_exponents[:self._loss_scaled]:
            exponents[:] = [min(max(e - shift, EXPONENT_RANGE[0]), EXPONENT_RANGE[1])
                            for e in exponents]
        self._rescale()

    def state_dict(self) -> dict[str, Any]:
        """The predicted scales: what a joining replica needs to reduce like the others. (A
        step's redo epoch is not state: every step starts at epoch 0, a plan says otherwise.)"""
        return {"base_exponents": [list(e) for e in self._base_exponents]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        shape = [len(e) for e in self._base_exponents]
        exponents = [list(map(int, e)) for e in state["base_exponents"]]
        if [len(e) for e in exponents] != shape:
            raise ValueError(f"exact-reduction state for buckets of {[len(e) for e in exponents]} "
                             f"tensors, this model has {shape}")
        self._base_exponents = exponents
        self.scale_epoch = 0
        self._rescale()


Accumulator: TypeAlias = FastAccumulator | ExactAccumulator


def make_accumulator(mode: str, grads: BucketSet, global_microbatches: int,
                     reduce_dtype: str = "grad", loss_scaled_buckets: int = 0,
                     loss_scale: float = 1.0, piece_bytes: int = 0) -> Accumulator:
    """`loss_scaled_buckets` (at `loss_scale` at first): see ExactAccumulator (a float sum
    needs nothing: it simply is not finite). `piece_bytes`: fast mode's pieces
    (FastAccumulator)."""
    if mode == "exact":
        return ExactAccumulator(grads, global_microbatches, loss_scaled_buckets, loss_scale,
                                piece_bytes)
    if mode in ("fast", ""):
        return FastAccumulator(grads, reduce_dtype or "grad", piece_bytes)
    raise ValueError(f"unknown reduce mode {mode!r} (fast, exact)")


__all__ = ["REDUCE_DTYPES", "Accumulator", "ExactAccumulator", "FastAccumulator", "Reduced",
           "make_accumulator"]
