"""Class-aware hit density: value a block by its learned chance of reuse.

Blocks fall into buckets by (traffic class, uses so far: 1, 2, 3, 4+). Per
bucket the policy learns, online, the distribution of reuse times (time
between consecutive uses) on log-spaced bins. From it, for a block idle for
``a`` seconds, it estimates the *hit density* (after LHD, Beckmann et al.,
NSDI'18): expected reuses within the horizon divided by the expected
space-time the block will occupy until then. Agent blocks of a live session
(reused within seconds) score high; chat blocks that were used once and went
quiet score low, however recent. The victim is the lowest-density block
among each bucket's least recently used one; a new block whose density is
below every resident's is not admitted at all (most blocks are never reused).

The horizon is the bucket's own 90th percentile of reuse times: keeping a
block that long catches most of its reuses, and a never-reused block is
charged that long. Keys evicted or refused are remembered (bounded ghost)
so their use counts and reuse times keep being learned whatever the policy
evicts.

Replays run a C mirror of this class (native/replaycore.c, ``hd_*``), step for
step and float for float; a change here needs the same change there
(tests/studies/test_sim.py compares the two).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Iterable
from typing import Any

import numpy as np

from kvstore.eviction.base import EvictionPolicy, register_policy
from kvstore.eviction.prefix_lru import RecencyStacks

_MAX_USES = 4
_BIN0_S = 0.5           # bin 0 is [0, 0.5 s); bin k covers [0.5*f^(k-1), 0.5*f^k)
_FACTOR = 1.6
_BINS = 40              # up to ~0.5 * 1.6^39 ~ 4e7 s
_LN_FACTOR = math.log(_FACTOR)
_EDGES = np.concatenate([[0.0], _BIN0_S * _FACTOR ** np.arange(_BINS)])   # [_BINS + 1]
_WIDTHS = np.diff(_EDGES)


def _bin(age: float) -> int:
    if age < _BIN0_S:
        return 0
    return min(int(math.log(age / _BIN0_S) / _LN_FACTOR) + 1, _BINS - 1)


class _Bucket:
    __slots__ = ("density", "lru", "reuses", "starts")

    def __init__(self) -> None:
        self.lru = RecencyStacks()
        self.reuses = np.zeros(_BINS)      # reuse intervals seen, by bin
        self.starts = 0.0                  # idle periods begun
        self.density = np.zeros(_BINS)     # by starting age bin

    def refresh(self, quantile: float) -> None:
        r = self.reuses
        # Every step below is elementwise IEEE arithmetic or a sequential
        # cumsum (np.add.accumulate), never a pairwise reduction such as
        # r.sum(): native/replaycore.c (hd_refresh) repeats the same float64
        # operations in the same order, so both replays make the same decisions.
        cum = np.cumsum(r)
        total = float(cum[-1])
        if self.starts <= 0 or total <= 0:
            self.density[:] = 0.0
            return
        # Horizon: the bucket's own reuse-time quantile. A block kept that long
        # would have caught most of its reuses; the ones after do not pay rent.
        horizon = _EDGES[1 + int(np.searchsorted(cum, quantile * total))]
        # Periods still idle at each bin's start; never-reused ones stay idle.
        alive = self.starts - np.concatenate([[0.0], cum[:-1]])
        occupancy = np.maximum(alive - r / 2, 0.0) * _WIDTHS
        hits_c = np.concatenate([[0.0], cum])
        occ_c = np.concatenate([[0.0], np.cumsum(occupancy)])
        end = np.searchsorted(_EDGES, _EDGES[:-1] + horizon, side="right")
        end = np.clip(end, np.arange(_BINS) + 1, _BINS)
        occ = occ_c[end] - occ_c[:-1]
        self.density = np.where(occ > 0, (hits_c[end] - hits_c[:-1]) / np.maximum(occ, 1e-12),
                                0.0)


def refresh_buckets(buckets: Iterable[_Bucket], events: int, last_decay: int,
                    half_life: int, quantile: float) -> int:
    """Halve every bucket's counts once per ``half_life`` events (old traffic fades),
    then recompute each bucket's densities; returns the new last-decay event."""
    buckets = list(buckets)
    if events - last_decay >= half_life:
        last_decay = events
        for b in buckets:
            b.reuses *= 0.5
            b.starts *= 0.5
    for b in buckets:
        b.refresh(quantile)
    return last_decay


