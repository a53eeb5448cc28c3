"""Session-aware hit density: value a session's chain, not a block.

What predicts reuse in prefix-KV traffic (docs/operators.md, "What predicts
reuse"): a block is reused when its session comes back (75% of reuses on the
Mooncake conversation trace, 99.9% on Claude Code sessions), and then the
whole chain up to the new turn hits at once. So the unit of value is the
session: this policy learns, per bucket (traffic class, turns so far: 1, 2,
3-4, 5-8, 9+), the distribution of a session's gaps between requests, and
scores a session idle for ``a`` seconds by its hit density (expected returns
within the horizon per unit of occupancy; LHD, Beckmann et al. NSDI'18, with
the same estimator as ``hit_density``). The victim is the deepest resident
block of the lowest-density session (a chain shrinks from its tail, so what
stays is a usable prefix), and a new block whose session scores below that
victim is not admitted. A session's blocks stay together: the policy evicts
a whole low-value chain before it touches a valuable one, which keeps a stable
set of sessions resident when the cache cannot hold them all (what Belady
does, and LRU's churn does not).

Without ``begin_request`` (the live store's tiers, which see no sessions)
every key is its own session of one turn, and the policy degrades to a
class-aware hit density over blocks.

Replays run a C mirror of this class (native/replaycore.c, ``sd_*``), step for
step and float for float; a change here needs the same change there
(tests/studies/test_sim.py compares the two).
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Sequence
from typing import Any

from kvstore.eviction.base import EvictionPolicy, register_policy
from kvstore.eviction.hit_density import _bin, _Bucket, refresh_buckets

_TURN_BUCKETS = (1, 2, 4, 8)     # turns so far: 1, 2, 3-4, 5-8, 9+
_MIN_STARTS = 8.0                # requests a bucket needs before its own density is used


def _turn_bucket(turns: int) -> int:
    for i, edge in enumerate(_TURN_BUCKETS):
        if turns <= edge:
            return i
    return len(_TURN_BUCKETS)


class _Session:
    __slots__ = ("bucket", "cls", "last", "stack", "turns")

    def __init__(self, cls: str) -> None:
        self.cls = cls
        self.turns = 0
        self.last = 0.0
        self.bucket: _Bucket | None = None
        # Max-heap of resident keys by depth (-depth, seq, key); stale entries skipped.
        self.stack: list[tuple[int, int, Any]] = []


@register_policy("session_density")
class SessionDensity(EvictionPolicy):
    def __init__(self, refresh_every: int = 500, half_life: int = 50_000,
                 quantile: float = 0.9) -> None:
        if not 0.0 < quantile <= 1.0:
            raise ValueError(f"quantile must be in (0, 1], got {quantile}")
        self._quantile = quantile
        self._buckets: dict[tuple[str, int], _Bucket] = {}
        self._sessions: dict[str, _Session] = {}
        self._owner: dict[Any, _Session] = {}     # resident key -> its session
        self._holding: dict[_Session, int] = {}   # session -> resident keys it owns
        self._current: _Session | None = None     # the session of the request being served
        self._low: tuple[float, _Session] | None = None   # _lowest() of this request
        self._events = 0
        self._next_refresh = 16
        self._last_decay = 0
        self._refresh_every = refresh_every
        self._half_life = half_life
        self._now = 0.0
        self._anon = 0
        self._depth: dict[Any, int] = {}          # this request's keys -> position
        self._seq = itertools.count()

    # ------------------------------------------------------------ learning
    def _bucket(self, cls: str, turns: int) -> _Bucket:
        key = (cls, _turn_bucket(turns))
        b = self._buckets.get(key)
        if b is None:
            b = self._buckets[key] = _Bucket()
        return b

    def begin_request(self, session: str, keys: Sequence[Any], now: float, cls: str) -> None:
        """A request of ``session`` arrives: one session-level use (its gap since
        the session's previous request is one reuse time of its bucket)."""
        self._now = max(self._now, now)
        s = self._sessions.get(session)
        if s is None:
            s = self._sessions[session] = _Session(cls)
        elif s.bucket is not None:
            s.bucket.reuses[_bin(now - s.last)] += 1.0
        s.turns += 1
        s.last = now
        s.cls = cls or s.cls
        s.bucket = self._bucket(s.cls, s.turns)
        s.bucket.starts += 1.0
        self._current = s
        self._depth = {k: j for j, k in enumerate(keys)}
        self._low = None
        self._events += 1
        if self._events >= self._next_refresh:
            self._next_refresh = self._events + min(self._events, self._refresh_every)
            self._refresh()

    def _refresh(self) -> None:
        self._last_decay = refresh_buckets(self._buckets.values(), self._events,
                                           self._last_decay, self._half_life, self._quantile)

    def _density(self, s: _Session) -> float:
        b = s.bucket
        if b is None:
            return 0.0
        # A bucket with too little history borrows the nearest fewer-turns one:
        # a session just past a bucket edge behaves like it did a turn ago.
        tb = _turn_bucket(s.turns)
        while b.starts < _MIN_STARTS and tb > 0:
            tb -= 1
            b = self._buckets.get((s.cls, tb), b)
        return float(b.density[_bin(self._now - s.last)])

    # ------------------------------------------------------------ interface
    def _session_of(self, key: Any, now: float, cls: str) -> _Session:
        s = self._current
        if s is None:   # no request context (live tiers): the key is a session of its own
            self._anon += 1
            self.begin_request(f"\0{self._anon}", (key,), now, cls)
            s = self._current
            self._current = None
            assert s is not None
        return s

    def insert(self, key: Any, size: int, now: float, cls: str = "") -> None:
        self._now = max(self._now, now)
        s = self._session_of(key, now, cls)
        self._own(key, s)
        heapq.heappush(s.stack, (-self._depth.get(key, 0), next(self._seq), key))

    def touch(self, key: Any, now: float) -> None:
        self._now = max(self._now, now)
        s = self._current
        old = self._owner.get(key)
        if s is None or old is None or old is s:
            return
        # A shared block (a system prompt) now belongs to the session using it.
        self._own(key, s)
        heapq.heappush(s.stack, (-self._depth.get(key, 0), next(self._seq), key))

    def _own(self, key: Any, s: _Session) -> None:
        old = self._owner.get(key)
        if old is not None:
            self._disown(old)
        self._owner[key] = s
        self._holding[s] = self._holding.get(s, 0) + 1

    def _disown(self, s: _Session) -> None:
        n = self._holding[s] - 1
        if n:
            self._holding[s] = n
        else:
            del self._holding[s]
            s.stack.clear()
            if self._low is not None and self._low[1] is s:
                self._low = None

    def remove(self, key: Any) -> None:
        s = self._owner.pop(key, None)
        if s is not None:
            self._disown(s)

    def _top(self, s: _Session) -> Any | None:
        st = s.stack
        while st:
            k = st[0][2]
            if self._owner.get(k) is s:
                return k
            heapq.heappop(st)
        return None

    def _lowest(self) -> tuple[float, _Session]:
        """The lowest-density session holding blocks (not the one being served,
        unless it is the only one); fixed for the rest of this request."""
        if self._low is not None:
            return self._low
        best: tuple[float, float, _Session] | None = None
        for s in self._holding:
            if s is self._current:
                continue
            cand = (self._density(s), s.last, s)
            if best is None or cand[:2] < best[:2]:
                best = cand
        if best is None:
            cur = self._current
            if cur is not None and cur in self._holding:
                return self._density(cur), cur
            raise LookupError("eviction requested from an empty cache")
        if len(self._sessions) > 4 * max(len(self._holding), 1024):
            # bounded memory: forget sessions that hold nothing (they restart at turn 1)
            self._sessions = {n: x for n, x in self._sessions.items()
                              if x in self._holding or x is self._current}
        self._low = (best[0], best[2])
        return self._low

    def victim(self) -> Any:
        _, s = self._lowest()
        k = self._top(s)
        assert k is not None
        return k

    def bypass_when_full(self, key: Any) -> bool:
        s = self._current
        if s is None or not self._owner:
            return False
        try:
            low, _ = self._lowest()
        except LookupError:
            return False
        return self._density(s) < low
