"""A model's buffers inside the guarantee: per-microbatch updates, reduced like gradients.

Why this exists: forward writes buffers (BatchNorm's running statistics and counter, any
registered buffer) on the replica that computes a microbatch. Left alone, each replica's
buffers follow the microbatches *it* computed, and a failure, which changes who computes
which, changes them while every parameter stays bitwise equal: the eval of a model that
"recovered exactly" differs from the failure-free run's.

`buffers="reduce"` (the default) makes the committed buffers a function of the step's M
microbatches only:

- every microbatch's forward starts from the buffers committed after the previous step,
  whoever computes it and whatever it computed before (`restore` before each forward);
- its update is ``delta = buffers_after - buffers_before``, added into a flat bucket per
  (device, dtype) that the step's accumulator sums and reduces with the gradients: in exact
  mode through the same fixed point (so the sum does not depend on who computed what, nor
  on the order), in fast mode in floating point;
- on the commit every replica (and every joiner catching up) sets
  ``buffers = before + sum(deltas) / M``.

For BatchNorm with momentum m, ``mean_i(delta_i) = m * (mean_i(stat_i) - running)``: one
update with the mean of the microbatches' batch statistics (with ``momentum=None``, one
cumulative-average update with that mean). Integer buffers (held in float64, exact below
2**53) advance by ``round(sum / M)``, half to even: ``num_batches_tracked`` then counts
steps, as the statistics count one update per step.

What is in: persistent buffers (those `state_dict()` holds, so joins and checkpoints carry
them) of a floating or integer dtype. Non-persistent buffers and other dtypes (bool) stay
outside (a one-line warning names them): fine for constants, which is what they usually are.
`buffers="local"` keeps each replica's own buffers, outside the guarantee (warned once).
A model without buffers gets no `ModelBuffers` at all: not a tensor or a pass more.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from recover.trainer.errors import contract_error
from recover.trainer.gradients import Bucket, BucketSet, GradientBuckets

BUFFER_MODES = ("reduce", "local")
"""`train(buffers=...)`: reduce per-microbatch updates (the guarantee), or each replica's own."""
FLOAT_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
INT_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)
NAMES_SHOWN = 4
"""Buffers named in a warning before '... and N more'."""


@dataclass
class _Tracked:
    name: str
    module: torch.nn.Module
    key: str
    committed: torch.Tensor
    """The value committed after the last step: every forward starts from it."""
    live: torch.Tensor
    """What the model holds: a view of its group's live flat tensor."""
    aliases: tuple[tuple[torch.nn.Module, str], ...] = ()
    """Other modules that registered the same tensor (they hold the view too)."""

    def checked(self, tensor: torch.Tensor | None) -> torch.Tensor:
        """A module assigned a new tensor instead of updating in place: fine, if its layout
        is the one the buckets were built for."""
        if tensor is None or tensor.shape != self.committed.shape \
                or tensor.dtype != self.committed.dtype:
            raise contract_error(
                f"buffer {self.name} changed its shape or dtype during training (was "
                f"{tuple(self.committed.shape)} {self.committed.dtype}); ReCoVer reduces buffer "
                "updates, which needs a fixed layout: pass buffers='local' to train() to keep "
                "buffers outside the guarantee", where="buffers")
        return tensor

    def adopt(self) -> None:
        """Make the model hold `live` (again): its value is whatever the model holds now."""
        current = self.module._buffers[self.key]
        if current is not self.live:
            with torch.no_grad():  # a tensor computed from parameters must not enter a graph
                self.live.copy_(self.checked(current))
        for module, key in ((self.module, self.key), *self.aliases):
            module._buffers[key] = self.live


