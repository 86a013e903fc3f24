"""MinHash signatures compiled with Numba: shingle hashes and the permutation minima in
one pass, bit-identical to ``dedup_hashing.MinHasher``'s numpy path (the tests compare them).

The numpy path makes a ``[shingles, num_perm]`` product and takes its column minima
(several passes over ~150 KB for a 300-word document, plus a dozen numpy calls);
here each shingle's hash is formed once and folded into the running minima of the
``num_perm`` permutations, which the compiler vectorizes. Importing this module
imports numba; ``dedup_hashing`` imports it lazily and keeps numpy where numba is missing.
"""

from __future__ import annotations

import numba
import numpy as np

__all__ = ["fmix64", "signature"]

_MIX_1 = np.uint64(0xFF51AFD7ED558CCD)  # MurmurHash3's 64-bit finalizer, as dedup._fmix64
_MIX_2 = np.uint64(0xC4CEB9FE1A85EC53)
_LOW_32 = np.uint64(0xFFFFFFFF)


@numba.njit(cache=True, nogil=True)
def fmix64(x: np.uint64) -> np.uint64:
    """MurmurHash3's 64-bit finalizer: every input bit reaches every output bit."""
    x ^= x >> np.uint64(33)
    x *= _MIX_1
    x ^= x >> np.uint64(33)
    x *= _MIX_2
    x ^= x >> np.uint64(33)
    return x


@numba.njit(cache=True, nogil=True)
def signature(
    word_hashes: np.ndarray, consts: np.ndarray, a: np.ndarray, b: np.ndarray, shingle: int
) -> np.ndarray:
    """``uint32[len(a)]``: per permutation p, the minimum over shingles x of
    ``(a[p] * x + b[p]) mod 2**32``, x the top 32 bits of ``fmix64(sum_t h[i+t] * c[t])``.
    A document of fewer words than ``shingle`` is one shingle of all its words."""
    n_words = word_hashes.shape[0]
    width = min(shingle, n_words)
    count = n_words - width + 1
    a64, b64 = a.astype(np.uint64), b.astype(np.uint64)
    best = np.full(a.shape[0], _LOW_32, np.uint64)
    for i in range(count):
        total = np.uint64(0)
        for t in range(width):
            total += word_hashes[i + t] * consts[t]
        x = fmix64(total) >> np.uint64(32) if width else np.uint64(0)
        for p in range(best.shape[0]):
            value = (a64[p] * x + b64[p]) & _LOW_32
            if value < best[p]:
                best[p] = value
    return best.astype(np.uint32)
