"""Least-recently-used: the baseline every other policy is measured against."""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

from kvstore.eviction.base import EvictionPolicy, register_policy


@register_policy("lru")
class LRU(EvictionPolicy):
    def __init__(self) -> None:
        # Values unused; OrderedDict gives O(1) move-to-end and pop-oldest.
        self._order: OrderedDict[Any, None] = OrderedDict()

    def insert(self, key: Any, size: int, now: float, cls: str = "") -> None:
        self._order[key] = None

    def touch(self, key: Any, now: float) -> None:
        self._order.move_to_end(key)

    def remove(self, key: Any) -> None:
        self._order.pop(key, None)

    def victim(self) -> Any:
        if not self._order:
            raise LookupError("eviction requested from an empty cache")
        return next(iter(self._order))
