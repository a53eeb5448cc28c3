"""Log-spaced bins, 2-D CDF interpolation and a Fenwick tree for the what-if
estimator (``kvstore/whatif.py``)."""

from __future__ import annotations

import math

import numpy as np


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

    __slots__ = ("_t", "size")

    def __init__(self, size: int) -> None:
        self.size = size
        self._t = [0.0] * (size + 1)

    def add(self, i: int, v: float) -> None:
        t, n = self._t, self.size
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

    def range_sum(self, lo: int, hi: int) -> float:
        """Sum of slots [lo, hi)."""
        return self.prefix(hi) - self.prefix(lo) if hi > lo else 0.0