class _Group:
    """The buffers of one delta bucket, held by the model as views of one flat tensor of
    their dtype: a microbatch's capture is then three ops whatever their number. Right after
    a backward each op dispatched costs several microseconds, and flattening, subtracting,
    adding and copying back buffer by buffer took ~0.15 ms of the example ConvNet's 2.4 ms
    step (bench/scripts/buffers_micro.py)."""

    def __init__(self, members: list[tuple[str, torch.nn.Module, str, torch.Tensor]],
                 bucket: Bucket,
                 aliases: dict[int, list[tuple[torch.nn.Module, str]]] | None = None) -> None:
        self.bucket = bucket
        self.integer = members[0][3].dtype in INT_DTYPES
        with torch.no_grad():
            self.live_flat = torch.cat([t.detach().reshape(-1) for *_, t in members])
            """The model's buffers, one after the other, in their own dtype."""
            self.committed_flat = self.live_flat.to(bucket.dtype, copy=True)
            """The committed values in the bucket's dtype (integers exactly, in float64)."""
            self.committed_own = (self.live_flat.clone() if self.integer
                                  else self.committed_flat)
            """The committed values in the buffers' own dtype (what digests cover)."""
        self.delta = torch.empty_like(self.committed_flat)
        self.tracked: list[_Tracked] = []
        offset = 0
        for name, module, key, tensor in members:
            n, shape = tensor.numel(), tensor.shape
            self.tracked.append(_Tracked(
                name, module, key, self.committed_own[offset:offset + n].view(shape),
                self.live_flat[offset:offset + n].view(shape),
                tuple((aliases or {}).get(id(tensor), ()))))
            offset += n
        for t in self.tracked:
            t.adopt()
        self._held = [(t.module._buffers, t.key, t.live, t) for t in self.tracked]
        """Each buffer's module dict, key and view: what `_adopt_replaced` checks, every
        microbatch."""

    def _adopt_replaced(self) -> None:
        """A module may have assigned a new tensor instead of updating its own in place."""
        for held, key, live, t in self._held:
            if held[key] is not live:
                t.adopt()

    def restore(self) -> None:
        self._adopt_replaced()
        self.live_flat.copy_(self.committed_own)

    def capture(self) -> None:
        self._adopt_replaced()
        torch.sub(self.live_flat, self.committed_flat, out=self.delta)
        self.bucket.flat.add_(self.delta)
        self.live_flat.copy_(self.committed_own)  # restore

    def commit(self, mean: torch.Tensor) -> None:
        # A joiner's catch-up steps arrive from the wire on the host; the buffers may live on
        # a GPU (found by scripts/gpu_check.sh: a restarted BatchNorm replica's first step).
        if mean.device != self.committed_flat.device:
            mean = mean.to(self.committed_flat.device)
        if self.integer:  # round half to even: deterministic, and a counter's mean is whole
            self.committed_flat.add_(torch.round(mean))
            self.committed_own.copy_(self.committed_flat)
        else:  # cast first: add_ would add in the wider dtype, a different rounding
            dtype = self.committed_flat.dtype
            self.committed_flat.add_(mean if mean.dtype == dtype else mean.to(dtype))
        self._adopt_replaced()
        self.live_flat.copy_(self.committed_own)

    def recommit(self) -> None:
        self._adopt_replaced()
        self.committed_own.copy_(self.live_flat)
        if self.integer:
            self.committed_flat.copy_(self.committed_own)


class ModelBuffers:
    """The buffers in the guarantee, their committed values and their delta buckets.

    Invariant: outside a microbatch's compute the model holds the committed buffers
    (`capture` puts them back after each microbatch, `commit` and `recommit` set them, the
    executor calls `restore` after the user's callback): so every forward starts from them,
    and a donor's snapshot or a checkpoint, taken between microbatches, holds them."""

    def __init__(self, groups: list[_Group], order: list[str]) -> None:
        self._groups = groups
        self.buckets = [g.bucket for g in groups]
        """Each microbatch's delta is added here; the accumulator reduces them after the
        gradient buckets (`StepBuckets`), so a step's means are gradients, then buffers."""
        by_name = {t.name: t for g in groups for t in g.tracked}
        self._named = [(name, by_name[name].committed) for name in order]

    def named(self) -> list[tuple[str, torch.Tensor]]:
        """(name, committed value) in model order: what the step digest covers."""
        return self._named

    def restore(self) -> None:
        """Put the committed buffers back into the model (after user code ran a forward)."""
        with torch.no_grad():
            for group in self._groups:
                group.restore()

    def capture(self) -> None:
        """After a microbatch: add its delta into the buckets, then restore the committed values,
        so that the model between microbatches (what a donor snapshots) holds committed state."""
        # No no_grad(): buffers never require grad, so nothing here is recorded, and
        # entering it costs more than the ops after a backward (bench/scripts/buffers_micro.py).
        for group in self._groups:
            group.capture()

    def commit(self, means: Sequence[torch.Tensor]) -> None:
        """Apply a committed step's mean deltas (one tensor per bucket): before + sum / M."""
        if len(means) != len(self._groups):
            raise RuntimeError(f"a committed step carries {len(means)} buffer tensors, this "
                               f"model has {len(self._groups)} buffer buckets")
        with torch.no_grad():
            for group, mean in zip(self._groups, means, strict=True):
                group.commit(mean)

    def recommit(self) -> None:
        """The model's buffers were loaded (a join, a resume): they are the committed ones now."""
        with torch.no_grad():
            for group in self._groups:
                group.recommit()

    def zero(self) -> None:
        for bucket in self.buckets:
            bucket.flat.zero_()

    def describe(self) -> str:
        count = sum(t.numel() for _, t in self._named)
        return f"{len(self._named)} buffers ({count:,} values) reduced"


