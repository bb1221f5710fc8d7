"""The reference GPT's data: a synthetic language, generated on demand, deterministically.

Sequence ``s`` is a pure function of ``(corpus_seed, s)`` (private generators,
stable hashes, no files), so every replica reads the same corpus, and the
corpus is a map-style dataset that ``recover.trainer.DatasetMicrobatches``
walks epoch by epoch like any other.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from recover.trainer import stable_seed


@dataclass(frozen=True)
class CorpusConfig:
    """Shape and identity of the virtual corpus."""

    vocab_size: int = 64
    """Number of distinct tokens; the untrained loss is about ln(vocab_size)."""
    seq_len: int = 32
    """Tokens the model sees per sequence; sequences hold seq_len + 1 tokens
    because targets are the inputs shifted by one."""
    num_sequences: int = 1_000_000
    """Size of the virtual corpus; valid sample ids are [0, num_sequences)."""
    corpus_seed: int = 1234
    """Identity of the language: same seed, same chain, same sequences."""
    branching: int = 4
    """Likely successors per token; small values give a low loss floor, so
    learning is visible within a few dozen steps."""


class SyntheticCorpus:
    """A sparse random Markov chain, sampled on demand.

    Each token has ``branching`` distinct successors with skewed probabilities,
    so a tiny model can learn the bigram table quickly and its loss falls from
    ln(vocab) towards the chain's entropy. Sequence ``s`` depends only on
    ``(corpus_seed, s)``; nothing is materialised.
    """

    def __init__(self, config: CorpusConfig) -> None:
        if config.vocab_size < 2:
            raise ValueError("vocab_size must be >= 2")
        if not 1 <= config.branching <= config.vocab_size:
            raise ValueError("branching must be in [1, vocab_size]")
        if config.seq_len < 1 or config.num_sequences < 1:
            raise ValueError("seq_len and num_sequences must be >= 1")
        self.config = config
        v, k = config.vocab_size, config.branching
        gen = torch.Generator(device="cpu")
        gen.manual_seed(stable_seed(config.corpus_seed, "transitions"))
        succ = torch.stack([torch.randperm(v, generator=gen)[:k] for _ in range(v)])
        # Gaussian logits with a wide spread make each row skewed (one or two
        # dominant successors), keeping the entropy well below ln(branching).
        logits = 1.5 * torch.randn(v, k, generator=gen, dtype=torch.float64)
        probs = torch.softmax(logits, dim=1)
        cum = torch.cumsum(probs, dim=1)
        # Forcing the last bucket to exactly 1.0 guarantees every uniform in
        # [0, 1) lands in some bucket despite rounding in the cumsum.
        cum[:, -1] = 1.0
        self._succ: torch.Tensor = succ.contiguous()
        self._probs: torch.Tensor = probs
        self._cum_rows: list[list[float]] = cum.tolist()
        self._succ_rows: list[list[int]] = succ.tolist()

    def transition_matrix(self) -> torch.Tensor:
        """Dense float64 [V, V] matrix P[a, b] = Pr(next = b | current = a)."""
        v = self.config.vocab_size
        dense = torch.zeros(v, v, dtype=torch.float64)
        dense.scatter_add_(1, self._succ, self._probs)
        return dense

    def _uniforms(self, sample_ids: Sequence[int]) -> torch.Tensor:
        n = self.config.num_sequences
        out = torch.empty(len(sample_ids), self.config.seq_len + 1, dtype=torch.float64)
        gen = torch.Generator(device="cpu")
        for row, sid in enumerate(sample_ids):
            sid = int(sid)
            if not 0 <= sid < n:
                raise IndexError(f"sample id {sid} outside [0, {n})")
            # One private stream per sequence makes a sequence independent of
            # which batch it is generated in.
            gen.manual_seed(stable_seed(self.config.corpus_seed, sid, "sequence"))
            torch.rand(self.config.seq_len + 1, generator=gen, dtype=torch.float64, out=out[row])
        return out

    def _walk(self, uniforms: torch.Tensor) -> torch.Tensor:
        cfg = self.config
        v, k = cfg.vocab_size, cfg.branching
        cum, succ = self._cum_rows, self._succ_rows
        rows: list[list[int]] = []
        # The walk is inherently sequential and tiny (B x seq_len scalar
        # steps); per-op dispatch overhead made a vectorised torch walk ~10x
        # slower than plain bisect on Python floats. Python floats are IEEE
        # float64 like the table, so the result is identical either way.
        for us in uniforms.tolist():
            tok = min(int(us[0] * v), v - 1)
            row = [tok]
            for u in us[1:]:
                tok = succ[tok][min(bisect_right(cum[tok], u), k - 1)]
                row.append(tok)
            rows.append(row)
        return torch.tensor(rows, dtype=torch.int64).reshape(len(rows), uniforms.shape[1])

    def sequences(self, sample_ids: Sequence[int]) -> torch.Tensor:
        """int64 [B, seq_len + 1] tokens for the given sample ids."""
        return self._walk(self._uniforms(sample_ids))

    def sequence(self, sample_id: int) -> torch.Tensor:
        """int64 [seq_len + 1] tokens of one sample."""
        return self.sequences([sample_id])[0]

    def __len__(self) -> int:
        return self.config.num_sequences

    def __getitem__(self, sample_id: int) -> torch.Tensor:
        return self.sequence(sample_id)

    def __getitems__(self, sample_ids: Sequence[int]) -> list[torch.Tensor]:
        """A microbatch's sequences in one walk (torch's batched-fetch protocol): half the
        cost of fetching them one by one (measured)."""
        return list(self.sequences(sample_ids).unbind(0))

    def batch(self, sample_ids: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets), each int64 [B, seq_len]; targets are inputs shifted by one."""
        tokens = self.sequences(sample_ids)
        return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()

    def entropy_rate(self) -> float:
        """Expected optimal cross-entropy (nats/target token) on this corpus.

        Rather than the asymptotic rate under the stationary distribution,
        this averages the per-token entropy over the seq_len predicted
        positions starting from the uniform first token, i.e. exactly the
        loss floor a perfect bigram model reaches on these sequences.
        """
        v = self.config.vocab_size
        p = self.transition_matrix()
        row_entropy = -(self._probs * torch.log(self._probs)).sum(dim=1)
        marginal = torch.full((v,), 1.0 / v, dtype=torch.float64)
        total = 0.0
        for _ in range(self.config.seq_len):
            total += float(marginal @ row_entropy)
            marginal = marginal @ p
        return total / self.config.seq_len

