"""Batches loaded ahead, in worker processes, for the microbatches a replica is planned to
compute: `DatasetMicrobatches(..., num_workers=K, prefetch=N)`.

A replica knows its plan, so the input pipeline need not guess: when a plan arrives the
trainer names the microbatches it will compute (`Prefetcher.plan`), and the first N of
them are loaded by K forked processes while the replica computes. A key a new plan no
longer holds (a failure moved it elsewhere, a quota changed) is dropped; a batch asked for
that was not prefetched is loaded in line, as without workers. The batch is the same
either way: the same sample ids, fetched and collated by the same functions.

After the current step's microbatches the window runs on to the same microbatches of the
next step (its plan usually repeats); the commit's plan confirms or drops them.
"""

from __future__ import annotations

import multiprocessing
import os
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

from recover.common.lifetime import die_with_parent

Key = tuple[int, int]
"""(step, microbatch)."""

_load_fn: Callable[[list[int]], Any] | None = None
"""The worker process's loader, inherited through fork (never pickled)."""


def _init(load: Callable[[list[int]], Any], parent: int) -> None:
    global _load_fn
    _load_fn = load
    # A loader dies with its replica, SIGKILLed or not: nothing of a lost replica lingers.
    if not die_with_parent(parent):
        os._exit(0)


def _load(ids: list[int]) -> tuple[int, Any]:
    assert _load_fn is not None
    return os.getpid(), _load_fn(ids)


class Prefetcher:
    """Loads `depth` planned microbatches ahead in `workers` forked processes."""

    def __init__(self, load: Callable[[list[int]], Any], ids_of: Callable[[int, int], list[int]],
                 workers: int, depth: int) -> None:
        self._load = load
        self._ids_of = ids_of
        self._workers = workers
        self._depth = depth
        self._pool: Any = None
        self._ahead: dict[Key, Any] = {}
        """Key -> the worker's pending result (multiprocessing's AsyncResult)."""
        self._planned: list[Key] = []
        self.loaded_by: deque[tuple[Key, int]] = deque(maxlen=256)
        """Which process loaded each recent batch handed out (a worker's pid, or this one's)."""

    def _start(self) -> None:
        # Forked lazily, once the model is built: the workers share its pages, not its
        # threads (a fork copies only the calling thread), and run only the loader.
        context = multiprocessing.get_context("fork")
        self._pool = context.Pool(self._workers, initializer=_init,
                                  initargs=(self._load, os.getpid()))

    def plan(self, keys: Sequence[Key]) -> None:
        """The microbatches this replica will compute, in order: load the first `depth` of
        them; forget what no longer is."""
        self._planned = list(keys)
        wanted = set(self._planned[:self._depth])
        for key in [k for k in self._ahead if k not in wanted]:
            del self._ahead[key]  # a worker's result for it is simply never collected
        if self._pool is None:
            self._start()
        for key in self._planned[:self._depth]:
            if key not in self._ahead:
                self._ahead[key] = self._pool.apply_async(_load, (self._ids_of(*key),))

    def batch(self, step: int, microbatch: int) -> Any:
        key = (step, microbatch)
        pending = self._ahead.pop(key, None)
        if pending is None:
            batch, pid = self._load(self._ids_of(step, microbatch)), os.getpid()
        else:
            pid, batch = pending.get()
        self.loaded_by.append((key, pid))
        if key in self._planned:  # slide the window on past this one
            rest = self._planned[self._planned.index(key) + 1:]
            if self._pool is not None:
                self.plan(rest)
        return batch

    def close(self) -> None:
        if self._pool is not None:
            self._pool.terminate()
            self._pool = None
        self._ahead.clear()
