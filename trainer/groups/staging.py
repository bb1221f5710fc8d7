"""Host staging for device buffers reduced by a host-only backend (gloo).

The gradient buckets stay on the model's device (trainer/gradients.py), but gloo reduces
host memory only. So a device buffer is copied once into a host tensor, reduced there and
copied back once. The host tensor is pinned when the buffer is on a CUDA device, so both
copies are DMA transfers that need no extra bounce buffer, and it is cached by shape and
dtype: the buckets have the same shapes every step, and pinning memory is expensive
(a cudaHostAlloc per step would cost more than the copy).

Run on one H100 (scripts/gpu_check.sh, BENCHMARKS.md section 13); without a GPU the same
code runs with `force=True`, which stages a CPU buffer exactly as it would a device one.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable

import torch

_Key = tuple[tuple[int, ...], torch.dtype, bool]
"""Shape, dtype, pinned."""

MAX_CACHED = 8
"""Staging tensors kept: a model has one bucket per (device, dtype), so a handful at most;
the bound only stops a caller with ever-changing shapes from growing it without end."""


def needs_staging(buffer: torch.Tensor) -> bool:
    """Whether a host-only backend must stage `buffer` (it lives on some device)."""
    return buffer.device.type != "cpu"


def _synchronize(device: torch.device) -> None:
    """Wait until the copies queued on `device`'s current stream are done (CUDA copies are
    asynchronous with non_blocking; other device types copied synchronously)."""
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


class HostStaging:
    """A cache of host tensors that device buffers are reduced through.

    A tensor is taken out of the cache while a reduction uses it and put back after, so
    two groups reducing at once (never the case with one group per process, but cheap to
    rule out) never share one. After a failed reduction it is dropped instead: the failed
    collective's last writes to it are nobody's business.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._cache: OrderedDict[_Key, torch.Tensor] = OrderedDict()

    def __len__(self) -> int:
        return len(self._cache)

    def _take(self, buffer: torch.Tensor) -> tuple[_Key, torch.Tensor]:
        pin = buffer.device.type == "cuda"
        key = (tuple(buffer.shape), buffer.dtype, pin)
        with self._lock:
            host = self._cache.pop(key, None)
        if host is None:
            host = torch.empty(buffer.shape, dtype=buffer.dtype, pin_memory=pin)
        return key, host

    def _give_back(self, key: _Key, host: torch.Tensor) -> None:
        with self._lock:
            self._cache[key] = host
            while len(self._cache) > MAX_CACHED:
                self._cache.popitem(last=False)

    def reduce(self, buffer: torch.Tensor, reduce_host: Callable[[torch.Tensor], None]) -> None:
        """Copy `buffer` to host, `reduce_host` it there, copy the result back.

        If `reduce_host` raises, `buffer` is left as it was (the host copy held the
        partial result), which is at least as safe as an in-place failure.
        """
        key, host = self._take(buffer)
        pinned = key[2]  # pinned host memory: both copies may be asynchronous
        # The buffer was produced on the current stream: the copy is queued behind it, and
        # the synchronize makes its bytes visible to the host before gloo reads them.
        host.copy_(buffer, non_blocking=pinned)
        _synchronize(buffer.device)
        reduce_host(host)
        buffer.copy_(host, non_blocking=pinned)
        # Also wait for the copy back: the host tensor is reused by the next reduce, and the
        # caller may read `buffer` from another stream or the host right away.
        _synchronize(buffer.device)
        self._give_back(key, host)

    def clear(self) -> None:
        with self._lock:
            self._cache.clear()


_SHARED = HostStaging()


def shared_staging() -> HostStaging:
    """The process's staging cache: groups are rebuilt every generation, their buffers'
    shapes are not, so the pinned tensors outlive any one group."""
    return _SHARED


def staged_reduce(buffer: torch.Tensor, reduce_host: Callable[[torch.Tensor], None],
                  staging: HostStaging | None = None, force: bool = False) -> None:
    """Reduce `buffer` with a host-only `reduce_host`: in place when it is a host tensor,
    through a host copy when it lives on a device (or when `force`, to test that path)."""
    if not (force or needs_staging(buffer)):
        reduce_host(buffer)
        return
    (staging if staging is not None else _SHARED).reduce(buffer, reduce_host)
