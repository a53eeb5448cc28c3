"""First-in first-out: insertion order only, uses do not refresh a block.

The simplest baseline of the cache-simulation literature (libCacheSim's
FIFO); a block's position is fixed when it is stored, so a hot shared
prefix is evicted as soon as one that arrived later needs its room.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

from kvstore.eviction.base import EvictionPolicy, register_policy


@register_policy("fifo")
class FIFO(EvictionPolicy):
    def __init__(self) -> None:
        self._order: OrderedDict[Any, None] = OrderedDict()

    def insert(self, key: Any, size: int, now: float, cls: str = "") -> None:
        self._order[key] = None

    def touch(self, key: Any, now: float) -> None:
        """Uses do not move a key (that is the difference from LRU)."""

    def remove(self, key: Any) -> None:
        self._order.pop(key, None)

    def victim(self) -> Any:
        if not self._order:
            raise LookupError("eviction requested from an empty cache")
        return next(iter(self._order))
