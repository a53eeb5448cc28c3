"""What a replay returns, whichever loop ran it: the Python one
(``studies.sim``) or the native core (``studies.replay_core``), to the bit."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

UNLIMITED = 1 << 62          # a capacity in bytes that nothing reaches


@dataclass(slots=True)
class ClassStats:
    requests: int = 0
    blocks: int = 0
    hit_blocks: int = 0
    tokens: int = 0
    hit_tokens: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hit_blocks / self.blocks if self.blocks else 0.0

    @property
    def token_hit_rate(self) -> float:
        return self.hit_tokens / self.tokens if self.tokens else 0.0

    def add(self, other: ClassStats) -> None:
        self.requests += other.requests
        self.blocks += other.blocks
        self.hit_blocks += other.hit_blocks
        self.tokens += other.tokens
        self.hit_tokens += other.hit_tokens


@dataclass(frozen=True, slots=True)
class ReplayStats:
    hit_rate: float                  # block hit rate, all classes
    token_hit_rate: float
    per_class: dict[str, ClassStats]
    bytes_peak: int
    bytes_mean: float                # time-weighted over the replayed span
    evictions: int                   # capacity evictions out of the last tier
    expirations: int                 # blocks removed by their TTL
    requests: int
    tier_hits: tuple[int, ...] = ()


def ttl_map(ttl_s: float | Mapping[str, float]) -> tuple[dict[str, float], float | None]:
    """Per-class TTLs and the default (``"*"``, or the one TTL given); each > 0."""
    if isinstance(ttl_s, Mapping):
        ttls = {str(k): float(v) for k, v in ttl_s.items()}
        default = ttls.pop("*", None)
    else:
        ttls, default = {}, float(ttl_s)
    for name, v in [*ttls.items(), ("*", default if default is not None else math.inf)]:
        if not v > 0:
            raise ValueError(f"ttl for class {name!r} must be > 0 seconds (inf = none), got {v}")
    return ttls, default


__all__ = ["UNLIMITED", "ClassStats", "ReplayStats", "ttl_map"]
