"""Batches loaded ahead in worker processes (trainer/prefetch.py via DatasetMicrobatches's
num_workers): the same batches, loaded where the plan says, dropped when it changes; and
the determinism check's comparison of two loads of one batch."""

from __future__ import annotations

import os
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


def pids(ahead: DatasetMicrobatches) -> dict[tuple[int, int], int]:
    assert ahead.prefetcher is not None
    return dict(ahead.prefetcher.loaded_by)


def test_planned_batches_come_from_the_workers_and_equal_loading_in_line() -> None:
    inline, ahead = source(), source(num_workers=2, prefetch=3)
    try:
        ahead.plan([(0, 1), (0, 3), (1, 1), (1, 3)])
        for key in [(0, 1), (0, 3), (1, 1), (1, 3)]:
            assert batch_digest(ahead.batch(*key)) == batch_digest(inline.batch(*key))
        loaded = pids(ahead)
        assert all(pid != os.getpid() for pid in loaded.values()), loaded  # all ahead
    finally:
        ahead.close()


def test_a_new_plan_drops_what_it_no_longer_holds_and_the_rest_loads_in_line() -> None:
    inline, ahead = source(), source(num_workers=1, prefetch=2)
    try:
        ahead.plan([(0, 0), (0, 2)])
        ahead.plan([(0, 1)])  # a failure moved microbatches: 0 and 2 are someone else's now
        assert ahead.prefetcher is not None and set(ahead.prefetcher._ahead) == {(0, 1)}
        assert batch_digest(ahead.batch(0, 2)) == batch_digest(inline.batch(0, 2))
        assert pids(ahead)[(0, 2)] == os.getpid()  # not planned: loaded here, the same batch
        assert batch_digest(ahead.batch(0, 1)) == batch_digest(inline.batch(0, 1))
        assert pids(ahead)[(0, 1)] != os.getpid()
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


def test_loaders_die_with_their_replica() -> None:
    # A SIGKILLed replica leaves no loader behind (they hold each other's pipe ends open,
    # so they would never see it go): each has a parent-death signal.
    import signal
    import subprocess
    import sys
    import time

    script = ("from tests.unit.test_prefetch import source\n"
              "import os, time\n"
              "s = source(num_workers=2)\n"
              "s.plan([(0, 0)]); s.batch(0, 0)\n"
              "print(' '.join(str(p.pid) for p in s.prefetcher._pool._pool), flush=True)\n"
              "time.sleep(60)\n")
    replica = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True,
                               cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    loaders = [int(p) for p in replica.stdout.readline().split()]  # type: ignore[union-attr]
    assert len(loaders) == 2
    replica.send_signal(signal.SIGKILL)
    replica.wait()

    def alive(pid: int) -> bool:
        try:
            with open(f"/proc/{pid}/stat") as stat:  # a zombie is gone, only not yet reaped
                return stat.read().split()[2] != "Z"
        except FileNotFoundError:
            return False

    deadline = time.monotonic() + 30
    while any(alive(p) for p in loaders) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [p for p in loaders if alive(p)]