class StepBuckets:
    """What the accumulator reduces for a model with buffers: gradient buckets, then buffer
    delta buckets. Zeroed together, so each accumulator's reset and per-microbatch zeroing
    (exact mode quantizes each microbatch on its own) covers the deltas too."""

    def __init__(self, grads: GradientBuckets, buffers: ModelBuffers) -> None:
        self.buckets: list[Bucket] = [*grads.buckets, *buffers.buckets]

    def zero(self) -> None:
        for bucket in self.buckets:
            bucket.flat.zero_()


def reduced_buckets(grads: GradientBuckets, buffers: ModelBuffers | None) -> BucketSet:
    """The buckets a step reduces: the gradients alone for a model without buffers in the
    guarantee (exactly as before buffers were reduced), else gradients then buffers."""
    return grads if buffers is None else StepBuckets(grads, buffers)


def _names(names: list[str]) -> str:
    shown = ", ".join(names[:NAMES_SHOWN])
    return shown + (f" and {len(names) - NAMES_SHOWN} more" if len(names) > NAMES_SHOWN else "")


def model_buffers(model: torch.nn.Module, mode: str) -> tuple[ModelBuffers | None, str | None]:
    """The buffers `mode` puts in the guarantee (None: none) and a one-line warning naming
    the buffers it leaves out (None: none are)."""
    if mode not in BUFFER_MODES:
        raise ValueError(f"buffers must be one of {', '.join(map(repr, BUFFER_MODES))}, "
                         f"got {mode!r}")
    found: list[tuple[str, torch.nn.Module, str, torch.Tensor]] = []
    aliases: dict[int, list[tuple[torch.nn.Module, str]]] = {}
    for prefix, module in model.named_modules(remove_duplicate=False):
        for key, tensor in module._buffers.items():
            if tensor is None:
                continue
            if id(tensor) in aliases:  # registered twice: held, and kept, as one
                aliases[id(tensor)].append((module, key))
                continue
            aliases[id(tensor)] = []
            found.append((f"{prefix}.{key}" if prefix else key, module, key, tensor))
    if not found:
        return None, None
    if mode == "local":
        return None, (f"buffers='local': {len(found)} buffer(s) ({_names([f[0] for f in found])}) "
                      "are each replica's own and outside the guarantee: after a failure they "
                      "may differ from the failure-free run's, and digests and `recover verify` "
                      "do not cover them")
    outside: list[str] = []
    # Keyed by (device, the bucket's dtype, the buffers' dtype): float64 buffers and integer
    # ones (held in float64) share a bucket dtype but not a commit rule, and a group's
    # buffers are views of one tensor of their dtype.
    groups: dict[tuple[torch.device, torch.dtype, torch.dtype],
                 list[tuple[str, torch.nn.Module, str, torch.Tensor]]] = {}
    for name, module, key, tensor in found:
        if key in module._non_persistent_buffers_set:
            outside.append(f"{name} (non-persistent)")
        elif tensor.dtype in FLOAT_DTYPES:
            groups.setdefault((tensor.device, tensor.dtype, tensor.dtype), []).append(
                (name, module, key, tensor))
        elif tensor.dtype in INT_DTYPES:
            groups.setdefault((tensor.device, torch.float64, tensor.dtype), []).append(
                (name, module, key, tensor))
        else:
            outside.append(f"{name} ({str(tensor.dtype).removeprefix('torch.')})")
    warning = None
    if outside:
        warning = (f"{len(outside)} buffer(s) stay outside the guarantee (not reduced, digested "
                   f"or checked): {_names(outside)}; fine while forward never changes them")
    if not groups:
        return None, warning
    groups_built = []
    for (device, dtype, own_dtype), members in groups.items():
        size = sum(tensor.numel() for *_, tensor in members)
        bucket = Bucket(device, dtype, [], [tensor.numel() for *_, tensor in members],
                        torch.zeros(size, dtype=dtype, device=device),
                        integer=own_dtype in INT_DTYPES)
        groups_built.append(_Group(members, bucket, aliases))
    # The digest's order: the model's, not the buckets'.
    inside = {t.name for g in groups_built for t in g.tracked}
    return ModelBuffers(groups_built, [name for name, *_ in found if name in inside]), warning
