"""Deterministic randomness keyed by (seed, step, microbatch): seeds, the epoch sampler, the ledger.

The trajectory guarantee (DESIGN.md, "Determinism") needs microbatch ``i`` of
step ``t`` to be a pure function of ``(seed, t, i)`` so that any replica can
recompute any microbatch after a failure. Everything here is therefore derived
from stable hashes: no global RNG, no Python ``hash()`` (salted per process),
and nothing that depends on the torch version either, so a job resumed on an
upgraded cluster still walks its data in the same order.
"""

from __future__ import annotations

import hashlib
import math
import struct
from collections.abc import Iterable

_MASK63 = (1 << 63) - 1
FEISTEL_ROUNDS = 4
"""Rounds of the keyed permutation; four make a well-mixed shuffle (Luby-Rackoff)."""


def stable_seed(*parts: int | str) -> int:
    """A 63-bit seed from any sequence of ints and strings, the same in every process."""
    # repr() of an int never contains the separator, and repr() quotes strings,
    # so the encoding is unambiguous.
    key = "\x1f".join(repr(p) for p in parts).encode("utf-8")
    digest = hashlib.blake2b(key, digest_size=8).digest()
    return int.from_bytes(digest, "little") & _MASK63


def microbatch_seed(seed: int, step: int, microbatch: int, purpose: str) -> int:
    """63-bit seed for one (step, microbatch) and one use ("dropout", "samples", ...).

    Separate purposes get unrelated streams, so adding a new random consumer
    never shifts the draws of existing ones.
    """
    return stable_seed(seed, step, microbatch, purpose)


def sample_digest(sample_ids: Iterable[int]) -> str:
    """Hex sha256 of the sorted ids: the ledger entry proving which samples a step
    consumed, independent of how its microbatches were spread over replicas."""
    ids = sorted(sample_ids)
    return hashlib.sha256(struct.pack(f"<{len(ids)}q", *ids)).hexdigest()


_MASK64 = (1 << 64) - 1


def _mix64(x: int) -> int:
    """splitmix64's finalizer: a fast, well-mixing bijection of 64-bit integers."""
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


class _KeyedPermutation:
    """A pseudo-random bijection of [0, n): a balanced Feistel network over the
    smallest even power of two >= n, cycle-walked back into range.

    O(1) memory (a dataset of 10^10 samples needs no 80 GB permutation table)
    and independent of torch's RNG implementation. The round function mixes the
    half with a per-round key (splitmix64); a Feistel network is a bijection
    whatever its round function, so the shuffle's quality is all it affects.
    """

    def __init__(self, n: int, key: int) -> None:
        self.n = n
        bits = max(2, math.ceil(math.log2(n))) if n > 1 else 2
        self._half = (bits + 1) // 2
        self._mask = (1 << self._half) - 1
        self._keys = [stable_seed(key, "round", r) for r in range(FEISTEL_ROUNDS)]

    def _encrypt(self, x: int) -> int:
        left, right = x >> self._half, x & self._mask
        for key in self._keys:
            left, right = right, left ^ (_mix64(right ^ key) & self._mask)
        return (left << self._half) | right

    def __call__(self, x: int) -> int:
        # Cycle walking: the domain is < 4n, so fewer than 4 rounds trips on average,
        # and following the cycle from x lands on a unique value in [0, n).
        y = self._encrypt(x)
        while y >= self.n:
            y = self._encrypt(y)
        return y


class EpochSampler:
    """Which samples of a dataset microbatch ``i`` of step ``t`` consumes.

    The job's microbatches form one stream: microbatch ``i`` of step ``t`` takes
    the ``microbatch_size`` positions starting at ``(t * M + i) * microbatch_size``.
    Position ``p`` lies in epoch ``p // n`` and maps through that epoch's seeded
    permutation of ``[0, n)``: every sample is seen exactly once per epoch, epochs
    are shuffled differently, and any replica computes the ids of any microbatch
    on its own, in microseconds, without knowing the rest of the plan.
    """

    def __init__(self, num_samples: int, microbatch_size: int, global_microbatches: int,
                 seed: int, *, shuffle: bool = True) -> None:
        if num_samples < 1:
            raise ValueError(f"the dataset is empty (len {num_samples}); it needs at least one sample")
        if microbatch_size < 1:
            raise ValueError(f"microbatch_size must be at least 1, got {microbatch_size}")
        if global_microbatches < 1:
            raise ValueError(f"global_microbatches must be at least 1, got {global_microbatches}")
        self.num_samples = num_samples
        self.microbatch_size = microbatch_size
        self.global_microbatches = global_microbatches
        self.seed = seed
        self.shuffle = shuffle
        self._permutations: dict[int, _KeyedPermutation] = {}

    def _permutation(self, epoch: int) -> _KeyedPermutation:
        perm = self._permutations.get(epoch)
        if perm is None:
            if len(self._permutations) >= 4:  # a microbatch spans at most a few epochs
                self._permutations.pop(next(iter(self._permutations)))
            perm = _KeyedPermutation(self.num_samples, stable_seed(self.seed, epoch, "epoch"))
            self._permutations[epoch] = perm
        return perm

    def first_position(self, step: int, microbatch: int) -> int:
        if step < 0 or not 0 <= microbatch < self.global_microbatches:
            raise ValueError(f"no microbatch {microbatch} of step {step} (M = "
                             f"{self.global_microbatches})")
        return (step * self.global_microbatches + microbatch) * self.microbatch_size

    def epoch(self, step: int, microbatch: int) -> int:
        """The epoch microbatch ``microbatch`` of ``step`` starts in."""
        return self.first_position(step, microbatch) // self.num_samples

    def sample_ids(self, step: int, microbatch: int) -> list[int]:
        start = self.first_position(step, microbatch)
        n = self.num_samples
        ids = []
        for position in range(start, start + self.microbatch_size):
            epoch, offset = divmod(position, n)
            ids.append(self._permutation(epoch)(offset) if self.shuffle else offset)
        return ids
