"""Keeping the index and the tiers in agreement: the TTL sweeper and reindex.

Rules (the index is the truth about TTLs, the block files about bytes):
- A block whose index entry is gone *and* whose own expiry (block metadata)
  has passed expired: the sweeper deletes it from the tier.
- A block with no entry (or an entry missing its tier bit) that has not
  expired lost its entry some other way (Redis restarted or was flushed, a
  crash between a tier write and its index update): it is indexed again with
  what is left of its TTL.
- When the epoch marker (kvstore.index.EPOCH_KEY) is missing, Redis lost its
  data: the sweeper deletes nothing and rebuilds the whole index instead. A
  hit may have extended an entry past the file's own expiry, so only the
  index, never an absent index, may condemn a block.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Protocol

from common.config import TrafficClasses
from kvstore.blockfile import BlockMeta
from kvstore.index import BlockIndex, IndexEntry, IndexRecord
from kvstore.metrics import StoreMetrics
from kvstore.tiers import Tier
from kvstore.types import TIER_BITS
from kvstore.writeback import WriteBack

BATCH = 1000


class MaintainedStore(Protocol):
    """What the sweeper and reindex need of a store (``kvstore.warehouse.Warehouse``,
    which calls them: declared here so the two modules do not import each other)."""

    classes: TrafficClasses
    index: BlockIndex
    metrics: StoreMetrics
    writeback: WriteBack

    @property
    def tiers(self) -> Mapping[str, Tier]: ...

    def count_class_blocks(self, traffic_class: str, n: int) -> None: ...

    def is_pending(self, key: bytes) -> bool: ...

    def servable_mask(self, entry: IndexEntry | None) -> int: ...


@dataclass(frozen=True, slots=True)
class SweepReport:
    scanned: int = 0
    deleted: dict[str, int] = field(default_factory=dict)    # tier -> blocks deleted
    restored: int = 0                                         # entries re-created
    rebuilt: bool = False                                     # whole index rebuilt instead
    seconds: float = 0.0


@dataclass(frozen=True, slots=True)
class ReindexReport:
    blocks: dict[str, int] = field(default_factory=dict)     # tier -> blocks indexed
    seconds: float = 0.0

    @property
    def total(self) -> int:
        return sum(self.blocks.values())


def _batches(it: Iterator[BlockMeta], n: int) -> Iterator[list[BlockMeta]]:
    buf: list[BlockMeta] = []
    for m in it:
        buf.append(m)
        if len(buf) >= n:
            yield buf
            buf = []
    if buf:
        yield buf


def _class_of(wh: MaintainedStore, meta: BlockMeta) -> str:
    return meta.traffic_class if meta.traffic_class in wh.classes.ttl_s else wh.classes.default


def _record(wh: MaintainedStore, meta: BlockMeta, now: float) -> IndexRecord:
    cls = _class_of(wh, meta)
    left = meta.expires_at - now
    # An expired file may still be live (its entry was refreshed by hits and then
    # lost with Redis): give it a fresh class TTL rather than losing it.
    ttl = math.ceil(left) if left > 0 else wh.classes.ttl_s[cls]
    return IndexRecord(meta.key, meta.size, cls, ttl_s=ttl, tenant=meta.tenant)


async def _scan(tier_scan: Iterator[BlockMeta]) -> list[list[BlockMeta]]:
    return await asyncio.to_thread(lambda: list(_batches(tier_scan, BATCH)))


async def reindex(wh: MaintainedStore) -> ReindexReport:
    """Index every block the tiers hold (``kvserve store reindex``, or on start
    when Redis lost its data), then mark the epoch."""
    t0 = time.perf_counter()
    counts: dict[str, int] = {}
    for name, tier in wh.tiers.items():
        n = 0
        for batch in await _scan(tier.scan()):
            now = time.time()
            records = [_record(wh, m, now) for m in batch]
            await wh.index.add(records, tier=name)
            for rec in records:         # per-class counts in stats survive a restart
                wh.count_class_blocks(rec.traffic_class, 1)
            n += len(batch)
        counts[name] = n
    await wh.index.mark_epoch()
    return ReindexReport(counts, time.perf_counter() - t0)


async def sweep(wh: MaintainedStore) -> SweepReport:
    """One pass over every tier (see the module rules)."""
    t0 = time.perf_counter()
    if not await wh.index.epoch_present():
        await reindex(wh)
        return SweepReport(rebuilt=True, seconds=time.perf_counter() - t0)
    scanned = restored = 0
    deleted: dict[str, int] = {}
    for name, tier in wh.tiers.items():
        bit = TIER_BITS[name]
        for batch in await _scan(tier.scan()):
            scanned += len(batch)
            entries = await wh.index.entries([m.key for m in batch])
            now = time.time()
            doomed: list[bytes] = []
            heal: list[IndexRecord] = []
            for meta, entry in zip(batch, entries, strict=True):
                if wh.is_pending(meta.key) or wh.servable_mask(entry) & bit:
                    continue
                if entry is None and meta.expires_at <= now:
                    doomed.append(meta.key)
                else:
                    heal.append(_record(wh, meta, now))
            if heal:
                await wh.index.add(heal, tier=name)
                restored += len(heal)
            if doomed:
                deleted[name] = deleted.get(name, 0) + await _delete(wh, name, doomed)
    return SweepReport(scanned, deleted, restored, False, time.perf_counter() - t0)


async def _delete(wh: MaintainedStore, name: str, keys: list[bytes]) -> int:
    claimed = wh.writeback.begin_sweeping(keys)
    try:
        # Re-check after claiming: a put may have indexed the key since the scan.
        entries = await wh.index.entries(claimed)
        doomed = [k for k, e in zip(claimed, entries, strict=True) if e is None]
        tier = wh.tiers[name]
        n = sum(await asyncio.to_thread(lambda: [tier.delete(k) for k in doomed]))
        wh.metrics.swept.labels(name).inc(n)
        return n
    finally:
        wh.writeback.end_sweeping(claimed)
