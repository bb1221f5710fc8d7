"""Microbatch sources: where the batch of microbatch ``i`` of step ``t`` comes from.

Whoever computes a microbatch must get the same batch, so a source is a pure
function of ``(step, microbatch)`` once bound to the job (its ``M`` and seed).
Two ready-made kinds: a user function the user promises is deterministic, and a
map-style dataset walked epoch by epoch by :class:`EpochSampler`. Each also
names the sample ids a microbatch consumes: that is what the step ledger
records and ``recover verify`` compares.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol, runtime_checkable

from torch.utils.data import default_collate

from recover.trainer.prefetch import Prefetcher
from recover.trainer.sampling import EpochSampler


@runtime_checkable
class MicrobatchSource(Protocol):
    """What the trainer asks of a source (implement it for a source of your own)."""

    def bind(self, global_microbatches: int, seed: int) -> None:
        """Called once before training with the job's M and seed."""

    def batch(self, step: int, microbatch: int) -> Any:
        """The batch of one microbatch: the same value every time it is asked for."""

    def sample_ids(self, step: int, microbatch: int) -> Sequence[int]:
        """Ids of the samples the microbatch consumes (for the ledger)."""

    @property
    def samples_per_microbatch(self) -> int | None:
        """Samples in each microbatch when fixed (for the summary), else None."""


class FunctionMicrobatches:
    """A user function ``(step, microbatch) -> batch`` that must be deterministic.

    The ledger records each microbatch as one id, ``step * M + microbatch``: it
    proves which microbatches a step summed; what is inside them is the
    function's promise (``recover run --check-determinism`` checks it).
    """

    def __init__(self, fn: Callable[[int, int], Any]) -> None:
        if not callable(fn):
            raise TypeError(f"FunctionMicrobatches needs a function (step, microbatch) -> batch, "
                            f"got {type(fn).__name__}")
        self.fn = fn
        self._m = 0

    def bind(self, global_microbatches: int, seed: int) -> None:
        self._m = global_microbatches

    def batch(self, step: int, microbatch: int) -> Any:
        return self.fn(step, microbatch)

    def sample_ids(self, step: int, microbatch: int) -> list[int]:
        return [step * self._m + microbatch]

    @property
    def samples_per_microbatch(self) -> int | None:
        return None


class DatasetMicrobatches:
    """``microbatch_size`` samples of a map-style dataset per microbatch, without
    replacement, epoch by epoch (see :class:`EpochSampler`), collated into a batch.

    ``dataset`` needs ``len()`` and ``dataset[i]`` (and may offer
    ``__getitems__(ids) -> list`` to fetch a microbatch in one call, as torch's
    DataLoader protocol has it); ``collate_fn`` turns a list of samples into a
    batch (torch's ``default_collate`` by default); ``seed`` overrides the job's
    seed for the shuffle; ``shuffle=False`` walks the dataset in order (for data
    that is already shuffled on disk). ``num_workers=K`` loads the batches of the
    microbatches this replica is planned to compute ahead, ``prefetch`` of them at a time,
    on K loader threads (trainer/prefetch.py); the batches are the same.
    """

    def __init__(self, dataset: Any, microbatch_size: int, *,
                 collate_fn: Callable[[list[Any]], Any] | None = None, shuffle: bool = True,
                 seed: int | None = None, num_workers: int = 0, prefetch: int = 4) -> None:
        if not (hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__")):
            raise TypeError(f"DatasetMicrobatches needs a map-style dataset (len() and "
                            f"dataset[i]), got {type(dataset).__name__}")
        if isinstance(microbatch_size, bool) or not isinstance(microbatch_size, int) \
                or microbatch_size < 1:
            raise ValueError(f"microbatch_size must be a whole number >= 1, got {microbatch_size!r}")
        for name, value, least in (("num_workers", num_workers, 0), ("prefetch", prefetch, 1)):
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(f"{name} must be a whole number >= {least}, got {value!r}")
        self.dataset = dataset
        self.microbatch_size = microbatch_size
        self.prefetcher = Prefetcher(self._fetch, self.sample_ids, num_workers, prefetch) \
            if num_workers else None
        self.collate_fn = collate_fn or default_collate
        self.shuffle = shuffle
        self.seed = seed
        self.sampler: EpochSampler | None = None

    def bind(self, global_microbatches: int, seed: int) -> None:
        self.sampler = EpochSampler(len(self.dataset), self.microbatch_size, global_microbatches,
                                    self.seed if self.seed is not None else seed,
                                    shuffle=self.shuffle)

    def _sampler(self) -> EpochSampler:
        if self.sampler is None:
            raise RuntimeError("DatasetMicrobatches used before bind()")
        return self.sampler

    def batch(self, step: int, microbatch: int) -> Any:
        if self.prefetcher is not None:
            return self.prefetcher.batch(step, microbatch)
        return self._fetch(self.sample_ids(step, microbatch))

    def load(self, step: int, microbatch: int) -> Any:
        """The batch, loaded here and now (what the determinism check compares)."""
        return self._fetch(self.sample_ids(step, microbatch))

    def _fetch(self, ids: list[int]) -> Any:
        # torch's batched-fetch protocol (DataLoader uses it too): one call for the
        # microbatch instead of one per sample, where the dataset offers it.
        fetch_many = getattr(self.dataset, "__getitems__", None)
        samples = fetch_many(ids) if fetch_many is not None else [self.dataset[i] for i in ids]
        return self.collate_fn(samples)

    def plan(self, keys: Sequence[tuple[int, int]]) -> None:
        """The (step, microbatch) this replica is planned to compute, in order (the trainer
        says so at each plan): loaded ahead with `num_workers`, ignored without."""
        if self.prefetcher is not None:
            self.prefetcher.plan(keys)

    def close(self) -> None:
        if self.prefetcher is not None:
            self.prefetcher.close()

    def sample_ids(self, step: int, microbatch: int) -> list[int]:
        return self._sampler().sample_ids(step, microbatch)

    @property
    def samples_per_microbatch(self) -> int | None:
        return self.microbatch_size


def as_source(microbatches: Any) -> MicrobatchSource:
    """Accept a source, or a plain function (wrapped); anything else is a usage error."""
    if isinstance(microbatches, MicrobatchSource):
        return microbatches
    if callable(microbatches):
        return FunctionMicrobatches(microbatches)
    if hasattr(microbatches, "__len__") and hasattr(microbatches, "__getitem__"):
        raise TypeError("microbatches= got a dataset; wrap it to say how many samples make a "
                        "microbatch: DatasetMicrobatches(dataset, microbatch_size=B)")
    if hasattr(microbatches, "dataset") and hasattr(microbatches, "batch_size"):
        # A DataLoader's order comes from its sampler and workers: after a failure no other
        # replica could compute the same microbatch again, so the M would not be the same.
        raise TypeError("microbatches= got a DataLoader, whose batches a failure cannot "
                        "replay; pass its dataset: DatasetMicrobatches(loader.dataset, "
                        "microbatch_size=B, collate_fn=loader.collate_fn)")
    if hasattr(microbatches, "__next__") or hasattr(microbatches, "__iter__"):
        raise TypeError(f"microbatches= got an iterator ({type(microbatches).__name__}), whose "
                        "batches a failure cannot replay; give a function (step, microbatch) -> "
                        "batch or DatasetMicrobatches(dataset, microbatch_size=B)")
    raise TypeError(f"microbatches= must be a function (step, microbatch) -> batch or a "
                    f"DatasetMicrobatches, got {type(microbatches).__name__}")
