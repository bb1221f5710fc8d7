"""Deterministic synthetic corpus and per-microbatch sample selection.

The trajectory guarantee (DESIGN.md, "Determinism") needs microbatch ``i`` of
step ``t`` to be a pure function of ``(seed, t, i)`` so that any replica can
recompute any microbatch after a failure. Everything here is therefore derived
from stable hashes and private generators: no files, no global RNG, no
Python ``hash()`` (which is salted per process).
"""

from __future__ import annotations

import hashlib
import struct
from bisect import bisect_right
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

_MASK63 = (1 << 63) - 1


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


def _stable_seed(*parts: int | str) -> int:
    # repr() of ints never contains the separator, and the (single) string
    # part always comes last, so the encoding is unambiguous.
    key = "\x1f".join(repr(p) for p in parts).encode("utf-8")
    digest = hashlib.blake2b(key, digest_size=8).digest()
    return int.from_bytes(digest, "little") & _MASK63


def microbatch_seed(seed: int, step: int, microbatch: int, purpose: str) -> int:
    """63-bit seed for one (step, microbatch) and one use ("samples", "dropout").

    Separate purposes get unrelated streams, so adding a new random consumer
    never shifts the samples of existing ones.
    """
    return _stable_seed(seed, step, microbatch, purpose)


def microbatch_sample_ids(
    seed: int, step: int, microbatch: int, microbatch_size: int, num_sequences: int
) -> list[int]:
    """Sample ids of one microbatch; pure function of its arguments.

    Sampling is with replacement from the virtual corpus: it keeps every
    microbatch independent of all others, which is what lets a survivor
    recompute a lost microbatch without knowing the rest of the plan.
    """
    if microbatch_size < 0:
        raise ValueError(f"microbatch_size must be >= 0, got {microbatch_size}")
    if num_sequences <= 0:
        raise ValueError(f"num_sequences must be > 0, got {num_sequences}")
    gen = torch.Generator(device="cpu")
    gen.manual_seed(microbatch_seed(seed, step, microbatch, "samples"))
    ids = torch.randint(0, num_sequences, (microbatch_size,), generator=gen, dtype=torch.int64)
    return ids.tolist()


def sample_digest(sample_ids: Iterable[int]) -> str:
    """Hex sha256 of the sorted ids: the ledger entry proving which samples a
    step consumed, independent of how microbatches were spread over replicas."""
    ids = sorted(sample_ids)
    return hashlib.sha256(struct.pack(f"<{len(ids)}q", *ids)).hexdigest()


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
        gen.manual_seed(_stable_seed(config.corpus_seed, "transitions"))
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
            gen.manual_seed(_stable_seed(self.config.corpus_seed, sid, "sequence"))
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

