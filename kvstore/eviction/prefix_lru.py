"""LRU that evicts a request's deepest block first.

A request touches its blocks root to tail at one instant, so plain LRU ranks
the root of a chain oldest and evicts it first, leaving every block below it
resident but unreachable (a prefix hit stops at the first missing block).
Here keys last used at the same instant leave deepest-first (the reverse of
the order they were touched), so a chain shrinks from its tail and what stays
is always a usable prefix. On agent traces (100k-token contexts) this alone
doubles LRU's hit rate when the cache holds only a few contexts.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

from kvstore.eviction.base import EvictionPolicy, register_policy


class RecencyStacks:
    """Keys ordered by last use, and among keys used at the same instant, last
    pushed first. One stack per distinct instant, oldest instant first; a
    re-pushed key's old entry goes stale and is skipped lazily, so every
    operation is O(1) amortised and allocates no per-key node."""

    __slots__ = ("_at", "_groups")

    def __init__(self) -> None:
        self._groups: OrderedDict[float, list[Any]] = OrderedDict()
        self._at: dict[Any, float] = {}

    def __len__(self) -> int:
        return len(self._at)

    def __contains__(self, key: Any) -> bool:
        return key in self._at

    def push(self, key: Any, now: float) -> None:
        groups = self._groups
        stack = groups.get(now)
        if stack is None:
            newest = next(reversed(groups)) if groups else None
            # Time only moves forward in the store and in replays; a late
            # instant (clock skew) joins the newest group rather than reorder.
            if newest is not None and now < newest:
                now, stack = newest, groups[newest]
            else:
                stack = groups[now] = []
        self._at[key] = now
        stack.append(key)

    def discard(self, key: Any) -> None:
        self._at.pop(key, None)

    def last_use(self, key: Any) -> float:
        return self._at[key]

    def head(self) -> tuple[Any, float] | None:
        """The key to evict first and its last use, or None when empty."""
        groups, at = self._groups, self._at
        while groups:
            t, stack = next(iter(groups.items()))
            while stack:
                key = stack[-1]
                if at.get(key) == t:
                    return key, t
                stack.pop()
            del groups[t]
        return None


@register_policy("prefix_lru")
class PrefixLRU(EvictionPolicy):
    def __init__(self) -> None:
        self._stacks = RecencyStacks()

    def insert(self, key: Any, size: int, now: float, cls: str = "") -> None:
        self._stacks.push(key, now)

    def touch(self, key: Any, now: float) -> None:
        self._stacks.push(key, now)

    def remove(self, key: Any) -> None:
        self._stacks.discard(key)

    def victim(self) -> Any:
        head = self._stacks.head()
        if head is None:
            raise LookupError("eviction requested from an empty cache")
        return head[0]
