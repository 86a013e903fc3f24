"""Exact and near-duplicate detection: normalized content hashes, MinHash and LSH.

Both indexes keep the *first* occurrence: the pipeline feeds documents in its
canonical order, so a decision depends only on the documents before it and a
resumed run reaches the same decisions as an uninterrupted one.

Defaults, and where they come from (docs/data.md, Deduplication):

- 5-word shingles over normalized text, as DataTrove's ``MinhashConfig``
  (``n_grams=5``). Word shingles are cheaper than NeMo Curator's 24-character
  shingles on CPU and see the same rewordings.
- 128 permutations as 16 bands x 8 rows: LSH threshold (1/16)^(1/8) ~ 0.71
  Jaccard, a little stricter than DataTrove's 14x8 (~0.72) and looser than
  Curator's 20x13 (~0.79).
- Exact keys are a 16-byte blake2b of the normalized text (Curator uses MD5 of
  the raw text; normalizing first also catches case and whitespace variants).

Speed: each word is hashed once (xxh3-64), a shingle hash combines its word
hashes (numpy ops per word position, no string joins), and the ``num_perm``
hashes ``a*x + b mod 2**32`` are one broadcast multiply-add and a column min;
with numba installed, one compiled pass does both (``minhash_jit``, same bits).
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable
from functools import lru_cache
from typing import NamedTuple

import numpy as np

from factory.data.steps.numba_kernels import compiled_kernels
from factory.schemas.data_recipe import MAX_NGRAM

# Signatures only compare equal between runs that hash words the same way, so
# WORD_HASH belongs in anything that persists signatures or index state.
try:
    from xxhash import xxh3_64_intdigest as _hash64

    WORD_HASH = "xxh3_64"
except ImportError:  # pragma: no cover - slower, and different hashes
    WORD_HASH = "blake2b_64"

    def _hash64(data: bytes) -> int:
        return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


__all__ = [
    "WORD_HASH",
    "ExactIndex",
    "LSHIndex",
    "MinHasher",
    "Prepared",
    "content_hash",
    "estimate_jaccard",
    "ngram_hashes",
    "ngram_hashes_multi",
    "normalize_for_dedup",
    "prepare",
]

DEFAULT_SHINGLE_SIZE = 5
DEFAULT_BANDS = 16
DEFAULT_ROWS = 8
DEFAULT_NUM_PERM = DEFAULT_BANDS * DEFAULT_ROWS
DEFAULT_SEED = 1  # DataTrove's MinhashConfig seed

_BLOCK = 2048  # shingles per broadcast block: 2048 x 128 x 4 B = 1 MiB stays in cache
_POSITION_SEED = 0x5EED_D0C5  # fixed: shingle hashes must not depend on the MinHash seed
_MAX_NGRAM = MAX_NGRAM  # the recipe schema bounds every n-gram size by it, at validation time

# ASCII fast path: lowercase letters, keep [a-z0-9_], everything else becomes a space.
_ASCII_TABLE = bytes(
    (b + 32 if 65 <= b <= 90 else b) if chr(b).isalnum() or b == 95 else 32 for b in range(128)
) + bytes(range(128, 256))
_NON_ASCII_NON_WORD = re.compile(r"[^\w\x00-\x7f]+")


def _words(text: str) -> list[bytes]:
    """Lowercased words as UTF-8 bytes (see ``normalize_for_dedup`` for the rule)."""
    if text.isascii():  # the common case: one C-level byte translation, no regex
        return text.encode("ascii").translate(_ASCII_TABLE).split()
    # The regex only blanks non-ASCII punctuation and spaces; the table does the rest.
    text = _NON_ASCII_NON_WORD.sub(" ", text.lower())
    return text.encode("utf-8").translate(_ASCII_TABLE).split()


class Prepared(NamedTuple):
    """Normalized words (UTF-8) and their 64-bit hashes: computed once per document and
    shared by exact dedup, MinHash and decontamination."""

    words: list[bytes]
    hashes: np.ndarray


def prepare(text: str | Prepared) -> Prepared:
    """Normalize and hash the words of ``text``; pass the result to every dedup stage."""
    if isinstance(text, Prepared):
        return text
    words = _words(text)
    hashes = np.fromiter(map(_hash64, words), dtype=np.uint64, count=len(words))
    return Prepared(words, hashes)


def normalize_for_dedup(text: str) -> str:
    """Lowercase, turn every non-word character into a space, and collapse whitespace.

    A word is a maximal run of Unicode word characters (``\\w``: letters, digits,
    underscore), so punctuation and symbols separate words and disappear:
    ``"Hello,  WORLD!"`` -> ``"hello world"``, ``"don't"`` -> ``"don t"``. Accents and
    digits are kept: folding them would merge documents that differ in meaning.
    """
    return b" ".join(_words(text)).decode("utf-8")


def content_hash(text: str | Prepared) -> bytes:
    """Exact-dedup key: 16-byte blake2b of the normalized text (stable across platforms)."""
    words = text.words if isinstance(text, Prepared) else _words(text)
    return hashlib.blake2b(b" ".join(words), digest_size=16).digest()


@lru_cache(maxsize=16)
def _position_constants(n: int) -> np.ndarray:
    # Odd multipliers per word position; a stream prefix, so c_t does not depend on n.
    return np.random.PCG64(_POSITION_SEED).random_raw(n) | np.uint64(1)


def _fmix64(x: np.ndarray) -> np.ndarray:
    """MurmurHash3's 64-bit finalizer, in place: spreads every input bit over the word."""
    x ^= x >> np.uint64(33)
    x *= np.uint64(0xFF51AFD7ED558CCD)
    x ^= x >> np.uint64(33)
    x *= np.uint64(0xC4CEB9FE1A85EC53)
    x ^= x >> np.uint64(33)
    return x