@register_policy("hit_density")
class HitDensity(EvictionPolicy):
    def __init__(self, refresh_every: int = 2_000, half_life: int = 200_000,
                 ghost_factor: float = 2.0, quantile: float = 0.9) -> None:
        if not 0.0 < quantile <= 1.0:
            raise ValueError(f"quantile must be in (0, 1], got {quantile}")
        self._quantile = quantile
        self._buckets: dict[tuple[str, int], _Bucket] = {}
        self._state: dict[Any, tuple[float, int, str]] = {}   # key -> (last use, uses, class)
        self._where: dict[Any, _Bucket] = {}                  # resident key -> its bucket
        self._ghost: OrderedDict[Any, None] = OrderedDict()
        self._ghost_factor = ghost_factor
        self._events = 0
        self._next_refresh = 64
        self._last_decay = 0
        self._refresh_every = refresh_every
        self._half_life = half_life
        self._now = 0.0

    # ------------------------------------------------------------ learning
    def _bucket(self, cls: str, uses: int) -> _Bucket:
        key = (cls, min(uses, _MAX_USES))
        b = self._buckets.get(key)
        if b is None:
            b = self._buckets[key] = _Bucket()
        return b

    def _use(self, key: Any, now: float, cls: str | None) -> _Bucket:
        """Record one use of ``key``; returns the bucket it now belongs to."""
        self._now = max(self._now, now)
        prev = self._state.get(key)
        if prev is not None:
            last, uses, old_cls = prev
            self._bucket(old_cls, uses).reuses[_bin(now - last)] += 1.0
            cls = cls or old_cls
        else:
            uses, cls = 0, cls or ""
        uses += 1
        self._state[key] = (now, uses, cls)
        b = self._bucket(cls, uses)
        b.starts += 1.0
        self._events += 1
        if self._events >= self._next_refresh:
            # Early on, refresh at doubling intervals so the policy learns fast.
            self._next_refresh = self._events + min(self._events, self._refresh_every)
            self._refresh()
        return b

    def _refresh(self) -> None:
        self._last_decay = refresh_buckets(self._buckets.values(), self._events,
                                           self._last_decay, self._half_life, self._quantile)

    def _score(self, key: Any, b: _Bucket) -> float:
        return float(b.density[_bin(self._now - self._state[key][0])])

    # ------------------------------------------------------------ interface
    def admit(self, key: Any, size: int, now: float, cls: str = "") -> bool:
        self._ghost.pop(key, None)
        self._use(key, now, cls)
        return True

    def insert(self, key: Any, size: int, now: float, cls: str = "") -> None:
        if key not in self._state:          # inserted without admit (not via CapacityCache)
            self._use(key, now, cls)
        t, uses, c = self._state[key]
        b = self._bucket(c, uses)
        b.lru.push(key, t)
        self._where[key] = b

    def touch(self, key: Any, now: float) -> None:
        old = self._where.get(key)
        if old is None:
            return
        old.lru.discard(key)
        b = self._use(key, now, None)
        b.lru.push(key, now)
        self._where[key] = b

    def remove(self, key: Any) -> None:
        b = self._where.pop(key, None)
        if b is None:
            return
        b.lru.discard(key)
        self._forget_later(key)

    def _forget_later(self, key: Any) -> None:
        self._ghost[key] = None
        limit = int(self._ghost_factor * max(len(self._where), 1024))
        while len(self._ghost) > limit:
            old, _ = self._ghost.popitem(last=False)
            self._state.pop(old, None)

    def _lowest(self) -> tuple[float, Any]:
        best: tuple[float, float, Any] | None = None
        for b in self._buckets.values():
            head = b.lru.head()
            if head is not None:
                key, t = head
                # Lowest density first; among equals, the longest idle.
                cand = (self._score(key, b), t, key)
                if best is None or cand[:2] < best[:2]:
                    best = cand
        if best is None:
            raise LookupError("eviction requested from an empty cache")
        return best[0], best[2]

    def victim(self) -> Any:
        return self._lowest()[1]

    def bypass_when_full(self, key: Any) -> bool:
        if key in self._where or not self._where:
            return False
        _, uses, cls = self._state[key]
        mine = float(self._bucket(cls, uses).density[0])
        if mine < self._lowest()[0]:
            self._forget_later(key)
            return True
        return False
