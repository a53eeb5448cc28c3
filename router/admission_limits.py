"""Per-API-key limits of the admission layer, and its wait estimate.

``TokenBucket``: a key's request rate (``rate`` per second, up to ``burst``
at once). ``KeyLimits`` holds one bucket and the in-service / waiting counts
per key, created on first use and forgotten when idle and full again, so the
table stays as small as the set of active keys. ``DrainRate`` measures how
fast the queue drains (prompt tokens dispatched per second while a backlog
lasted), from which a new request's wait is estimated.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field


@dataclass(slots=True)
class TokenBucket:
    rate: float                     # tokens per second; 0 = unlimited
    burst: int
    level: float = -1.0             # -1: full (set on first use)
    at: float = 0.0

    def take(self, now: float) -> float:
        """Take one token: 0.0 when taken, else the seconds until one is there."""
        if self.rate <= 0:
            return 0.0
        if self.level < 0:
            self.level, self.at = float(self.burst), now
        self.level = min(float(self.burst), self.level + (now - self.at) * self.rate)
        self.at = now
        if self.level >= 1.0:
            self.level -= 1.0
            return 0.0
        return (1.0 - self.level) / self.rate

    def full(self, now: float) -> bool:
        return self.rate <= 0 or self.level < 0 or (
            self.level + (now - self.at) * self.rate >= self.burst)


@dataclass(slots=True)
class KeyState:
    bucket: TokenBucket
    in_service: int = 0
    waiting: int = 0


@dataclass(slots=True)
class KeyLimits:
    rate: float
    burst: int
    max_concurrency: int            # 0 = unlimited
    max_waiting: int
    _keys: dict[str, KeyState] = field(default_factory=dict)

    def state(self, key: str) -> KeyState:
        st = self._keys.get(key)
        if st is None:
            st = self._keys[key] = KeyState(TokenBucket(self.rate, self.burst))
        return st

    def may_start(self, key: str) -> bool:
        st = self._keys.get(key)
        return st is None or not self.max_concurrency or st.in_service < self.max_concurrency

    def forget_idle(self, key: str, now: float) -> None:
        st = self._keys.get(key)
        if st is not None and not st.in_service and not st.waiting and st.bucket.full(now):
            del self._keys[key]

    def __len__(self) -> int:
        return len(self._keys)


@dataclass(slots=True)
class DrainRate:
    """Prompt tokens dispatched per second from a standing queue (the last
    ``window`` dispatch intervals; intervals across an empty queue do not count)."""

    window: int = 64
    min_samples: int = 4
    _intervals: deque[tuple[float, int]] = field(default_factory=deque)
    _last: float = -1.0

    def dispatched(self, now: float, cost: int, *, backlogged: bool) -> None:
        """A request left the queue; ``backlogged``: the queue stood non-empty
        since the previous one left, so the interval is pure service time."""
        if backlogged and self._last >= 0 and now > self._last:
            self._intervals.append((now - self._last, cost))
            if len(self._intervals) > self.window:
                self._intervals.popleft()
        self._last = now

    def idle(self) -> None:
        self._last = -1.0

    def tokens_per_s(self) -> float | None:
        if len(self._intervals) < self.min_samples:
            return None
        dt = sum(d for d, _ in self._intervals)
        return sum(c for _, c in self._intervals) / dt if dt > 0 else None

    def wait_s(self, tokens_ahead: int) -> float | None:
        """Estimated seconds until ``tokens_ahead`` prompt tokens have left."""
        rate = self.tokens_per_s()
        return None if rate is None else tokens_ahead / rate


def retry_after_s(seconds: float) -> int:
    """An HTTP Retry-After value: whole seconds, at least 1."""
    return max(1, math.ceil(seconds)) if math.isfinite(seconds) else 60