def ngram_hashes_multi(word_hashes: np.ndarray, sizes: Iterable[int]) -> dict[int, np.ndarray]:
    """64-bit hashes of every window of ``m`` consecutive words, for each ``m`` in ``sizes``.

    A window w_0..w_{m-1} hashes to ``fmix64(sum_t hash(w_t) * c_t)`` with fixed odd
    constants c_t (mod 2**64), so a short item of m words hashes like an m-word
    window of a document. Each size is one ``np.correlate`` over the word hashes and
    all sizes share one finalizer pass. Sizes longer than the text give empty arrays.
    """
    wanted = sorted(set(sizes))
    if not wanted or not 1 <= wanted[0] <= wanted[-1] <= _MAX_NGRAM:
        raise ValueError(f"n-gram sizes must be in [1, {_MAX_NGRAM}], got {wanted}")
    consts = _position_constants(wanted[-1])
    out = {m: np.empty(0, dtype=np.uint64) for m in wanted}
    live = [m for m in wanted if m <= word_hashes.size]
    sums = [np.correlate(word_hashes, consts[:m], mode="valid") for m in live]
    if sums:
        flat = _fmix64(sums[0] if len(sums) == 1 else np.concatenate(sums))
        bounds = np.cumsum([0, *(part.size for part in sums)]).tolist()
        for m, lo, hi in zip(live, bounds, bounds[1:], strict=False):
            out[m] = flat[lo:hi]
    return out


def ngram_hashes(word_hashes: np.ndarray, n: int, *, whole_if_short: bool = False) -> np.ndarray:
    """``ngram_hashes_multi`` for one size; with ``whole_if_short`` a document shorter
    than ``n`` words is one window of all its words (an empty one hashes to 0)."""
    if whole_if_short and word_hashes.size < n:
        if word_hashes.size == 0:
            return np.zeros(1, dtype=np.uint64)
        n = word_hashes.size
    return ngram_hashes_multi(word_hashes, (n,))[n]


class MinHasher:
    """MinHash signatures over word shingles of the normalized text.

    Permutation ``i`` is ``h_i(x) = (a_i * x + b_i) mod 2**32`` on the top 32 bits
    of each shingle hash, with odd ``a_i``; the signature is ``min_x h_i(x)`` per
    ``i`` as ``uint32``. ``a`` and ``b`` come from the raw ``PCG64(seed)`` stream
    (``random_raw``), which NumPy keeps bit-stable across versions and platforms,
    so two processes or machines produce identical signatures for one seed.
    Documents with fewer words than a shingle are one shingle of all their words.
    """

    def __init__(
        self,
        num_perm: int = DEFAULT_NUM_PERM,
        shingle_size: int = DEFAULT_SHINGLE_SIZE,
        seed: int = DEFAULT_SEED,
    ) -> None:
        if num_perm < 1 or seed < 0 or not 1 <= shingle_size <= _MAX_NGRAM:
            raise ValueError(f"invalid MinHasher({num_perm=}, {shingle_size=}, {seed=})")
        self.num_perm, self.shingle_size, self.seed = num_perm, shingle_size, seed
        raw = np.random.PCG64(seed).random_raw(2 * num_perm) >> np.uint64(32)
        self._a = raw[:num_perm].astype(np.uint32) | np.uint32(1)
        self._b = raw[num_perm:].astype(np.uint32)

    def shingle_hashes(self, text: str | Prepared) -> np.ndarray:
        """The 32-bit shingle hashes the signature is the min over (one per position)."""
        hashes = ngram_hashes(prepare(text).hashes, self.shingle_size, whole_if_short=True)
        return (hashes >> np.uint64(32)).astype(np.uint32)

    def signature(self, text: str | Prepared) -> np.ndarray:
        """``uint32[num_perm]`` MinHash signature of ``text`` (compiled where numba is)."""
        kernels = compiled_kernels("minhash_jit")
        if kernels is not None:
            consts = _position_constants(self.shingle_size)
            return kernels.signature(
                prepare(text).hashes, consts, self._a, self._b, self.shingle_size
            )
        return self._signature_numpy(text)

    def _signature_numpy(self, text: str | Prepared) -> np.ndarray:
        x = self.shingle_hashes(text)
        if x.size <= _BLOCK:
            block = x[:, None] * self._a
            block += self._b
            return block.min(axis=0)
        out = np.full(self.num_perm, 0xFFFFFFFF, dtype=np.uint32)
        buf = np.empty((_BLOCK, self.num_perm), dtype=np.uint32)
        for start in range(0, x.size, _BLOCK):  # bounded memory for very long documents
            chunk = x[start : start + _BLOCK, None]
            block = buf[: chunk.shape[0]]
            np.multiply(chunk, self._a, out=block)
            block += self._b
            np.minimum(out, block.min(axis=0), out=out)
        return out


