"""A pseudo-random permutation of [0, n), computed one index at a time in O(1) memory.

The shuffled train order visits every window of an epoch once, in an order drawn from (seed,
epoch). An explicit permutation array costs 8 bytes per window per rank: 0.8 GB at 100B tokens
(~100M windows of 1024), on every rank, rebuilt each epoch. A Feistel network is a bijection on
[0, 2^b) for any round function, so with keys drawn from (seed, epoch) it is a keyed permutation
that needs only its keys. For n that is not a power of two, cycle-walking maps an index that lands
outside [0, n) again until it lands inside: still a bijection on [0, n) (each cycle of the larger
permutation is walked in order), and since 2^b < 4n, fewer than 4 steps are expected.

Statistical quality: 6 rounds of a splitmix64 mix per half. That is not cryptographic, but a
training order does not need that. It needs every window exactly once (guaranteed by
construction, tested) and no visible structure (tested: a visit order unrelated to position).
"""

from __future__ import annotations

import numpy as np

ROUNDS = 6
_M1, _M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)


def _mix(z: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser: every input bit affects every output bit."""
    z = (z ^ (z >> np.uint64(30))) * _M1
    z = (z ^ (z >> np.uint64(27))) * _M2
    return z ^ (z >> np.uint64(31))


class Permutation:
    """permutation(i) for i in [0, n): a bijection of [0, n) onto itself, fixed by (n, seed, epoch)."""

    def __init__(self, n: int, *, seed: int, epoch: int) -> None:
        if n < 1:
            raise ValueError(f"n={n} must be >= 1")
        self.n = n
        half = max(1, (max(1, (n - 1).bit_length()) + 1) // 2)  # 2^(2*half) >= n
        self._half = np.uint64(half)
        self._mask = np.uint64((1 << half) - 1)
        self._keys = np.random.default_rng([seed, epoch, n]).integers(0, 2**64 - 1, size=ROUNDS, dtype=np.uint64)

    def _round_trip(self, x: np.ndarray) -> np.ndarray:
        left, right = x >> self._half, x & self._mask
        for key in self._keys:
            left, right = right, left ^ (_mix(right ^ key) & self._mask)
        return (left << self._half) | right

    def __call__(self, index: np.ndarray | int) -> np.ndarray:
        idx = np.asarray(index, dtype=np.int64)
        if idx.size and (idx.min() < 0 or idx.max() >= self.n):
            raise IndexError(f"index out of [0, {self.n})")
        with np.errstate(over="ignore"):  # uint64 multiplication wraps, as the mix intends
            x = self._round_trip(idx.astype(np.uint64))
            outside = x >= np.uint64(self.n)
            while outside.any():  # cycle-walking
                x[outside] = self._round_trip(x[outside])
                outside = x >= np.uint64(self.n)
        return x.astype(np.int64)
