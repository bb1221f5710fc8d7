"""Batches loaded ahead, on loader threads, for the microbatches a replica is planned to
compute: `DatasetMicrobatches(..., num_workers=K, prefetch=N)`.

A replica knows its plan, so the input pipeline need not guess: when a plan arrives the
trainer names the microbatches it will compute (`Prefetcher.plan`), and the first N of
them are loaded by K threads while the replica computes. A key a new plan no longer holds
(a failure moved it elsewhere, a quota changed) is dropped; a batch asked for that was not
prefetched is loaded in line, as without loaders. The batch is the same either way: the
same sample ids, fetched and collated by the same functions.

Threads, not processes: a worker process holds gRPC channels and threads of its own, and a
fork of such a process can deadlock in the child (the suite saw one); spawning instead
would re-run the user's training script in every child (it has no `__main__` guard). So
loading overlaps what waits (storage, network, decoders that release the GIL, torch ops);
pure-Python decoding still holds the GIL. The dataset is read from K threads at once.

After the current step's microbatches the window runs on to the same microbatches of the
next step (its plan usually repeats); the commit's plan confirms or drops them.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

Key = tuple[int, int]
"""(step, microbatch)."""


class Prefetcher:
    """Loads `depth` planned microbatches ahead on `workers` threads."""

    def __init__(self, load: Callable[[list[int]], Any], ids_of: Callable[[int, int], list[int]],
                 workers: int, depth: int) -> None:
        self._load = load
        self._ids_of = ids_of
        self._depth = depth
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="recover-loader")
        self._ahead: dict[Key, Future[tuple[str, Any]]] = {}
        self._planned: list[Key] = []
        self.loaded_by: deque[tuple[Key, str]] = deque(maxlen=256)
        """Which thread loaded each recent batch handed out (a `recover-loader` one, or the
        caller's)."""

    def _loaded(self, ids: list[int]) -> tuple[str, Any]:
        return threading.current_thread().name, self._load(ids)

    def plan(self, keys: Sequence[Key]) -> None:
        """The microbatches this replica will compute, in order: load the first `depth` of
        them; forget what no longer is."""
        self._planned = list(keys)
        wanted = set(self._planned[:self._depth])
        for key in [k for k in self._ahead if k not in wanted]:
            self._ahead.pop(key).cancel()  # or finishes unread: nothing waits for it
        for key in self._planned[:self._depth]:
            if key not in self._ahead:
                self._ahead[key] = self._pool.submit(self._loaded, self._ids_of(*key))

    def batch(self, step: int, microbatch: int) -> Any:
        key = (step, microbatch)
        pending = self._ahead.pop(key, None)
        loader, batch = pending.result() if pending is not None else \
            self._loaded(self._ids_of(step, microbatch))
        self.loaded_by.append((key, loader))
        if key in self._planned:  # slide the window on past this one
            self.plan(self._planned[self._planned.index(key) + 1:])
        return batch

    def close(self) -> None:
        for pending in self._ahead.values():
            pending.cancel()
        self._ahead.clear()
        self._pool.shutdown(wait=False, cancel_futures=True)
