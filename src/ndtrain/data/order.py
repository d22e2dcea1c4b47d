"""The order of an epoch's samples: a keyed bijection of [0, n) evaluated per position
(KeyedPermutation), or, for checkpoints written before it, a whole-epoch numpy permutation; and
the per-epoch cache the loaders keep of the current one (EpochOrders). data/loader.py's docstring
says how the global sample stream uses it."""

from __future__ import annotations

import numpy as np

from ndtrain.errors import NdtrainError


def _check_int(name: str, value, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise NdtrainError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return int(value)


# How an epoch's order is made, recorded in the loader state ("order"): 1, one
# numpy.random.default_rng([seed, epoch]).permutation(n) per epoch (8 bytes per sample, on every
# rank: what checkpoints without the key used); 2, KeyedPermutation (O(1) memory).
ORDER_PERMUTATION, ORDER_KEYED = 1, 2

_M1, _M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)  # splitmix64's finalizer


class KeyedPermutation:
    """A bijection of [0, n) chosen by an integer key, evaluated element by element in O(1) memory:
    a balanced Feistel network of ROUNDS rounds on the 2h-bit words (the smallest even width
    holding n - 1), whose round function is splitmix64's finalizer of the half-word plus a round
    key drawn from the key. A Feistel network is a bijection of its words whatever the round
    function; cycle-walking (encrypt again while the result is >= n) restricts it to [0, n)
    and stays a bijection there. The words hold fewer than 4n values, so a position takes under
    4 encryptions on average."""

    ROUNDS = 6

    def __init__(self, n: int, key):
        self.n = _check_int("permutation size", n, 1)
        bits = max(2, (self.n - 1).bit_length())
        self.half = np.uint64((bits + 1) // 2)
        self.mask = np.uint64((1 << int(self.half)) - 1)
        self.keys = [np.uint64(k) for k in np.random.SeedSequence(list(key)).generate_state(self.ROUNDS, np.uint64)]

    def _encrypt(self, x: np.ndarray) -> np.ndarray:
        left, right = x >> self.half, x & self.mask
        for k in self.keys:
            z = right + k  # uint64 arithmetic wraps, as the mixing wants
            z = (z ^ (z >> np.uint64(30))) * _M1
            z = (z ^ (z >> np.uint64(27))) * _M2
            z ^= z >> np.uint64(31)
            left, right = right, left ^ (z & self.mask)
        return (left << self.half) | right

    def __call__(self, positions: np.ndarray) -> np.ndarray:
        """The window at each position (int64 array in [0, n)), same shape."""
        x = np.asarray(positions, dtype=np.int64)
        if x.size and (x.min() < 0 or x.max() >= self.n):
            raise IndexError(f"position out of range [0, {self.n})")
        y = self._encrypt(x.astype(np.uint64))
        n = np.uint64(self.n)
        walk = np.flatnonzero(y >= n)
        while walk.size:
            y[walk] = self._encrypt(y[walk])
            walk = walk[y[walk] >= n]
        return y.astype(np.int64)


class EpochOrders:
    """The order of an epoch of `n` samples, per (order, key): a function of arrays of positions.
    The current key's is kept (ORDER_PERMUTATION's is the whole epoch, 8 bytes a sample; the
    keyed one is a few integers)."""

    def __init__(self, n: int):
        self.n = n
        self._cache: tuple[tuple, object] = ((), None)  # one tuple: swapped atomically (prefetch thread)

    def get(self, order: int, key: list[int]):
        cached, fn = self._cache
        if cached != (order, *key):
            fn = np.random.default_rng(key).permutation(self.n).__getitem__ if order == ORDER_PERMUTATION \
                else KeyedPermutation(self.n, key)
            self._cache = ((order, *key), fn)
        return fn
