"""Batches loaded ahead on loader threads (trainer/prefetch.py via DatasetMicrobatches's
num_workers): the same batches, loaded where the plan says, dropped when it changes; and
the determinism check's comparison of two loads of one batch."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
import torch

from recover.trainer.determinism import batch_digest, check_batch
from recover.trainer.errors import WorkloadError
from recover.trainer.sources import DatasetMicrobatches, FunctionMicrobatches


class Squares:
    def __len__(self) -> int:
        return 40

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"x": torch.tensor([float(i)]), "y": torch.tensor([float(i * i)])}


def source(**options: int) -> DatasetMicrobatches:
    made = DatasetMicrobatches(Squares(), 3, **options)
    made.bind(4, seed=11)
    return made


def loaders(ahead: DatasetMicrobatches) -> dict[tuple[int, int], str]:
    """Which thread loaded each batch handed out."""
    assert ahead.prefetcher is not None
    return dict(ahead.prefetcher.loaded_by)


HERE = threading.current_thread().name


def test_planned_batches_come_from_the_workers_and_equal_loading_in_line() -> None:
    inline, ahead = source(), source(num_workers=2, prefetch=3)
    try:
        ahead.plan([(0, 1), (0, 3), (1, 1), (1, 3)])
        for key in [(0, 1), (0, 3), (1, 1), (1, 3)]:
            assert batch_digest(ahead.batch(*key)) == batch_digest(inline.batch(*key))
        loaded = loaders(ahead)
        assert all(thread != HERE for thread in loaded.values()), loaded  # all ahead
    finally:
        ahead.close()


def test_a_new_plan_drops_what_it_no_longer_holds_and_the_rest_loads_in_line() -> None:
    inline, ahead = source(), source(num_workers=1, prefetch=2)
    try:
        ahead.plan([(0, 0), (0, 2)])
        ahead.plan([(0, 1)])  # a failure moved microbatches: 0 and 2 are someone else's now
        assert ahead.prefetcher is not None and set(ahead.prefetcher._ahead) == {(0, 1)}
        assert batch_digest(ahead.batch(0, 2)) == batch_digest(inline.batch(0, 2))
        assert loaders(ahead)[(0, 2)] == HERE  # not planned: loaded here, the same batch
        assert batch_digest(ahead.batch(0, 1)) == batch_digest(inline.batch(0, 1))
        assert loaders(ahead)[(0, 1)] != HERE
    finally:
        ahead.close()


@pytest.mark.parametrize(("options", "message"), [
    ({"num_workers": -1}, "num_workers must be a whole number >= 0"),
    ({"num_workers": 1, "prefetch": 0}, "prefetch must be a whole number >= 1"),
    ({"num_workers": True}, "num_workers must be a whole number"),
])
def test_bad_loader_settings_are_one_line(options: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        DatasetMicrobatches(Squares(), 3, **options)


def test_the_determinism_check_loads_the_batch_twice_and_compares() -> None:
    check_batch(SimpleNamespace(source=source(num_workers=1)))  # the same twice: passes
    drifting = FunctionMicrobatches(lambda step, microbatch: {"x": torch.rand(3)})
    with pytest.raises(WorkloadError, match="the batch of microbatch 0 of step 0 differed "
                                            "between two loads"):
        check_batch(SimpleNamespace(source=drifting))
    assert batch_digest({"a": [torch.ones(2), 3]}) != batch_digest({"a": [torch.ones(2), 4]})
    assert batch_digest((torch.ones(2),)) != batch_digest((torch.ones(2, 1),))  # shapes count
