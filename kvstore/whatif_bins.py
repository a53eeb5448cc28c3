"""Bins, 2-D CDF interpolation, a Fenwick tree, key hashing and a count-min
sketch for the what-if estimator (``kvstore/whatif.py``)."""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence

import numpy as np

_M64 = 0xFFFFFFFFFFFFFFFF


class Axis:
    """Bins closed on the right, ``(lo, hi]``, so a value exactly on an edge
    (a TTL of 10 s, reuses exactly 10 s apart) counts wholly below it: unit
    bins ``[0, 1], (1, 2], ... (linear-1, linear]``, then log bins growing by
    ``factor``. Positions are fractional bin coordinates (uniform within a
    linear bin, log-uniform within a log bin)."""

    __slots__ = ("_ln", "bins", "edges", "factor", "linear")

    def __init__(self, linear: int, factor: float, top: float) -> None:
        self.linear = linear
        self.factor = factor
        self._ln = math.log(factor)
        self.bins = linear + math.ceil(math.log(top / linear) / self._ln)
        self.edges = np.concatenate([np.arange(linear + 1, dtype=float),
                                     linear * factor ** np.arange(1, self.bins - linear + 1)])

    def bin(self, x: float) -> int:
        if x <= self.linear:
            return max(math.ceil(x) - 1, 0)
        return min(self.linear + math.ceil(math.log(x / self.linear) / self._ln) - 1,
                   self.bins - 1)

    def position(self, x: float) -> float:
        if math.isinf(x) or x != x:
            return float(self.bins)
        if x <= self.linear:
            return max(x, 0.0)
        return min(self.linear + math.log(x / self.linear) / self._ln, float(self.bins))


RT = Axis(linear=128, factor=1.1, top=1e9)     # reuse time, seconds (to ~30 years)
SD = Axis(linear=64, factor=1.1, top=1e13)     # stack distance, tokens
RT_BINS, SD_BINS = RT.bins, SD.bins


def rt_bin(seconds: float) -> int:
    return RT.bin(seconds)


def sd_bin(tokens: float) -> int:
    return SD.bin(tokens)


def rt_position(seconds: float) -> float:
    return RT.position(seconds)


def sd_position(tokens: float) -> float:
    return SD.position(tokens)


def cdf2d(h: np.ndarray) -> np.ndarray:
    """F[i, j] = sum of h[:i, :j]; shape [rows + 1, cols + 1]."""
    f = np.zeros((h.shape[0] + 1, h.shape[1] + 1))
    f[1:, 1:] = h.cumsum(axis=0).cumsum(axis=1)
    return f


def interp2d(f: np.ndarray, p: float, q: float) -> float:
    """The CDF ``f`` (from ``cdf2d``) at fractional bin coordinates, bilinear:
    mass is spread uniformly within each cell."""
    i0, j0 = min(int(p), f.shape[0] - 1), min(int(q), f.shape[1] - 1)
    i1, j1 = min(i0 + 1, f.shape[0] - 1), min(j0 + 1, f.shape[1] - 1)
    a, b = p - i0, q - j0
    return float((1 - a) * (1 - b) * f[i0, j0] + a * (1 - b) * f[i1, j0]
                 + (1 - a) * b * f[i0, j1] + a * b * f[i1, j1])


class FenwickTree:
    """Prefix sums over slots 0..size-1 in O(log n); slots are the order of
    last use, so the sum after a slot is what was used since."""

    __slots__ = ("_t", "size", "total")

    def __init__(self, size: int) -> None:
        self.size = size
        self.total = 0.0
        self._t = [0.0] * (size + 1)

    def add(self, i: int, v: float) -> None:
        t, n = self._t, self.size
        self.total += v
        i += 1
        while i <= n:
            t[i] += v
            i += i & -i

    def prefix(self, i: int) -> float:
        """Sum of slots [0, i)."""
        t, s = self._t, 0.0
        while i > 0:
            s += t[i]
            i -= i & -i
        return s

    def suffix(self, i: int) -> float:
        """Sum of slots [i, size): one walk, not two."""
        return self.total - self.prefix(i) if self.total else 0.0

    def range_sum(self, lo: int, hi: int) -> float:
        """Sum of slots [lo, hi)."""
        return self.prefix(hi) - self.prefix(lo) if hi > lo else 0.0


def hash_keys(keys: Sequence[bytes | int]) -> np.ndarray:
    """A uniform 64-bit hash per block key ([n] uint64). Store keys are
    BLAKE2b already (their first 8 bytes are taken); trace ids are small
    sequential ints, so everything goes through the splitmix64 finaliser."""
    first = keys[0]
    if isinstance(first, bytes | bytearray | memoryview):
        raw = b"".join(bytes(k[:8]) if len(k) >= 16 else
                       hashlib.blake2b(bytes(k), digest_size=8).digest() for k in keys)
        x = np.frombuffer(raw, dtype="<u8").astype(np.uint64)
    else:
        x = np.fromiter((int(k) & _M64 for k in keys), dtype=np.uint64, count=len(keys))
    # Unsigned numpy arithmetic wraps modulo 2**64, as splitmix64 wants.
    x = x + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


class CountMin:
    """Count-min sketch of key uses (4 rows of 4,096 counters): over-counts,
    never under-counts, in fixed memory."""

    __slots__ = ("_rows",)
    DEPTH, WIDTH = 4, 1 << 12

    def __init__(self) -> None:
        self._rows = np.zeros((self.DEPTH, self.WIDTH), dtype=np.int64)

    def add(self, hashes: np.ndarray) -> np.ndarray:
        """Count one use per hash; returns each key's estimate afterwards ([n])."""
        est = None
        for r in range(self.DEPTH):
            cols = ((hashes >> np.uint64(12 * r)) & np.uint64(self.WIDTH - 1)).astype(np.intp)
            np.add.at(self._rows[r], cols, 1)
            v = self._rows[r][cols]
            est = v if est is None else np.minimum(est, v)
        assert est is not None
        return est
