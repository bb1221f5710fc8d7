"""Gradient accumulation and the buffer a step reduces: fast (float) or exact (fixed point).

Both keep every parameter's `.grad` as a view into one flat float32 buffer,
so backward writes straight into it and a reduction needs one copy, not a
concatenation.

Exact reduction (DESIGN.md "Determinism"): each microbatch's float32
gradient is turned into integer fixed point with a power-of-two scale per
tensor — the same on every replica — and summed exactly, so the reduced sum
does not depend on which replica computed which microbatch, on the number of
replicas, nor on the reduction order; dividing by M afterwards gives
bitwise-identical gradients.

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
(`scale_epoch`). Measured cost and rate: see benchmarks/README.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

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


@dataclass
class Reduced:
    """A reduction's result, divided and ready to apply."""

    grads: torch.Tensor
    """Flat float32 mean gradient over the reduced microbatches."""
    loss: float
    """Mean loss over the reduced microbatches."""
    microbatches: int
    overflow: int
    """Microbatches whose gradient did not fit the exact scale (exact mode; then redo)."""


class FlatGradients:
    """Points every parameter's `.grad` into one flat float32 buffer."""

    def __init__(self, params: list[torch.nn.Parameter]) -> None:
        self.params = params
        self.sizes = [p.numel() for p in params]
        self.flat = torch.zeros(sum(self.sizes), dtype=torch.float32)
        offset = 0
        for p, n in zip(params, self.sizes, strict=True):
            # Autograd accumulates in place into an existing .grad, so the views stay live.
            p.grad = self.flat[offset:offset + n].view_as(p)
            offset += n

    def zero(self) -> None:
        self.flat.zero_()

    def load(self, flat: torch.Tensor) -> None:
        self.flat.copy_(flat)


class FastAccumulator:
    """Float32 accumulation: backward sums microbatch gradients into `.grad` directly."""

    def __init__(self, grads: FlatGradients) -> None:
        self.grads = grads
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

    def buffer(self) -> torch.Tensor:
        """A copy to reduce: an interrupted allreduce leaves its buffer partially reduced."""
        tail = torch.tensor([self.loss_sum, float(self.count)], dtype=torch.float32)
        return torch.cat([self.grads.flat, tail])

    def finish(self, reduced: torch.Tensor) -> Reduced:
        count = int(round(float(reduced[-1])))
        divisor = max(count, 1)
        return Reduced(reduced[:-2].div_(divisor), float(reduced[-2]) / divisor, count, 0)

    def observe_committed(self, mean_grads: torch.Tensor) -> None:
        pass


class ExactAccumulator:
    """Fixed-point accumulation (integers held exactly in float64), power-of-two scale per tensor."""

    def __init__(self, grads: FlatGradients, global_microbatches: int) -> None:
        self.grads = grads
        self.global_microbatches = global_microbatches
        self._limit = 2.0 ** EXACT_BITS / global_microbatches
        # The first step has no previous gradient: assume a mean of 1.0 per tensor.
        self._base_exponents = [self._exponent(1.0)] * len(grads.sizes)
        self.scale_epoch = 0
        self._scale = self._scale_vector()
        self.acc = torch.zeros(grads.flat.numel(), dtype=torch.float64)
        self._scaled = torch.empty_like(grads.flat)
        self._wide = torch.empty_like(self.acc)
        self.loss_acc = 0
        self.count = 0
        self.overflow = 0

    def _exponent(self, mean_abs_max: float) -> int:
        bound = max(mean_abs_max, 1e-30) * self.global_microbatches * 2.0 ** HEADROOM_BITS
        exponent = math.floor(math.log2(self._limit / bound))
        return min(max(exponent, EXPONENT_RANGE[0]), EXPONENT_RANGE[1])

    def _exponents_now(self) -> list[int]:
        """Each tensor's scale exponent at the current epoch, clamped to float32's normal range
        (a lower scale would flush gradients to zero)."""
        return [max(e - EPOCH_STEP_BITS * self.scale_epoch, MIN_EXPONENT) for e in self._base_exponents]

    def _scale_vector(self) -> torch.Tensor:
        # float32 is enough: multiplying by a power of two only shifts the exponent,
        # so g * 2**e and its rounding are exact.
        parts = [torch.full((n,), 2.0 ** e, dtype=torch.float32)
                 for n, e in zip(self.grads.sizes, self._exponents_now(), strict=True)]
        return torch.cat(parts)

    def reset(self, scale_epoch: int = 0) -> None:
        if scale_epoch != self.scale_epoch:
            self.scale_epoch = scale_epoch
            self._scale = self._scale_vector()
        self.acc.zero_()
        self.grads.zero()
        self.loss_acc = 0
        self.count = 0
        self.overflow = 0

    def before_microbatch(self) -> None:
        self.grads.zero()  # each microbatch's gradient is quantized on its own

    def after_microbatch(self, loss: float) -> None:
        # Preallocated buffers: this runs once per microbatch on the whole model.
        scaled = torch.mul(self.grads.flat, self._scale, out=self._scaled)
        low, high = torch.aminmax(scaled)  # one pass; vector_norm(inf) was 20x slower here
        # Written so that a NaN in either bound fails the test: NaN/inf count as overflow.
        if not (-self._limit < float(low) and float(high) < self._limit):
            self.overflow += 1
        else:
            # Widen first: an in-place float64 += float32 takes a slow mixed-type path (5x).
            self._wide.copy_(scaled.round_())
            self.acc.add_(self._wide)
        self.loss_acc += round(loss * 2.0 ** LOSS_SCALE_BITS)
        self.count += 1

    def buffer(self) -> torch.Tensor:
        tail = torch.tensor([self.loss_acc, self.count, self.overflow], dtype=torch.float64)
        return torch.cat([self.acc, tail])

    def finish(self, reduced: torch.Tensor) -> Reduced:
        loss_acc, count, overflow = (int(v) for v in reduced[-3:])
        divisor = max(count, 1)
        # Any fixed function of the (bitwise-identical) integer sum keeps runs identical;
        # this one is the cheapest measured (float64 division passes cost 4x): one
        # conversion to float32, an exact power-of-two rescale per tensor, one division.
        mean = reduced[:-3].float()
        offset = 0
        for n, e in zip(self.grads.sizes, self._exponents_now(), strict=True):
            mean[offset:offset + n].mul_(2.0 ** -e)
            offset += n
        mean.div_(divisor)
        return Reduced(mean, loss_acc / 2.0 ** LOSS_SCALE_BITS / divisor, count, overflow)

    def observe_committed(self, mean_grads: torch.Tensor) -> None:
        """Predict the next step's scales from this step's (replica-independent) mean gradient."""
        exponents = []
        offset = 0
        for n, previous in zip(self.grads.sizes, self._base_exponents, strict=True):
            peak = float(mean_grads[offset:offset + n].abs().max()) if n else 0.0
            # A non-finite peak has no meaningful scale: keep the previous prediction.
            exponents.append(self._exponent(peak) if math.isfinite(peak) else previous)
            offset += n
        self._base_exponents = exponents
        self.scale_epoch = 0
        self._scale = self._scale_vector()


Accumulator = FastAccumulator | ExactAccumulator


def make_accumulator(mode: str, grads: FlatGradients, global_microbatches: int) -> Accumulator:
    if mode == "exact":
        return ExactAccumulator(grads, global_microbatches)
    if mode in ("fast", ""):
        return FastAccumulator(grads)
    raise ValueError(f"unknown reduce mode {mode!r} (fast, exact)")
