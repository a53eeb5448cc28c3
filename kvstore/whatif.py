"""Live what-if: predict the hit rate at other TTLs and capacities from the
traffic the store sees, without a replay.

For each use of a block the estimator measures, per traffic class:
- its **reuse time** (seconds since that block's previous use), and
- its **stack distance** (tokens of distinct blocks used since then, itself
  included): under LRU the block is still resident iff that is <= capacity.

Both go into one 2-D histogram (log-spaced bins on each axis), so a
combined prediction is one lookup: a use hits iff reuse time <= TTL (TTLs
refresh on every use) and stack distance <= capacity. Approximations:
- capacity is LRU's (another policy does better or worse; the replay says
  by how much), and it ignores the room TTL expiry frees, so where both
  limits bind the prediction is slightly low;
- it counts block hits, not prefix hits (a block counts even if an earlier
  block of its request missed); with prefix-hash keys the two agree except
  at the capacity boundary, where LRU drops a chain's root a block earlier;
- within a bin, log-uniform interpolation.

Memory is bounded by SHARDS-style spatial sampling (Waldspurger et al.,
FAST'15): a block is tracked iff hash(key) < threshold; when more than
``max_tracked`` blocks are tracked the threshold drops to shed the highest
hashes. Sampled uses count 1/rate. Hot keys (shared system prompts, used by
nearly every request) would make that estimate swing by whole percent
depending on whether they were sampled, so a key a count-min sketch sees
used ``hot_uses`` times and for at least ``hot_share`` of all uses is
tracked exactly (weight 1) from then on.

Bytes stored are estimated by Little's law: a use of a block keeps it
resident for min(gap to its next use, TTL) (or until the end), so the mean
bytes = sum of those spans x bytes / duration; the peak is the largest such
mean over time windows (at most ``_WINDOWS`` of them, coarsened by doubling).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from common.traces import Trace
from kvstore.whatif_bins import (
    RT_BINS,
    SD_BINS,
    CountMin,
    FenwickTree,
    cdf2d,
    hash_keys,
    interp2d,
    rt_bin,
    rt_position,
    sd_bin,
    sd_position,
)

_HASH_SPACE = 1 << 32
_WINDOWS = 64
_FORMAT = 1


@dataclass(frozen=True, slots=True)
class WhatIfRow:
    """One prediction; the same keys as ``kvserve ttl-sweep --json`` rows."""

    cls: str
    ttl_s: float
    capacity_tokens: float
    policy: str
    hit_rate: float
    token_hit_rate: float
    bytes_peak: float
    bytes_mean: float
    # Estimator error bound on hit_rate, for the traffic seen (0 for replays):
    # the mass in the histogram cells the (TTL, capacity) point cuts through
    # (interpolated, so the truth lies between the cells' edges) plus two
    # standard errors of the SHARDS sample. It does not cover drift: future
    # traffic unlike the past (docs/operators.md, "The live what-if").
    hit_rate_bound: float = 0.0

    def as_json(self) -> dict[str, Any]:
        # JSON has no infinity: an unlimited TTL or capacity is null.
        doc = {"class": self.cls, "ttl_s": None if math.isinf(self.ttl_s) else self.ttl_s,
               "capacity_tokens": (None if math.isinf(self.capacity_tokens)
                                   else self.capacity_tokens),
               "policy": self.policy, "hit_rate": self.hit_rate,
               "token_hit_rate": self.token_hit_rate, "bytes_peak": self.bytes_peak,
               "bytes_mean": self.bytes_mean}
        if self.policy == "lru" and type(self) is WhatIfRow:
            doc["hit_rate_bound"] = self.hit_rate_bound
        return doc


class _ClassHist:
    """Per class: uses (exact), and sampled reuses by (reuse time, distance).
    Updates collect in a dict and reach the arrays in bulk: a numpy item
    update costs about a microsecond, a dict update a tenth of that."""

    __slots__ = ("_block", "_pending", "_token", "blocks", "tokens")

    def __init__(self) -> None:
        self.blocks = 0.0
        self.tokens = 0.0
        self._block = np.zeros((RT_BINS, SD_BINS))   # [reuse-time bin, distance bin]
        self._token = np.zeros((RT_BINS, SD_BINS))
        self._pending: dict[tuple[int, int], list[float]] = {}

    def add(self, r: int, d: int, w: float, tokens: int) -> None:
        acc = self._pending.get((r, d))
        if acc is None:
            self._pending[(r, d)] = [w, w * tokens]
        else:
            acc[0] += w
            acc[1] += w * tokens

    def _flush(self) -> None:
        for (r, d), (b, t) in self._pending.items():
            self._block[r, d] += b
            self._token[r, d] += t
        self._pending.clear()

    @property
    def block_hits(self) -> np.ndarray:
        self._flush()
        return self._block

    @property
    def token_hits(self) -> np.ndarray:
        self._flush()
        return self._token


class _Windows:
    """Residency spans (for bytes), by the window in which each span began."""

    __slots__ = ("_count", "_gap_sum", "_pending", "t0", "width")

    def __init__(self, t0: float, width: float) -> None:
        self.t0 = t0
        self.width = width
        self._gap_sum = np.zeros((_WINDOWS, RT_BINS))   # token-seconds of closed spans
        self._count = np.zeros((_WINDOWS, RT_BINS))     # tokens of closed spans
        self._pending: dict[tuple[int, int], list[float]] = {}

    def add(self, t: float, r: int, tokens: float, gap: float) -> None:
        key = (self.index(t), r)
        acc = self._pending.get(key)
        if acc is None:
            self._pending[key] = [tokens * gap, tokens]
        else:
            acc[0] += tokens * gap
            acc[1] += tokens

    def _flush(self) -> None:
        for (i, r), (g, c) in self._pending.items():
            self._gap_sum[i, r] += g
            self._count[i, r] += c
        self._pending.clear()

    @property
    def gap_sum(self) -> np.ndarray:
        self._flush()
        return self._gap_sum

    @property
    def count(self) -> np.ndarray:
        self._flush()
        return self._count

    def load(self, count: np.ndarray, gap_sum: np.ndarray) -> None:
        self._pending.clear()
        self._count, self._gap_sum = count, gap_sum

    def index(self, t: float) -> int:
        i = int((t - self.t0) // self.width)
        if i >= _WINDOWS:
            self._flush()
        while i >= _WINDOWS:
            # Coarsen: pairs of windows merge, the width doubles.
            g, c, half = self._gap_sum, self._count, np.zeros((_WINDOWS // 2, RT_BINS))
            self._gap_sum = np.concatenate([g[0::2] + g[1::2], half])
            self._count = np.concatenate([c[0::2] + c[1::2], half.copy()])
            self.width *= 2
            i = int((t - self.t0) // self.width)
        return max(i, 0)


class WhatIfEstimator:
    """Kept by the running store (one per store, classes inside)."""

    def __init__(self, *, max_tracked: int = 65_536, hot_uses: int = 256,
                 hot_share: float = 1e-3, max_hot: int = 1_024,
                 window_s: float = 60.0) -> None:
        if max_tracked < 16:
            raise ValueError(f"max_tracked must be >= 16, got {max_tracked}")
        if window_s <= 0:
            raise ValueError(f"window_s must be > 0, got {window_s}")
        self.max_tracked = max_tracked
        self.hot_uses = hot_uses
        self.hot_share = hot_share
        self._records = 0
        self.max_hot = max_hot
        self.threshold = _HASH_SPACE               # sample iff hash < threshold
        self.classes: dict[str, _ClassHist] = {}
        self.uncacheable: dict[str, list[float]] = {}   # cls -> [blocks, tokens] never storable
        # key -> [last use, slot, tokens, hot (exact, weight 1) or sampled (1/rate), hash >> 32]
        self._tracked: dict[Any, list[Any]] = {}
        self._sampled = 0
        slots = 4 * (max_tracked + max_hot) + 16
        self._fen_sampled = FenwickTree(slots)     # tokens of sampled keys, by last-use slot
        self._fen_hot = FenwickTree(slots)         # tokens of exact (hot) keys
        self._slot = 0
        self._cms = CountMin()                     # uses per key, to find hot keys
        self._hot = 0
        self._window_s = window_s
        self._win: _Windows | None = None
        self.t_first: float | None = None
        self.t_last = 0.0
        self._frozen_open: np.ndarray | None = None    # open spans, from from_json

    @property
    def rate(self) -> float:
        return self.threshold / _HASH_SPACE

    # ------------------------------------------------------------ recording
    def record(self, block_key: bytes | int, now: float, cls: str, tokens: int) -> None:
        """One use of a stored block by a request of class ``cls``."""
        self.record_many((block_key,), now, cls, tokens)

    def record_many(self, keys: Sequence[bytes | int], now: float, cls: str,
                    tokens: int) -> None:
        """Uses of several blocks at once (a lookup's chain, in order): one
        vectorised hash and sketch pass; only sampled or hot keys cost more."""
        n = len(keys)
        if n == 0:
            return
        st = self.classes.get(cls)
        if st is None:
            st = self.classes[cls] = _ClassHist()
        st.blocks += n
        st.tokens += n * tokens
        self._records += n
        if self.t_first is None:
            self.t_first = now
            self._win = _Windows(now, self._window_s)
        if now > self.t_last:
            self.t_last = now
        hashes = hash_keys(keys)                              # [n] uint64
        high = (hashes >> np.uint64(32)).tolist()
        hot_at = max(self.hot_uses, self.hot_share * self._records)
        hot = (self._cms.add(hashes) >= hot_at).tolist()
        threshold, tracked = self.threshold, self._tracked
        for i, key in enumerate(keys):
            if high[i] < threshold or hot[i] or key in tracked:
                self._use(key, now, st, tokens, high[i], hot[i])
                threshold = self.threshold      # _use may shed half the sample

    def _use(self, block_key: Any, now: float, st: _ClassHist, tokens: int, h32: int,
             looks_hot: bool) -> None:
        entry = self._tracked.get(block_key)
        can_promote = looks_hot and self._hot < self.max_hot
        if entry is None:
            if h32 >= self.threshold and not can_promote:
                return
            self._hot += can_promote
            self._sampled += not can_promote
            entry = self._tracked[block_key] = [now, -1, tokens, can_promote, h32]
            self._place(entry)
            self._shed()
            return
        last, slot, old_tokens, hot, _ = entry
        if not hot and can_promote:
            self._fen_sampled.add(slot, -old_tokens)    # promote: exact from now on
            self._fen_hot.add(slot, old_tokens)
            hot = entry[3] = True
            self._hot += 1
            self._sampled -= 1
        gap = max(now - last, 0.0)
        w = 1.0 if hot else 1.0 / self.rate
        # Distinct tokens used since the last use, itself included.
        # (slots after the newest are empty, so a suffix sum is "since then")
        dist = (self._fen_sampled.suffix(slot + 1) / self.rate
                + self._fen_hot.suffix(slot + 1) + tokens)
        r = rt_bin(gap)
        st.add(r, sd_bin(dist), w, tokens)
        assert self._win is not None
        self._win.add(last, r, w * old_tokens, gap)
        (self._fen_hot if hot else self._fen_sampled).add(slot, -old_tokens)
        entry[0], entry[1], entry[2] = now, -1, tokens
        self._place(entry)

    def record_uncacheable(self, cls: str, blocks: int, tokens: int) -> None:
        """Looked-up blocks that can never be stored (a partial tail): misses."""
        acc = self.uncacheable.setdefault(cls, [0.0, 0.0])
        acc[0] += blocks
        acc[1] += tokens

    def _place(self, entry: list[Any]) -> None:
        if self._slot >= self._fen_sampled.size:
            self._compact()
        entry[1] = self._slot
        (self._fen_hot if entry[3] else self._fen_sampled).add(self._slot, entry[2])
        self._slot += 1

    def _compact(self) -> None:
        """Renumber slots densely in last-use order once they run out."""
        order = sorted((e for e in self._tracked.values() if e[1] >= 0), key=lambda e: e[1])
        size = self._fen_sampled.size
        self._fen_sampled, self._fen_hot = FenwickTree(size), FenwickTree(size)
        for i, entry in enumerate(order):
            entry[1] = i
            (self._fen_hot if entry[3] else self._fen_sampled).add(i, entry[2])
        self._slot = len(order)

    def _shed(self) -> None:
        if self._sampled <= self.max_tracked:
            return
        hashes = sorted(e[4] for e in self._tracked.values() if not e[3])
        # Keep the lower half of the sampled hashes: the rate halves.
        self.threshold = hashes[len(hashes) // 2]
        for key in [k for k, e in self._tracked.items() if not e[3] and e[4] >= self.threshold]:
            entry = self._tracked.pop(key)
            self._fen_sampled.add(entry[1], -entry[2])
            self._sampled -= 1

    # ------------------------------------------------------------ predicting
    def _open_spans(self) -> np.ndarray:
        """[window, age bin] tokens of spans still open (blocks not used since)."""
        if self._frozen_open is not None:
            return self._frozen_open
        out = np.zeros((_WINDOWS, RT_BINS, 2))     # [..., (tokens, token-seconds)]
        if self._win is None:
            return out
        for last, _, tokens, hot, _ in self._tracked.values():
            w = 1.0 if hot else 1.0 / self.rate
            age = self.t_last - last
            i, b = self._win.index(last), rt_bin(age)
            out[i, b, 0] += w * tokens
            out[i, b, 1] += w * tokens * age
        return out

    def predict(self, ttls: Iterable[float], capacities: Iterable[float | None], *,
                kv_bytes_per_token: int = 327_680,
                classes: Sequence[str] | None = None) -> list[WhatIfRow]:
        """Rows for every class and ``all``, per TTL x capacity (tokens; None/inf
        = unlimited). ``policy`` is "lru": the stack distances are LRU's."""
        ttl_list = [math.inf if t is None else float(t) for t in ttls]
        cap_list = [math.inf if c is None else float(c) for c in capacities]
        names = sorted(self.classes) if classes is None else list(classes)
        cdfs = {c: (cdf2d(self.classes[c].block_hits), cdf2d(self.classes[c].token_hits))
                for c in names if c in self.classes}
        rows: list[WhatIfRow] = []
        for ttl in ttl_list:
            mean_b, peak_b = self._bytes(ttl, kv_bytes_per_token)
            for cap in cap_list:
                tp, cp = rt_position(ttl), sd_position(cap)
                cap_bytes = cap * kv_bytes_per_token
                mean = min(mean_b, cap_bytes)
                peak = min(peak_b, cap_bytes)
                tot = [0.0, 0.0, 0.0, 0.0]
                spread = var = 0.0
                for c in names:
                    hb, ht, nb, nt = self._class_totals(c, cdfs, tp, cp)
                    tot = [tot[0] + hb, tot[1] + ht, tot[2] + nb, tot[3] + nt]
                    cs, cv = self._cell_error(c, cdfs, tp, cp, _ratio(hb, nb))
                    spread += cs
                    var += cv
                    rows.append(WhatIfRow(c, ttl, cap, "lru", _ratio(hb, nb), _ratio(ht, nt),
                                          peak, mean, _bound(cs, cv, nb)))
                rows.append(WhatIfRow("all", ttl, cap, "lru", _ratio(tot[0], tot[2]),
                                      _ratio(tot[1], tot[3]), peak, mean,
                                      _bound(spread, var, tot[2])))
        return rows

    def _cell_error(self, c: str, cdfs: Mapping[str, tuple[Any, Any]], tp: float,
                    cp: float, p: float) -> tuple[float, float]:
        """(hit blocks the interpolation could misplace, sampling variance in
        blocks^2) for class ``c`` at bin position (tp, cp)."""
        st = self.classes.get(c)
        if st is None:
            return 0.0, 0.0
        f = cdfs[c][0]
        lo = interp2d(f, math.floor(tp), math.floor(cp))
        hi = interp2d(f, math.ceil(tp), math.ceil(cp))
        n_eff = max(st.blocks * min(self.rate, 1.0), 1.0)
        return max(hi - lo, 0.0), p * (1 - p) / n_eff * st.blocks ** 2

    def _class_totals(self, c: str, cdfs: Mapping[str, tuple[Any, Any]], tp: float,
                      cp: float) -> tuple[float, float, float, float]:
        un = self.uncacheable.get(c, [0.0, 0.0])
        st = self.classes.get(c)
        if st is None:
            return 0.0, 0.0, un[0], un[1]
        hb = min(interp2d(cdfs[c][0], tp, cp), st.blocks)
        ht = min(interp2d(cdfs[c][1], tp, cp), st.tokens)
        return hb, ht, st.blocks + un[0], st.tokens + un[1]

    def _bytes(self, ttl: float, kv_bytes_per_token: int) -> tuple[float, float]:
        if self._win is None or self.t_first is None:
            return 0.0, 0.0
        span = max(self.t_last - self.t_first, 1e-9)
        tp = rt_position(ttl)
        full, frac = int(tp), tp - int(tp)     # bins wholly below the TTL; share of the next
        win, opened = self._win, self._open_spans()
        # A span lasts its gap if that is within the TTL, else the TTL.
        resid = win.gap_sum[:, :full].sum(axis=1) + opened[:, :full, 1].sum(axis=1)
        if full < RT_BINS:
            cap = min(ttl, span)
            resid = resid + frac * (win.gap_sum[:, full] + opened[:, full, 1])
            resid = resid + (1 - frac) * cap * (win.count[:, full] + opened[:, full, 0])
            resid = resid + cap * (win.count[:, full + 1:].sum(axis=1)
                                   + opened[:, full + 1:, 0].sum(axis=1))
        mean = float(resid.sum()) / span * kv_bytes_per_token
        windows = max(1, min(_WINDOWS, math.ceil(span / win.width)))
        width = min(win.width, span)
        peak = float(resid[:windows].max()) / width * kv_bytes_per_token
        return mean, max(peak, mean)

    # ------------------------------------------------------------ export
    def to_json(self) -> str:
        classes = {}
        for c, st in self.classes.items():
            nz = np.nonzero(st.block_hits)
            classes[c] = {"blocks": st.blocks, "tokens": st.tokens,
                          "cells": [[int(i), int(j), float(st.block_hits[i, j]),
                                     float(st.token_hits[i, j])] for i, j in zip(*nz, strict=True)]}
        win = self._win
        doc: dict[str, Any] = {
            "format": _FORMAT, "rate": self.rate, "tracked": len(self._tracked),
            "t_first": self.t_first, "t_last": self.t_last, "classes": classes,
            "uncacheable": self.uncacheable,
        }
        if win is not None:
            opened = self._open_spans()
            doc["windows"] = {"t0": win.t0, "width": win.width,
                              "closed": _sparse3(np.stack([win.count, win.gap_sum], axis=-1)),
                              "open": _sparse3(opened)}
        return json.dumps(doc, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> WhatIfEstimator:
        try:
            doc = json.loads(text)
            if doc.get("format") != _FORMAT:
                raise ValueError(f"unknown what-if format {doc.get('format')!r}")
            est = cls()
            est.threshold = round(float(doc["rate"]) * _HASH_SPACE)
            est.t_first, est.t_last = doc["t_first"], float(doc["t_last"])
            for c, d in doc["classes"].items():
                st = est.classes[c] = _ClassHist()
                st.blocks, st.tokens = float(d["blocks"]), float(d["tokens"])
                for i, j, b, t in d["cells"]:
                    st.add(int(i), int(j), float(b), 0)
                    st.token_hits[int(i), int(j)] = float(t)
            est.uncacheable = {c: [float(v[0]), float(v[1])]
                               for c, v in doc.get("uncacheable", {}).items()}
            if "windows" in doc:
                w = doc["windows"]
                est._win = _Windows(float(w["t0"]), float(w["width"]))
                closed = _dense3(w["closed"], (_WINDOWS, RT_BINS, 2))
                est._win.load(closed[..., 0].copy(), closed[..., 1].copy())
                est._frozen_open = _dense3(w["open"], (_WINDOWS, RT_BINS, 2))
        except (KeyError, TypeError, IndexError, json.JSONDecodeError) as exc:
            raise ValueError(f"not a what-if estimator state: {exc!r}") from None
        return est


def _bound(spread: float, var: float, n: float) -> float:
    """Cell spread plus two standard errors, as a fraction of ``n`` blocks."""
    if n <= 0:
        return 0.0
    return min(1.0, (spread + 2.0 * math.sqrt(var)) / n)


def _ratio(a: float, b: float) -> float:
    return a / b if b > 0 else 0.0


def _sparse3(a: np.ndarray) -> list[list[float]]:
    nz = np.nonzero(a.any(axis=-1))
    return [[int(i), int(j), *map(float, a[i, j])] for i, j in zip(*nz, strict=True)]


def _dense3(cells: list[list[float]], shape: tuple[int, int, int]) -> np.ndarray:
    out = np.zeros(shape)
    for i, j, *vals in cells:
        out[int(i), int(j)] = vals
    return out


def fit_trace(trace: Trace, *, estimator: WhatIfEstimator | None = None,
              cache_partial: bool = False) -> WhatIfEstimator:
    """Feed a trace to an estimator as the store would see it: each request's
    storable blocks are used (recorded), its partial tail only looked up."""
    est = estimator if estimator is not None else WhatIfEstimator()
    bt = trace.block_tokens
    for r in trace.requests:
        ids = r.hash_ids
        n = len(ids) if cache_partial else min(len(ids), r.input_length // bt)
        est.record_many(ids[:n], r.t, r.traffic_class, bt)
        rest = r.input_length - n * bt
        if len(ids) > n or rest > 0:
            est.record_uncacheable(r.traffic_class, len(ids) - n, max(rest, 0))
    return est
