"""Every trainable parameter's ``.grad`` as a view into one flat buffer per (device, dtype).

Backward then writes straight into the buffers, and a reduction copies one
buffer per bucket instead of concatenating hundreds of tensors. Buckets keep
each gradient in its own dtype and on its own device (bf16 stays bf16, a CUDA
parameter's gradient stays on its GPU); a model with one dtype on one device
has exactly one bucket.

Autograd accumulates into an existing ``.grad`` in place (a sparse gradient,
from ``nn.Embedding(sparse=True)``, too: densely), so the views stay live; the
rare paths that replace ``.grad`` (double backward, user code that
assigns it) are caught after each microbatch and folded back into the bucket.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from recover.trainer.digest import local_part

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


class GradientLayoutError(ValueError):
    """The model has parameters whose gradients ReCoVer cannot reduce; the message says which."""


@dataclass
class Bucket:
    device: torch.device
    dtype: torch.dtype
    params: list[torch.nn.Parameter]
    sizes: list[int]
    flat: torch.Tensor
    pointers: list[int] = field(default_factory=list)
    """data_ptr() of each parameter's gradient view, to notice a replaced `.grad`."""
    integer: bool = False
    """It holds integer buffers' deltas (as float64 integers): a float reduction may carry
    them as exact digits (trainer/limbs.py)."""

    @property
    def numel(self) -> int:
        return self.flat.numel()


class BucketSet(Protocol):
    """What an accumulator sums and reduces: flat buckets it can zero. `GradientBuckets`, or
    for a model whose buffers are reduced too, those and the buffers' (buffers.StepBuckets)."""

    buckets: list[Bucket]

    def zero(self) -> None: ...


class GradientBuckets:
    def __init__(self, params: list[torch.nn.Parameter]) -> None:
        if not params:
            raise GradientLayoutError("the model has no trainable parameters "
                                      "(requires_grad=True): there is nothing to train")
        groups: dict[tuple[torch.device, torch.dtype], list[torch.nn.Parameter]] = {}
        for p in params:
            if p.dtype not in SUPPORTED_DTYPES:
                raise GradientLayoutError(f"a parameter of shape {tuple(p.shape)} has dtype "
                                          f"{p.dtype}; supported: float32, bfloat16, float16, float64")
            if p.layout is not torch.strided:
                raise GradientLayoutError(f"a parameter of shape {tuple(p.shape)} has layout "
                                          f"{p.layout}; only dense parameters are supported")
            groups.setdefault((p.device, p.dtype), []).append(p)
        self.buckets: list[Bucket] = []
        for (device, dtype), members in groups.items():
            sizes = [local_part(p).numel() for p in members]
            flat = torch.zeros(sum(sizes), dtype=dtype, device=device)
            bucket = Bucket(device, dtype, members, sizes, flat)
            offset = 0
            for p, n in zip(members, sizes, strict=True):
                p.grad = _grad_view(p, flat[offset:offset + n])
                bucket.pointers.append(local_part(p.grad).data_ptr())
                offset += n
            self.buckets.append(bucket)
        self.params = params

    def zero(self) -> None:
        for bucket in self.buckets:
            bucket.flat.zero_()

    def repair_views(self) -> None:
        """Fold any gradient that autograd or user code replaced back into its bucket."""
        for bucket in self.buckets:
            offset = 0
            for p, n, pointer in zip(bucket.params, bucket.sizes, bucket.pointers, strict=True):
                grad = p.grad
                if grad is None or local_part(grad).data_ptr() != pointer:
                    view = _grad_view(p, bucket.flat[offset:offset + n])
                    if grad is not None:
                        local_part(view).copy_(grad.to_dense() if grad.is_sparse
                                               else local_part(grad))
                    p.grad = view
                offset += n

    def load(self, means: list[torch.Tensor]) -> None:
        """Overwrite every bucket with a reduced gradient (one tensor per bucket)."""
        for bucket, mean in zip(self.buckets, means, strict=True):
            bucket.flat.copy_(mean)

    def describe(self) -> list[str]:
        """E.g. ['cpu float32 x 106,304'] for status and errors."""
        return [f"{b.device} {str(b.dtype).removeprefix('torch.')} x {b.numel:,}"
                for b in self.buckets]


def _grad_view(p: torch.nn.Parameter, flat: torch.Tensor) -> torch.Tensor:
    """`p`'s gradient as a view of `flat`: for a sharded (DTensor) parameter, a DTensor of
    the same placements over a view of this rank's shard. FSDP2 then adds each backward's
    reduce-scattered shard into it in place, as autograd does for a plain `.grad`."""
    local = local_part(p)
    if local is p:
        return flat.view_as(p)
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(flat.view_as(local), p.device_mesh, p.placements,  # type: ignore[attr-defined]
                              run_check=False, shape=p.shape, stride=p.stride())
