"""The reference GPT's synthetic corpus: deterministic, learnable, a map-style dataset."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch

from recover.workloads.tinygpt.corpus import CorpusConfig, SyntheticCorpus

torch.set_num_threads(1)

N = 1_000_000


@pytest.fixture(scope="module")
def corpus() -> SyntheticCorpus:
    return SyntheticCorpus(CorpusConfig())


def test_same_sequence_in_fresh_process(corpus: SyntheticCorpus) -> None:
    # A fresh interpreter has a different hash() salt and RNG state: equality
    # here shows nothing depends on either.
    code = (
        "import json;"
        "from recover.workloads.tinygpt.corpus import CorpusConfig, SyntheticCorpus;"
        "print(json.dumps(SyntheticCorpus(CorpusConfig())[4242].tolist()))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=60)
    assert json.loads(out.stdout) == corpus[4242].tolist()


def test_is_a_map_style_dataset(corpus: SyntheticCorpus) -> None:
    assert len(corpus) == N
    assert torch.equal(corpus[7], corpus.sequence(7))
    with pytest.raises(IndexError):
        corpus[N]


def test_sequences_deterministic_and_shaped(corpus: SyntheticCorpus) -> None:
    s = corpus.sequence(123)
    assert s.dtype == torch.int64 and s.shape == (33,)
    assert torch.equal(s, corpus.sequence(123))
    assert torch.equal(s, SyntheticCorpus(CorpusConfig()).sequence(123))
    assert not torch.equal(s, corpus.sequence(124))
    other = SyntheticCorpus(CorpusConfig(corpus_seed=99))
    assert not torch.equal(s, other.sequence(123))


def test_batch_matches_sequences(corpus: SyntheticCorpus) -> None:
    ids = [3, 17, 3, 999_999]
    x, y = corpus.batch(ids)
    assert x.shape == y.shape == (4, 32)
    assert x.dtype == y.dtype == torch.int64
    for row, sid in enumerate(ids):
        seq = corpus.sequence(sid)
        assert torch.equal(x[row], seq[:-1])
        assert torch.equal(y[row], seq[1:])
    with pytest.raises(IndexError):
        corpus.batch([N])


def test_sequences_follow_the_chain(corpus: SyntheticCorpus) -> None:
    p = corpus.transition_matrix()
    assert torch.allclose(p.sum(dim=1), torch.ones(64, dtype=torch.float64))
    assert int((p > 0).sum(dim=1).max()) == 4
    tokens = corpus.sequences(list(range(200)))
    prev, nxt = tokens[:, :-1].reshape(-1), tokens[:, 1:].reshape(-1)
    assert bool((p[prev, nxt] > 0).all())
    # Empirical transition frequencies should track the table.
    counts = torch.zeros(64, 64, dtype=torch.float64)
    counts.index_put_((prev, nxt), torch.ones_like(prev, dtype=torch.float64), accumulate=True)
    busiest = int(counts.sum(dim=1).argmax())
    freq = counts[busiest] / counts[busiest].sum()
    assert float((freq - p[busiest]).abs().max()) < 0.15


def test_global_rng_untouched(corpus: SyntheticCorpus) -> None:
    torch.manual_seed(0)
    before = torch.get_rng_state()
    SyntheticCorpus(CorpusConfig(corpus_seed=5))
    corpus.batch([1, 99, 12345])
    corpus[5]
    corpus.entropy_rate()
    assert torch.equal(before, torch.get_rng_state())


def test_entropy_rate_is_a_real_floor(corpus: SyntheticCorpus) -> None:
    h = corpus.entropy_rate()
    assert 0.0 < h < math.log(4) < math.log(64)
    # Monte-Carlo estimate of -log p(next | prev) over real sequences.
    p = corpus.transition_matrix()
    tokens = corpus.sequences(list(range(2000)))
    nll = -torch.log(p[tokens[:, :-1], tokens[:, 1:]]).mean()
    assert abs(float(nll) - h) < 0.05


def test_bad_config_rejected() -> None:
    with pytest.raises(ValueError):
        SyntheticCorpus(CorpusConfig(branching=0))
    with pytest.raises(ValueError):
        SyntheticCorpus(CorpusConfig(vocab_size=4, branching=5))