def estimate_jaccard(sig_a: np.ndarray, sig_b: np.ndarray) -> float:
    """Fraction of equal signature slots: an unbiased estimate of shingle-set Jaccard."""
    if sig_a.shape != sig_b.shape:
        raise ValueError(f"signature shapes differ: {sig_a.shape} vs {sig_b.shape}")
    return float(np.mean(sig_a == sig_b))


class LSHIndex:
    """Banded LSH over MinHash signatures; keeps the first document of each near-duplicate set.

    Two documents with shingle Jaccard ``s`` share at least one band with
    probability ``1 - (1 - s**rows)**bands``, an S-curve whose midpoint is near
    ``threshold = (1/bands)**(1/rows)``. Order matters by design: ``add`` compares
    a document only with those already kept, and a duplicate is never added, so
    there is no transitive clustering (A ~ B ~ C with A !~ C keeps A and C when B
    came second). This greedy keep-first rule needs no second pass, unlike the
    connected components of Curator and DataTrove.

    Memory: one 64-bit band key (xxh3 of the band's bytes) per (kept document,
    band) in ``bands`` dicts, O(documents) and independent of document length.
    A false band match needs a 64-bit key collision (about n**2 / 2**65).
    """

    def __init__(self, bands: int = DEFAULT_BANDS, rows: int = DEFAULT_ROWS) -> None:
        if bands < 1 or rows < 1:
            raise ValueError(f"bands and rows must be positive, got {bands}x{rows}")
        self.bands, self.rows = bands, rows
        self._tables: list[dict[int, int]] = [{} for _ in range(bands)]
        self._size = 0

    @property
    def num_perm(self) -> int:
        """The signature length this index takes: ``bands * rows``."""
        return self.bands * self.rows

    @property
    def threshold(self) -> float:
        """Approximate Jaccard at which collisions become likely: ``(1/bands)**(1/rows)``."""
        return (1.0 / self.bands) ** (1.0 / self.rows)

    def __len__(self) -> int:
        return self._size

    def band_keys(self, signature: np.ndarray) -> list[int]:
        """One 64-bit key per band: two documents collide in band ``b`` when their keys match.

        The distributed dedup (``factory.data.stages.dedup_shuffle``) shuffles these keys;
        ``add`` looks them up in its tables; both use this one function.
        """
        if signature.shape != (self.num_perm,):
            raise ValueError(f"expected a ({self.num_perm},) signature, got {signature.shape}")
        data = np.ascontiguousarray(signature, dtype="<u4").tobytes()  # fixed byte order
        width = 4 * self.rows
        return [_hash64(data[i : i + width]) for i in range(0, len(data), width)]

    def add(self, doc_id: int, signature: np.ndarray) -> int | None:
        """The id of an earlier kept document sharing a band (lowest band first), in
        which case ``doc_id`` is a near-duplicate and is not added; else add it, None."""
        keys = self.band_keys(signature)
        for table, key in zip(self._tables, keys, strict=True):
            hit = table.get(key)
            if hit is not None:
                return hit
        for table, key in zip(self._tables, keys, strict=True):
            table[key] = doc_id
        self._size += 1
        return None


class ExactIndex:
    """Set of exact-dedup keys (``content_hash``): one 16-byte key per kept document."""

    def __init__(self) -> None:
        self._seen: set[bytes] = set()

    def add(self, key: bytes) -> bool:
        """True (and remembered) if ``key`` is new, False for a duplicate."""
        if key in self._seen:
            return False
        self._seen.add(key)
        return True

    def __len__(self) -> int:
        return len(self._seen)
