"""An operator's reset of one store: drop every block it holds, in every tier.

``KVStore.Clear`` (operators, and the router for ``/reset_prefix_cache?warehouse=1``;
security/methods.py). Optionally one tenant's blocks only. It goes through the
paths eviction and the TTL sweeper already use, so everything that tracks a
block stays consistent:

- the index: ``BlockIndex.remove`` clears this node's tier bit (G4's wherever
  it was set: G4 is shared) and deletes an entry left with no tier, with the
  same "evicted" KV event a capacity eviction sends (the router's prefix view
  follows it);
- tier bytes, per-tenant quota usage and the Stats/``/metrics`` gauges: each
  block leaves through ``Tier.delete``, which updates the tier's accounting;
  ``kvstore_cleared_blocks{tier}`` counts what a clear dropped.

Safe beside Puts and Gets in flight:

- A block's index bit goes before its bytes (G2 under the warehouse's
  ``g2_lock``, as every G2 change), so an index entry never names a block
  that is gone; a Get reads the tiers themselves and every tier verifies what
  it returns, so a Get racing a clear gets the block intact or a miss.
- G3/G4 blocks are claimed the way the sweeper claims them
  (``WriteBack.begin_sweeping``): a key with a queued write is left alone
  (counted in ``pending_blocks``) and a write arriving meanwhile waits for the
  deletion, so neither undoes half of the other. Writes queued before the
  clear are flushed first (for at most ``FLUSH_WAIT_S``), so what was stored
  before it is gone after it.
- Tiers are cleared bottom-up (G4, G3, then G2): a Get that promotes a
  lower-tier copy into G2 meanwhile has its copy dropped by the G2 pass.

Blocks a Put stores while the clear runs may stay: a clear is a reset, not a
barrier.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import TYPE_CHECKING

from kvstore.tiers import Tier
from kvstore.types import TIER_ORDER, ClearResult, RequestCtx, TierCleared

if TYPE_CHECKING:
    from kvstore.warehouse import Warehouse

log = logging.getLogger(__name__)

BATCH = 1000            # keys per index round trip and per thread hop
FLUSH_WAIT_S = 10.0     # queued G3/G4 writes waited for before clearing


def _drop(tier: Tier, sizes: dict[bytes, int], keys: list[bytes]) -> tuple[int, int]:
    """Delete ``keys`` from ``tier``: (blocks, bytes) that were there."""
    blocks = nbytes = 0
    for k in keys:
        if tier.delete(k):
            blocks += 1
            nbytes += sizes[k]
    return blocks, nbytes


async def clear(wh: Warehouse, tenant: str = "") -> ClearResult:
    """Drop every block ``wh`` holds (only ``tenant``'s when given); see the module doc."""
    if tenant:
        RequestCtx(tenant=tenant)       # a bad name is InvalidRequest, before anything goes
    t0 = time.perf_counter()
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(wh.flush(), FLUSH_WAIT_S)
    out: list[TierCleared] = []
    pending = 0
    for name in reversed(TIER_ORDER):
        tier = wh.tiers.get(name)
        if tier is None:
            continue
        sizes = await asyncio.to_thread(tier.resident, tenant or None)
        keys = list(sizes)
        blocks = nbytes = 0
        for i in range(0, len(keys), BATCH):
            batch = keys[i:i + BATCH]
            if name == "G2":
                async with wh.g2_lock:      # no put or eviction changes G2 meanwhile
                    await wh.index.remove(batch, tier=name)
                    n, b = await asyncio.to_thread(_drop, tier, sizes, batch)
            else:
                claimed = wh.writeback.begin_sweeping(batch)
                pending += len(batch) - len(claimed)
                try:
                    await wh.index.remove(claimed, tier=name)
                    n, b = await asyncio.to_thread(_drop, tier, sizes, claimed)
                finally:
                    wh.writeback.end_sweeping(claimed)
            blocks += n
            nbytes += b
        wh.metrics.cleared.labels(name).inc(blocks)
        out.append(TierCleared(name, blocks, nbytes))
    out.reverse()
    res = ClearResult(wh.node, out, pending, time.perf_counter() - t0)
    log.info("cleared %d blocks%s: %s (%d left pending) in %.2f s", res.blocks,
                f" of tenant {tenant}" if tenant else "",
                {t.tier: t.blocks for t in out}, pending, res.clear_s)
    return res


__all__ = ["ClearResult", "clear"]
