"""S3-FIFO (Yang et al., SOSP'23): a small probation FIFO, a main FIFO and a
ghost of keys recently dropped from probation.

New keys enter the small queue; one reused while there moves to main, the
rest leave (their keys stay in the ghost). A key found in the ghost goes
straight to main. Main is a FIFO with a 2-bit reuse counter: a key with uses
left is re-queued with one fewer instead of evicted. Most KV blocks are
never reused (76% in the Mooncake conversation trace), and this quick
demotion keeps them from pushing out blocks that are.

The policy never learns the capacity; it evicts only when asked, so "small"
is kept at ``small_ratio`` of the bytes resident when eviction is needed.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

from kvstore.eviction.base import EvictionPolicy, register_policy

_MAX_FREQ = 3


@register_policy("s3fifo")
class S3FIFO(EvictionPolicy):
    def __init__(self, small_ratio: float = 0.1) -> None:
        if not 0.0 < small_ratio < 1.0:
            raise ValueError(f"small_ratio must be in (0, 1), got {small_ratio}")
        self.small_ratio = small_ratio
        self._small: OrderedDict[Any, int] = OrderedDict()   # key -> size, oldest first
        self._main: OrderedDict[Any, int] = OrderedDict()
        self._freq: dict[Any, int] = {}
        self._ghost: OrderedDict[Any, None] = OrderedDict()
        self._small_bytes = 0
        self._main_bytes = 0

    def insert(self, key: Any, size: int, now: float, cls: str = "") -> None:
        self._freq[key] = 0
        if self._ghost.pop(key, False) is None:
            self._main[key] = size
            self._main_bytes += size
        else:
            self._small[key] = size
            self._small_bytes += size

    def touch(self, key: Any, now: float) -> None:
        if key in self._freq:
            self._freq[key] = min(self._freq[key] + 1, _MAX_FREQ)

    def remove(self, key: Any) -> None:
        self._freq.pop(key, None)
        size = self._small.pop(key, None)
        if size is not None:
            self._small_bytes -= size
            self._remember(key)
            return
        size = self._main.pop(key, None)
        if size is not None:
            self._main_bytes -= size

    def _remember(self, key: Any) -> None:
        self._ghost[key] = None
        # The ghost holds as many keys as main does (the paper's sizing).
        while len(self._ghost) > max(len(self._main), 1):
            self._ghost.popitem(last=False)

    def victim(self) -> Any:
        while True:
            total = self._small_bytes + self._main_bytes
            if self._small and (self._small_bytes >= self.small_ratio * total or not self._main):
                key, size = next(iter(self._small.items()))
                if self._freq[key] == 0:
                    return key            # remove() puts it in the ghost
                del self._small[key]       # reused on probation: promote
                self._small_bytes -= size
                self._freq[key] = 0
                self._main[key] = size
                self._main_bytes += size
                continue
            if not self._main:
                raise LookupError("eviction requested from an empty cache")
            key, size = next(iter(self._main.items()))
            if self._freq[key] == 0:
                return key
            self._freq[key] -= 1
            self._main.move_to_end(key)
