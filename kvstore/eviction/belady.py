"""Belady's MIN with bypass: the offline optimum, the ceiling for every policy.

Evicts the resident key whose next use is farthest away, and keeps a new key
out when its own next use is farther than all of theirs. With equal block
sizes this maximises hits. It needs the future, so only replays use it: the
simulator calls ``next_use(key, t)`` before each access with any monotone key
of the next access (``None`` = never again, or not before the TTL expires).
The simulator breaks ties by block depth so a child goes before its parent,
which keeps the resident set prefix-closed (every Belady hit is a prefix hit).
"""

from __future__ import annotations

import heapq
import itertools
import math
from typing import Any

from kvstore.eviction.base import EvictionPolicy, register_policy


@register_policy("belady")
class Belady(EvictionPolicy):
    offline = True   # the simulator feeds it next uses; the live store cannot

    def __init__(self) -> None:
        self._next: dict[Any, float] = {}        # resident key -> its next use
        self._pending: dict[Any, float] = {}     # next use announced before insert/touch
        # Max-heap by next use via negation; stale entries are skipped lazily.
        self._heap: list[tuple[float, int, Any]] = []
        self._seq = itertools.count()

    def next_use(self, key: Any, t: float | None) -> None:
        self._pending[key] = math.inf if t is None else t

    def _push(self, key: Any) -> None:
        t = self._pending.pop(key, math.inf)
        self._next[key] = t
        heapq.heappush(self._heap, (-t, next(self._seq), key))
        if len(self._heap) > 4 * len(self._next) + 64:
            self._heap = [(-v, next(self._seq), k) for k, v in self._next.items()]
            heapq.heapify(self._heap)

    def insert(self, key: Any, size: int, now: float, cls: str = "") -> None:
        self._push(key)

    def touch(self, key: Any, now: float) -> None:
        self._push(key)

    def remove(self, key: Any) -> None:
        self._next.pop(key, None)

    def _top(self) -> tuple[float, Any]:
        heap = self._heap
        while heap:
            neg, _, key = heap[0]
            if self._next.get(key) == -neg:
                return -neg, key
            heapq.heappop(heap)
        raise LookupError("eviction requested from an empty cache")

    def victim(self) -> Any:
        return self._top()[1]

    def bypass_when_full(self, key: Any) -> bool:
        mine = self._pending.get(key, math.inf)
        if not self._next:
            return False
        if mine >= self._top()[0]:
            self._pending.pop(key, None)
            return True
        return False
