"""Storage tiers behind one small interface, opened by URL scheme
(docs/architecture.md#tiers-ttls-and-eviction).

``mem://`` G2 host DRAM (shared memory), ``file:///dir`` or a plain path G3
local disk, any other fsspec URL G4 (``fsspec+file:///dir`` for G4 on a local
directory). See ``kvstore.tiers.base`` for the invariants.
"""

from kvstore.tiers.base import (
    EvictCallback,
    PutOutcome,
    Tier,
    TierError,
    TierHit,
    TierStats,
    key_relpath,
    open_tier,
    register_tier,
    tier_schemes,
)
from kvstore.tiers.shm import ShmReader, ShmSlot

__all__ = ["EvictCallback", "PutOutcome", "ShmReader", "ShmSlot", "Tier", "TierError", "TierHit",
           "TierStats", "key_relpath", "open_tier", "register_tier", "tier_schemes"]
