"""Deterministic data: stable seeds, the epoch sampler, sources, token files (trainer/sampling.py,
trainer/sources.py, trainer/tokens.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from recover.trainer import (
    DatasetMicrobatches,
    EpochSampler,
    FunctionMicrobatches,
    TokenFileDataset,
    microbatch_seed,
    sample_digest,
    stable_seed,
    write_token_file,
)
from recover.trainer.sources import as_source


def stream(sampler: EpochSampler, steps: int) -> list[int]:
    """The ids of every microbatch of `steps` steps, in stream order."""
    return [i for step in range(steps) for mb in range(sampler.global_microbatches)
            for i in sampler.sample_ids(step, mb)]


@pytest.mark.parametrize("n, b, m", [(1, 1, 1), (2, 3, 1), (10, 4, 3), (97, 5, 4), (1000, 8, 16),
                                     (4096, 16, 12), (65_537, 7, 3)])
def test_every_epoch_is_a_permutation_of_the_dataset(n: int, b: int, m: int) -> None:
    sampler = EpochSampler(n, b, m, seed=11)
    epochs = 3
    ids = stream(sampler, -(-epochs * n // (b * m)))[:epochs * n]
    for e in range(epochs):
        epoch = ids[e * n:(e + 1) * n]
        assert sorted(epoch) == list(range(n)), f"epoch {e} repeats or misses a sample"
    if n >= 10:
        assert ids[:n] != ids[n:2 * n], "two epochs in the same order"
        assert ids[:n] != list(range(n)), "not shuffled"


def test_a_microbatch_may_straddle_two_epochs() -> None:
    sampler = EpochSampler(10, 4, 1, seed=0)
    # positions 8..11: the last two of epoch 0, the first two of epoch 1
    assert sampler.epoch(2, 0) == 0 and sampler.epoch(3, 0) == 1
    straddling = sampler.sample_ids(2, 0)
    assert straddling[:2] == stream(sampler, 3)[8:10]
    assert len(set(stream(sampler, 5)[:10])) == 10


def test_ids_depend_only_on_seed_step_and_microbatch() -> None:
    a = EpochSampler(1_000_000, 8, 16, seed=3)
    b = EpochSampler(1_000_000, 8, 16, seed=3)
    assert a.sample_ids(500, 7) == b.sample_ids(500, 7)  # b never saw steps 0..499
    assert a.sample_ids(500, 7) != EpochSampler(1_000_000, 8, 16, seed=4).sample_ids(500, 7)
    assert a.sample_ids(500, 7) != a.sample_ids(500, 8)


def test_without_shuffle_the_dataset_is_walked_in_order() -> None:
    sampler = EpochSampler(7, 3, 2, seed=0, shuffle=False)
    assert stream(sampler, 3) == [0, 1, 2, 3, 4, 5, 6, 0, 1, 2, 3, 4, 5, 6, 0, 1, 2, 3]


@pytest.mark.parametrize("args, message", [
    ((0, 8, 4, 0), "empty"), ((10, 0, 4, 0), "microbatch_size"), ((10, 8, 0, 0), "global"),
])
def test_bad_sampler_arguments_say_what_is_wrong(args, message) -> None:
    with pytest.raises(ValueError, match=message):
        EpochSampler(*args)
    with pytest.raises(ValueError, match="no microbatch 4 of step 0"):
        EpochSampler(10, 2, 4, 0).sample_ids(0, 4)


def test_seeds_are_stable_across_processes() -> None:
    code = ("import json; from recover.trainer.sampling import *;"
            "print(json.dumps([stable_seed(1, 'x'), microbatch_seed(7, 3, 2, 'dropout'),"
            " EpochSampler(1000, 4, 3, 9).sample_ids(5, 1)]))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         timeout=60)
    assert json.loads(out.stdout) == [stable_seed(1, "x"), microbatch_seed(7, 3, 2, "dropout"),
                                      EpochSampler(1000, 4, 3, 9).sample_ids(5, 1)]


def test_microbatch_seed_properties() -> None:
    s = microbatch_seed(1, 2, 3, "samples")
    assert 0 <= s < 2**63
    assert s != microbatch_seed(1, 2, 3, "dropout")
    # Would collide under a naive concatenation such as f"{step}{microbatch}".
    assert microbatch_seed(1, 12, 3, "x") != microbatch_seed(1, 1, 23, "x")


def test_sample_digest_order_independent_and_sensitive() -> None:
    ids = [5, 1, 999_999, 42]
    d = sample_digest(ids)
    assert d == sample_digest(reversed(ids))
    assert d != sample_digest([5, 1, 999_999, 43])
    assert d != sample_digest(ids + [0])


# ---------------------------------------------------------------- sources

def test_dataset_source_collates_the_sampled_samples() -> None:
    dataset = torch.utils.data.TensorDataset(torch.arange(20.0).view(10, 2), torch.arange(10))
    source = DatasetMicrobatches(dataset, microbatch_size=3)
    source.bind(global_microbatches=2, seed=5)
    ids = source.sample_ids(1, 1)
    inputs, labels = source.batch(1, 1)
    assert labels.tolist() == ids and inputs.shape == (3, 2)
    assert source.samples_per_microbatch == 3


def test_function_source_names_each_microbatch_in_the_ledger() -> None:
    source = FunctionMicrobatches(lambda step, mb: (step, mb))
    source.bind(global_microbatches=4, seed=0)
    assert source.batch(2, 3) == (2, 3)
    assert source.sample_ids(2, 3) == [11]
    assert source.samples_per_microbatch is None


def test_what_train_accepts_as_microbatches() -> None:
    assert isinstance(as_source(lambda step, mb: None), FunctionMicrobatches)
    source = DatasetMicrobatches([1, 2, 3], microbatch_size=1)
    assert as_source(source) is source
    with pytest.raises(TypeError, match="DatasetMicrobatches"):
        as_source([1, 2, 3])
    with pytest.raises(TypeError, match="must be a function"):
        as_source(42)
    # What a torch user brings: refused, naming the wrapper that keeps the contract.
    loader = torch.utils.data.DataLoader(list(range(8)), batch_size=2, shuffle=True)
    with pytest.raises(TypeError, match=r"got a DataLoader, whose batches a failure cannot "
                                        r"replay; pass its dataset: DatasetMicrobatches\(loader"):
        as_source(loader)
    with pytest.raises(TypeError, match=r"got an iterator \(generator\).*a function \(step, "
                                        r"microbatch\) -> batch or DatasetMicrobatches"):
        as_source(x for x in range(3))
    with pytest.raises(ValueError, match="microbatch_size"):
        DatasetMicrobatches([1, 2, 3], microbatch_size=0)
    with pytest.raises(TypeError, match="map-style"):
        DatasetMicrobatches(iter([1]), microbatch_size=1)


# ---------------------------------------------------------------- token files

@pytest.mark.parametrize("dtype", ["uint16", "uint32"])
def test_token_file_windows(tmp_path: Path, dtype: str) -> None:
    tokens = np.arange(103) * (7 if dtype == "uint32" else 1)
    path = write_token_file(tmp_path / "tokens.bin", tokens, dtype)
    dataset = TokenFileDataset(path, seq_len=10, dtype=dtype)
    assert len(dataset) == 10  # (103 - 1) // 10 windows of 11 tokens
    assert dataset[0].tolist() == tokens[0:11].tolist()
    assert dataset[9].tolist() == tokens[90:101].tolist()
    assert dataset[3].dtype == torch.int64
    with pytest.raises(IndexError):
        dataset[10]


def test_token_file_errors_say_what_is_wrong(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="cannot read"):
        TokenFileDataset(tmp_path / "missing.bin", seq_len=4)
    odd = tmp_path / "odd.bin"
    odd.write_bytes(b"\x00" * 7)
    with pytest.raises(ValueError, match="not a whole number of uint16"):
        TokenFileDataset(odd, seq_len=2)
    short = write_token_file(tmp_path / "short.bin", [1, 2, 3])
    with pytest.raises(ValueError, match="at least 5"):
        TokenFileDataset(short, seq_len=4)
    with pytest.raises(ValueError, match=r"\[0, 65535\]"):
        write_token_file(tmp_path / "big.bin", [70_000])
    with pytest.raises(ValueError, match="dtype"):
        TokenFileDataset(short, seq_len=1, dtype="int8")


def test_a_dataset_that_fetches_many_at_once_is_asked_once_per_microbatch() -> None:
    class Batched:
        calls: list[list[int]] = []

        def __len__(self) -> int:
            return 50

        def __getitem__(self, i: int) -> torch.Tensor:
            raise AssertionError("fetched one by one")

        def __getitems__(self, ids: list[int]) -> list[torch.Tensor]:
            self.calls.append(list(ids))
            return [torch.tensor([i]) for i in ids]

    dataset = Batched()
    source = DatasetMicrobatches(dataset, microbatch_size=4)
    source.bind(global_microbatches=3, seed=1)
    assert source.batch(2, 1).view(-1).tolist() == source.sample_ids(2, 1)
    assert dataset.calls == [source.sample_ids(2, 1)]
