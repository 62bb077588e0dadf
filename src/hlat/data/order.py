"""Seeded permutations of [0, n) computed element by element: a global shuffle in O(1) memory.

A permutation array of a billion documents would cost 8 GB per rank; a Feistel network restricted to [0, n) by
cycle walking needs only its round keys, and resuming needs only the position. Pure integer arithmetic, so
identical on every platform.
"""

from __future__ import annotations

import hashlib

import numpy as np

_M1 = np.uint64(0xBF58476D1CE4E5B9)  # splitmix64 multipliers
_M2 = np.uint64(0x94D049BB133111EB)


def _mix(x: np.ndarray, key: np.uint64) -> np.ndarray:
    """A keyed 64-bit avalanche (splitmix64's finalizer) of every element; wraps mod 2^64."""
    z = x ^ key
    z = (z ^ (z >> np.uint64(30))) * _M1
    z = (z ^ (z >> np.uint64(27))) * _M2
    return z ^ (z >> np.uint64(31))


class Permutation:
    """A pseudo-random bijection of ``[0, n)`` determined by ``(seed, epoch)``; every epoch an independent order.

    ``rounds``: Feistel rounds (4 suffice for a pseudo-random permutation; 6 add margin). ``domain`` keys other uses
    (a mixture's placement of sources in the batch) apart from the document order.
    """

    def __init__(self, n: int, seed: int, epoch: int, rounds: int = 6, domain: str = "hlat-order") -> None:
        if n <= 0:
            raise ValueError(f"cannot permute an empty domain (n={n})")
        self.n = n
        self.half = max(1, (max(n - 1, 1).bit_length() + 1) // 2)  # 2^(2*half) >= n, < 4n
        self.mask = np.uint64((1 << self.half) - 1)
        digest = hashlib.blake2b(f"{domain}|{seed}|{epoch}".encode(), digest_size=8 * rounds).digest()
        self.keys = [np.uint64(int.from_bytes(digest[8 * i : 8 * i + 8], "little")) for i in range(rounds)]

    def _feistel(self, x: np.ndarray) -> np.ndarray:
        h = np.uint64(self.half)
        left, right = x >> h, x & self.mask
        for key in self.keys:
            left, right = right, left ^ (_mix(right, key) & self.mask)
        return (left << h) | right

    def __call__(self, positions: np.ndarray | list[int] | range) -> np.ndarray:
        """Images of ``positions`` (each in ``[0, n)``) under the permutation, as int64."""
        x = np.asarray(positions, dtype=np.uint64)
        if x.size and int(x.max()) >= self.n:
            raise IndexError(f"position {int(x.max())} outside [0, {self.n})")
        out = self._feistel(x)
        walking = out >= np.uint64(self.n)
        while walking.any():  # expected < 4 passes: the padded domain is < 4n
            out[walking] = self._feistel(out[walking])
            walking = out >= np.uint64(self.n)
        return out.astype(np.int64)
