"""LRU that evicts a request's deepest block first.

A request touches its blocks root to tail at one instant, so plain LRU ranks
the root of a chain oldest and evicts it first, leaving every block below it
resident but unreachable (a prefix hit stops at the first missing block).
Here keys last used at the same instant leave deepest-first (the reverse of
the order they were touched), so a chain shrinks from its tail and what stays
is always a usable prefix.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

from kvstore.eviction.base import EvictionPolicy, register_policy


@register_policy("prefix_lru")
class PrefixLRU(EvictionPolicy):
    def __init__(self) -> None:
        # One stack of keys per distinct last-use instant, oldest instant first.
        # A touched key is pushed on the newest stack; its old entry goes stale
        # and is skipped lazily, so every operation is O(1) amortised.
        self._groups: OrderedDict[float, list[Any]] = OrderedDict()
        self._at: dict[Any, float] = {}

    def _push(self, key: Any, now: float) -> None:
        self._at[key] = now
        stack = self._groups.get(now)
        if stack is None:
            # Times only move forward in the store and in replays; an older
            # instant (clock skew) joins the newest group rather than reorder.
            if self._groups and now < next(reversed(self._groups)):
                now = next(reversed(self._groups))
                self._at[key] = now
                stack = self._groups[now]
            else:
                stack = self._groups[now] = []
        stack.append(key)

    def insert(self, key: Any, size: int, now: float, cls: str = "") -> None:
        self._push(key, now)

    def touch(self, key: Any, now: float) -> None:
        self._push(key, now)

    def remove(self, key: Any) -> None:
        self._at.pop(key, None)

    def victim(self) -> Any:
        groups, at = self._groups, self._at
        while groups:
            t, stack = next(iter(groups.items()))
            while stack:
                key = stack[-1]
                if at.get(key) == t:
                    return key
                stack.pop()
            del groups[t]
        raise LookupError("eviction requested from an empty cache")
