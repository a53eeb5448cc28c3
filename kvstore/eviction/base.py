"""The policy interface and the byte-capacity cache that drives it.

``CapacityCache`` is the same accounting in the live tiers and in simulated
replays (no tensors): a tier asks it what to evict, a replay asks it whether a
block would have been a hit. Invariant: ``used_bytes`` is the sum of the sizes
of the keys the policy holds, and never exceeds ``capacity_bytes`` after
``admit`` returns.
"""

from __future__ import annotations

import importlib
import pkgutil
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar


class EvictionPolicy(ABC):
    """Orders resident keys for eviction. Keys are opaque hashables (bytes in
    the store, ints in replays)."""

    name: ClassVar[str] = ""

    @abstractmethod
    def insert(self, key: Any, size: int, now: float, cls: str = "") -> None:
        """A new key became resident."""

    @abstractmethod
    def touch(self, key: Any, now: float) -> None:
        """A resident key was used again."""

    @abstractmethod
    def remove(self, key: Any) -> None:
        """A resident key left (evicted, expired or deleted)."""

    @abstractmethod
    def victim(self) -> Any:
        """The key to evict next; the caller then calls ``remove``."""

    def begin_request(self, session: str, keys: Sequence[Any], now: float,  # noqa: B027
                      cls: str = "") -> None:
        """Optional hook: a request of ``session`` will now use ``keys`` (root
        first). Replays call it; the live tiers, which see no sessions, do not."""

    def next_use(self, key: Any, t: float | None) -> None:  # noqa: B027 - optional hook
        """Offline policies (Belady) learn each access's next use; others ignore it."""

    def admit(self, key: Any, size: int, now: float, cls: str = "") -> bool:
        """Whether a missing key should be cached at all (admission control)."""
        return True

    def bypass_when_full(self, key: Any) -> bool:
        """Asked only when admitting ``key`` would evict: True keeps it out
        instead (Belady bypasses a key whose next use is farther than every
        resident key's)."""
        return False


_REGISTRY: dict[str, Callable[..., EvictionPolicy]] = {}
_LOADED = False


def register_policy(name: str) -> Callable[[type[EvictionPolicy]], type[EvictionPolicy]]:
    def deco(cls: type[EvictionPolicy]) -> type[EvictionPolicy]:
        if name in _REGISTRY:
            raise ValueError(f"eviction policy {name!r} registered twice")
        cls.name = name
        _REGISTRY[name] = cls
        return cls

    return deco


def _load_all() -> None:
    global _LOADED
    if _LOADED:
        return
    # This file's own folder: importing the package here would make it and this
    # module import each other (tests/layers forbids the circle).
    for info in pkgutil.iter_modules([str(Path(__file__).parent)]):
        if info.name != "base":
            importlib.import_module(f"kvstore.eviction.{info.name}")
    _LOADED = True


def policy_names() -> list[str]:
    _load_all()
    return sorted(_REGISTRY)


def make_policy(name: str, **kwargs: Any) -> EvictionPolicy:
    _load_all()
    try:
        factory = _REGISTRY[name]
    except KeyError:
        raise ValueError(
            f"unknown eviction policy {name!r}; choose one of {policy_names()}") from None
    return factory(**kwargs)


@dataclass(frozen=True, slots=True)
class Admission:
    """Result of ``CapacityCache.put``: whether the key is now resident and
    which keys were evicted to make room."""

    stored: bool
    evicted: list[Any] = field(default_factory=list)


class CapacityCache:
    """Byte-capacity bookkeeping over one policy; holds sizes, never payloads."""

    __slots__ = ("capacity_bytes", "evictions", "policy", "sizes", "used_bytes")

    def __init__(self, capacity_bytes: int, policy: EvictionPolicy) -> None:
        if capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must be >= 0, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self.policy = policy
        self.sizes: dict[Any, int] = {}
        self.used_bytes = 0
        self.evictions = 0

    def __contains__(self, key: Any) -> bool:
        return key in self.sizes

    def __len__(self) -> int:
        return len(self.sizes)

    def hit(self, key: Any, now: float) -> bool:
        if key in self.sizes:
            self.policy.touch(key, now)
            return True
        return False

    def put(self, key: Any, size: int, now: float, cls: str = "") -> Admission:
        if key in self.sizes:
            self.policy.touch(key, now)
            return Admission(True)
        if size > self.capacity_bytes or not self.policy.admit(key, size, now, cls):
            return Admission(False)
        if self.used_bytes + size > self.capacity_bytes and self.policy.bypass_when_full(key):
            return Admission(False)
        evicted: list[Any] = []
        while self.used_bytes + size > self.capacity_bytes:
            victim = self.policy.victim()
            self.discard(victim)
            evicted.append(victim)
        self.evictions += len(evicted)
        self.sizes[key] = size
        self.used_bytes += size
        self.policy.insert(key, size, now, cls)
        return Admission(True, evicted)

    def discard(self, key: Any) -> bool:
        size = self.sizes.pop(key, None)
        if size is None:
            return False
        self.used_bytes -= size
        self.policy.remove(key)
        return True
