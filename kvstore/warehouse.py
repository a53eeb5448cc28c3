"""The warehouse of one node: tiers G2 (host DRAM), G3 (local disk), G4
(fsspec) under the Redis block index (docs/architecture.md#tiers-ttls-and-eviction).

Write path: a put copies each block into G2 and indexes it there at once
(G2 holds complete, checksummed copies), then queues it for G3 and G4; each
durable copy adds its tier bit when its write has returned. An index entry
therefore always names a tier holding a complete block. Read path: G2, else
G3, else G4, verified by the tier; a G3/G4 hit is promoted into G2 (and a G4
hit also lands in G3), a block evicted from G2 that no lower tier holds is
demoted into G3.

Integrity at rest: G3/G4 blocks carry a header MAC under ``cfg.mac`` (the
deployment's block MAC key, kvstore.integrity); every read and every reindex
verifies it, so a forged or old-format block is a miss, never served or
indexed. Quotas: per-tenant bytes per tier (``cfg.quotas`` and operators'
settings in Redis, kvstore.quotas); each tier evicts a tenant over quota from
its own blocks only (kvstore.eviction.tenants).

Concurrency: tier I/O runs in worker threads (tiers lock themselves); the
asyncio loop owns the index. ``_g2_lock`` makes "G2 put + index update" one
step, so an eviction from another request cannot clear a bit before it is set.
The asynchronous writes and their handshake with the sweeper live in
kvstore.writeback.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import queue
import socket
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np

from common.config import (
    ConfigError,
    HitRule,
    QuotaSection,
    TierConfig,
    TrafficClasses,
    WhatIfSection,
)
from kvstore import maintenance
from kvstore.blockfile import UNKEYED, BlockMac, BlockMeta, checksum
from kvstore.errors import InvalidRequest, StoreDraining, StoreUnavailable
from kvstore.index import BlockIndex, IndexEntry, IndexRecord
from kvstore.keys import DEFAULT_TENANT
from kvstore.metrics import StoreMetrics
from kvstore.ops_metrics import OpsMetrics
from kvstore.quotas import QuotaKeeper, QuotaTable
from kvstore.tiers import ShmSlot, Tier, TierHit, open_tier
from kvstore.tiers.host import HostTier
from kvstore.tiers.objstore import TierUnavailable
from kvstore.types import (
    TIER_BITS,
    ClassSnapshot,
    DeleteResult,
    LookupResult,
    PutResult,
    RequestCtx,
    StoreStats,
    TierSnapshot,
    best_tier,
)
from kvstore.whatif import WhatIfEstimator
from kvstore.writeback import WriteBack, WriteJob
from security.authz import PermissionDenied
from telemetry import tracing

log = logging.getLogger(__name__)

G4_DEFAULT_BYTES = 1 << 50
WHATIF_SHARE = 0.1          # most of the time the what-if estimator may take
_SERVE_LOCAL = TIER_BITS["G2"] | TIER_BITS["G3"]


def _tenant(ctx: RequestCtx) -> str:
    """The namespace a call works in. The service has already replaced the
    request's tenant with the one the caller is authorised for."""
    return ctx.tenant or DEFAULT_TENANT
_BEST_TIER = [best_tier(m) for m in range(16)]     # tier mask -> fastest tier name


@dataclass(frozen=True, slots=True)
class WarehouseConfig:
    redis_url: str
    tiers: TierConfig = field(default_factory=TierConfig)
    classes: TrafficClasses = field(default_factory=TrafficClasses)
    hit_rule: HitRule = field(default_factory=HitRule)
    instance: str = ""                     # kvstore instance id in events; default = node
    g4_bytes: int = G4_DEFAULT_BYTES
    sweep_interval_s: float = 300.0        # 0 = no background sweeper
    write_workers: int = 2
    max_pending_bytes: int = 512 * 2**20   # queued G3/G4 writes before puts wait
    fsync: bool = True
    prefault_g2: bool = False              # touch all of G2 at start (steady-state speed at once)
    mac: BlockMac = UNKEYED                # G3/G4 header MAC (kvstore.integrity.block_mac)
    quotas: QuotaSection = field(default_factory=QuotaSection)
    whatif: WhatIfSection = field(default_factory=WhatIfSection)    # predictions in /metrics

    def __post_init__(self) -> None:
        if not self.redis_url:
            raise ConfigError("warehouse needs a redis_url")
        if self.sweep_interval_s < 0 or self.write_workers < 1 or self.max_pending_bytes < 1:
            raise ConfigError("sweep_interval_s >= 0, write_workers >= 1, max_pending_bytes >= 1")
        if self.classes.any_durable:
            if not (self.tiers.g3_path or self.tiers.g4_url):
                raise ConfigError("classes.ack = \"durable\" needs a G3 (tiers.g3_path) or G4 "
                                  "tier to be durable in")
            if not self.fsync and self.tiers.g3_path:
                raise ConfigError("classes.ack = \"durable\" needs fsync on (G3 writes that are "
                                  "not synced are not durable)")


class Fetched(NamedTuple):
    """One block of a get, in request order: ``payload`` (a private copy), or
    ``slot`` (same-host shared memory, G2 only), or neither (a miss)."""

    key: bytes
    tier: str
    meta: BlockMeta | None
    payload: memoryview | None
    slot: ShmSlot | None = None


class Warehouse:
    def __init__(self, cfg: WarehouseConfig, *, metrics: StoreMetrics | None = None) -> None:
        self.cfg = cfg
        self.node = cfg.tiers.node
        self.classes = cfg.classes
        self.hit_rule = cfg.hit_rule
        self.metrics = metrics or StoreMetrics()
        self.ops = OpsMetrics(self.metrics.registry)
        self.index = BlockIndex(cfg.redis_url, node=self.node, classes=cfg.classes,
                                instance=cfg.instance or self.node,
                                max_tenants=cfg.quotas.max_tenants)
        self.tiers: dict[str, Tier] = {}
        self.quotas = QuotaKeeper(cfg.redis_url, cfg.quotas, self.tiers)
        self.g2: HostTier | None = None
        self.accepting = True
        self.whatif: WhatIfEstimator | None = None   # live what-if (kvstore.whatif)
        self.whatif_dropped = 0                      # lookups the estimator had to skip
        self._whatif_q: queue.Queue[tuple[list[bytes], str, int, float] | None] = \
            queue.Queue(maxsize=4)
        self._whatif_lock = threading.Lock()
        self._whatif_thread: threading.Thread | None = None
        self.writeback = WriteBack(self.tiers, self.index, self.metrics,
                                   max_pending_bytes=cfg.max_pending_bytes)
        self._g2_lock = asyncio.Lock()
        self._demoted: deque[tuple[BlockMeta, memoryview]] = deque()
        self._tasks: list[asyncio.Task[None]] = []
        self._class_hits: dict[str, int] = dict.fromkeys(cfg.classes.ttl_s, 0)
        self._class_misses: dict[str, int] = dict.fromkeys(cfg.classes.ttl_s, 0)
        self._class_blocks: dict[str, int] = dict.fromkeys(cfg.classes.ttl_s, 0)

    # -- lifecycle ---------------------------------------------------------------------------
    async def start(self, *, serve: bool = True) -> Warehouse:
        """Open tiers and index. ``serve=False`` (offline tools such as reindex,
        possibly beside a running store) skips G2, the G2 reconcile, the writers
        and the sweeper."""
        await asyncio.to_thread(self._open_tiers, serve)
        await self.index.start()
        if not serve:
            return self
        await self._drop_evicted(await self.quotas.refresh(force=True))
        stale = await self.index.reconcile_g2()
        if stale:
            log.info("cleared %d G2 index bits left by this node's previous process", stale)
        if not await self.index.epoch_present():
            report = await maintenance.reindex(self)
            log.info("index epoch missing: rebuilt from tiers: %s", report)
        self.metrics.watch_tiers(self.tier_snapshots, self.quotas.usage)
        self.ops.watch(self, self.metrics.swept, self.cfg.whatif.ttl_values(),
                       self.cfg.whatif.capacity_values())
        self.writeback.start(self.cfg.write_workers)
        if self.cfg.sweep_interval_s > 0:
            self._tasks.append(asyncio.create_task(self._sweeper(), name="kv-sweeper"))
        self._tasks.append(asyncio.create_task(self._quota_refresher(), name="kv-quotas"))
        self._load_whatif()
        return self

    def _open_tiers(self, with_g2: bool) -> None:
        t = self.cfg.tiers
        if t.g2_bytes > 0 and with_g2:
            # Pinning needs torch+CUDA; importing torch just to learn there is no GPU
            # costs seconds of start-up, so ask the driver's device node first.
            pin = None if os.path.exists("/dev/nvidiactl") else False
            self.g2 = HostTier(f"mem://{self.node}", name="G2", capacity_bytes=t.g2_bytes,
                               policy=t.eviction_policy, on_evict=self._on_g2_evict, pin=pin)
            self.tiers["G2"] = self.g2
            if self.cfg.prefault_g2 and not self.g2.prefault():
                log.info("could not prefault G2; its first writes will be slower")
        if t.g3_path:
            # Not serving (reindex beside a live store): leave young temp files alone.
            self.tiers["G3"] = open_tier(t.g3_path, name="G3", capacity_bytes=t.g3_bytes,
                                         policy=t.eviction_policy, lz4=t.lz4,
                                         fsync=self.cfg.fsync, mac=self.cfg.mac,
                                         temp_grace_s=0.0 if with_g2 else 600.0)
        if t.g4_url:
            self.tiers["G4"] = open_tier(t.g4_url, name="G4", capacity_bytes=self.cfg.g4_bytes,
                                         policy=t.eviction_policy, lz4=t.lz4, mac=self.cfg.mac)

    def _load_whatif(self) -> None:
        self.whatif = WhatIfEstimator()
        self._whatif_thread = threading.Thread(target=self._whatif_worker, name="kv-whatif",
                                               daemon=True)
        self._whatif_thread.start()

    def _whatif_worker(self) -> None:
        # The estimator costs ~15-25 us per block (a 2,048-block lookup: tens of ms),
        # so it runs here, off the event loop, and sheds load when it falls behind.
        while (item := self._whatif_q.get()) is not None:
            keys, cls, prompt_tokens, now = item
            bt = self.hit_rule.block_tokens
            t0 = time.perf_counter()
            try:
                with self._whatif_lock:
                    many = getattr(self.whatif, "record_many", None)
                    if callable(many):
                        many(keys, now, cls, bt)
                    else:
                        for k in keys:
                            self.whatif.record(k, now, cls, bt)  # type: ignore[union-attr]
                    tail = prompt_tokens - len(keys) * bt
                    if tail > 0:
                        self.whatif.record_uncacheable(cls, 1, tail)  # type: ignore[union-attr]
            except Exception:  # an estimator bug must not kill the thread
                log.exception("what-if estimator failed to record a lookup")
            finally:
                self._whatif_q.task_done()
            # Duty cycle: the estimator shares the GIL with the event loop, so it
            # may use at most WHATIF_SHARE of the time; lookups arriving meanwhile
            # overflow the small queue and are skipped (counted in whatif_dropped).
            busy = time.perf_counter() - t0
            time.sleep(busy * (1.0 - WHATIF_SHARE) / WHATIF_SHARE)
        self._whatif_q.task_done()

    async def whatif_settled(self) -> None:
        """Wait until every queued lookup has reached the estimator (tests, stats)."""
        await asyncio.to_thread(self._whatif_q.join)

    def _feed_whatif(self, keys: Sequence[bytes], cls: str, prompt_tokens: int) -> None:
        try:
            self._whatif_q.put_nowait((list(keys), cls, prompt_tokens, time.time()))
        except queue.Full:
            self.whatif_dropped += 1
            self.metrics.whatif_dropped.inc()

    async def flush(self) -> None:
        """Wait until every queued G3/G4 write has landed and been indexed."""
        await self.writeback.flush()

    async def close(self) -> None:
        self.accepting = False
        await self.writeback.stop()
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks = []
        if self._whatif_thread is not None:
            self._whatif_q.put(None)
            await asyncio.to_thread(self._whatif_thread.join, 10.0)
            self._whatif_thread = None
        for tier in self.tiers.values():
            tier.close()
        await self.quotas.close()
        await self.index.close()

    async def __aenter__(self) -> Warehouse:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # -- helpers -----------------------------------------------------------------------------
    def resolve_class(self, ctx: RequestCtx) -> str:
        try:
            return self.classes.resolve(ctx.traffic_class)
        except ConfigError as exc:
            raise InvalidRequest(str(exc)) from None

    def is_pending(self, key: bytes) -> bool:
        return self.writeback.is_pending(key)

    def servable_mask(self, entry: IndexEntry | None) -> int:
        """Tier bits of ``entry`` that this node can serve."""
        if entry is None:
            return 0
        mask = entry.tiers & TIER_BITS["G4"]
        if entry.node_id == self.index.node_id:
            mask |= entry.tiers & _SERVE_LOCAL
        return mask

    # -- lookup ------------------------------------------------------------------------------
    async def lookup(self, keys: Sequence[bytes], *, prompt_tokens: int, ctx: RequestCtx,
                     touch: bool = True) -> LookupResult:
        cls = self.resolve_class(ctx)
        bt = self.hit_rule.block_tokens
        if prompt_tokens < len(keys) * bt or prompt_tokens <= 0:
            raise InvalidRequest(
                f"prompt_tokens {prompt_tokens} is fewer than the {len(keys)} keys x "
                f"{bt} tokens they stand for (or zero): wrong block size or prompt length")
        match = await self.index.match_chain(keys, traffic_class=cls, touch=touch,
                                             tenant=_tenant(ctx))
        t = match.table
        mine = t["node_id"] == self.index.node_id
        masks = (t["tiers"] & TIER_BITS["G4"]) | np.where(mine, t["tiers"] & _SERVE_LOCAL, 0)
        tiers = [_BEST_TIER[m] for m in masks.tolist()]
        usable = self.hit_rule.usable_tokens(match.matched * bt, prompt_tokens)
        m = self.metrics
        m.lookup_latency.observe(match.lookup_s)
        m.lookup_tokens.labels("prompt").inc(prompt_tokens)
        m.lookup_tokens.labels("matched").inc(match.matched * bt)
        m.lookup_tokens.labels("usable").inc(usable)
        if self.whatif is not None and touch:
            self._feed_whatif(keys, cls, prompt_tokens)
        if touch:
            self.ops.lookup(cls, len(keys), match.matched)
        tracing.annotate(traffic_class=cls, blocks=len(keys), matched_blocks=match.matched,
                         usable_tokens=usable)
        return LookupResult(match.matched, usable, tiers, match.lookup_s)

    # -- put ---------------------------------------------------------------------------------
    async def put(self, keys: Sequence[bytes], payloads: Sequence[memoryview], *, layout: str,
                  token_counts: Sequence[int], ctx: RequestCtx,
                  checksums: Sequence[bytes] = (), borrowed: bool = False) -> PutResult:
        """Store blocks (write-once: present keys are skipped). Validates every
        block before storing any, so a bad request stores nothing. ``borrowed``:
        the payloads are only valid during the call (a client's staging memory),
        so what the asynchronous writes need is copied first."""
        if not self.accepting:
            raise StoreDraining("the store is draining and takes no new blocks")
        cls = self.resolve_class(ctx)
        if not (len(keys) == len(payloads) == len(token_counts)):
            raise InvalidRequest(f"{len(keys)} keys, {len(payloads)} payloads and "
                                 f"{len(token_counts)} token counts must match")
        if len(set(keys)) != len(keys):
            raise InvalidRequest("a put names the same key twice")
        for i, want in enumerate(checksums):
            if want and checksum(payloads[i]) != want:
                raise InvalidRequest(f"block {i} ({keys[i].hex()}): payload does not match "
                                     "the checksum sent with it")
        nbytes = sum(p.nbytes for p in payloads)
        entries = await self.index.entries(keys)
        tenant = _tenant(ctx)
        tid = await self.index.tenant_id(tenant)
        foreign = [i for i, e in enumerate(entries) if e is not None and e.tenant_id != tid]
        if foreign:  # a key another tenant namespace holds: never overwritten, never merged
            self.metrics.errors.labels("Put", "PERMISSION_DENIED").inc()
            raise PermissionDenied(f"block {foreign[0]} ({keys[foreign[0]].hex()}) belongs to "
                                   f"another tenant namespace than {tenant!r}")
        expires = time.time() + self.classes.ttl_s[cls]
        todo = [i for i, e in enumerate(entries)
                if not self.servable_mask(e) and not self.is_pending(keys[i])]
        metas = [BlockMeta(keys[i], ctx.model_fingerprint, layout, token_counts[i], cls, expires,
                           checksums[i] if i < len(checksums) else b"", payloads[i].nbytes,
                           tenant)
                 for i in todo]
        if todo and self.g2 is not None:
            await self._into_g2([(m, payloads[i]) for m, i in zip(metas, todo, strict=True)])
        lower = tuple(t for t in ("G3", "G4") if t in self.tiers)
        # ack = "durable": answer only once every block is fsynced in the first lower
        # tier and indexed there (kvstore.writeback resolves each job's future).
        ack_tier = lower[0] if lower and self.classes.ack_mode(cls) == "durable" else ""
        acks: list[asyncio.Future[bool]] = []

        async def enqueue(i: int, meta: BlockMeta, tiers: tuple[str, ...]) -> None:
            p = memoryview(payloads[i].tobytes()) if borrowed else payloads[i]
            fut = asyncio.get_running_loop().create_future() if ack_tier else None
            await self.writeback.enqueue(WriteJob(meta.key, p, meta, tiers, fut, ack_tier))
            if fut is not None:
                acks.append(fut)

        if lower:
            for m, i in zip(metas, todo, strict=True):
                await enqueue(i, m, lower)
        if ack_tier:
            # Present blocks not yet durable here (only in G2, or still queued by an
            # earlier "g2" put) are written to the ack tier too before the answer.
            bit, todo_set = TIER_BITS[ack_tier], set(todo)
            for i, e in enumerate(entries):
                if i not in todo_set and not self.servable_mask(e) & bit:
                    await enqueue(i, BlockMeta(
                        keys[i], ctx.model_fingerprint, layout, token_counts[i], cls, expires,
                        checksums[i] if i < len(checksums) else b"", payloads[i].nbytes,
                        tenant), (ack_tier,))
            ok = await asyncio.gather(*acks)
            if not all(ok):
                raise StoreUnavailable(f"{ok.count(False)} of {len(keys)} blocks could not be "
                                       f"made durable in {ack_tier} (ack = \"durable\"); "
                                       "nothing of this put is acknowledged")
        self._class_blocks[cls] += len(todo)
        self.metrics.bytes_in.labels("G2").inc(sum(m.size for m in metas))
        self.ops.stored(tid, cls, sum(m.size for m in metas))
        tracing.annotate(traffic_class=cls, tenant_ns=tid, stored_blocks=len(todo))
        return PutResult(len(todo), len(keys) - len(todo), nbytes)

    async def _into_g2(self, blocks: list[tuple[BlockMeta, memoryview]]) -> None:
        """Copy blocks into G2 and index them there, as one step (see module doc)."""
        g2 = self.g2
        assert g2 is not None

        def copy_in() -> tuple[list[BlockMeta], list[BlockMeta]]:
            stored, evicted = [], []
            for meta, payload in blocks:
                out = g2.put(meta.key, payload, meta)
                if out.stored and not out.existed:
                    stored.append(meta)
                evicted.extend(out.evicted)
            return stored, evicted

        async with self._g2_lock:
            stored, evicted = await asyncio.to_thread(copy_in)
            gone = {m.key for m in evicted}
            await self.index.add([IndexRecord(m.key, m.size, m.traffic_class, tenant=m.tenant)
                                  for m in stored if m.key not in gone], tier="G2")
            if gone:
                await self.index.remove(list(gone), tier="G2")
        await self._demote()

    def _on_g2_evict(self, meta: BlockMeta, payload: memoryview) -> None:
        # Runs in the worker thread that caused the eviction; deque appends are atomic.
        self._demoted.append((meta, payload))

    async def _demote(self) -> None:
        g3 = self.tiers.get("G3")
        while self._demoted:
            meta, payload = self._demoted.popleft()
            if g3 is None or self.is_pending(meta.key) or g3.contains(meta.key):
                continue
            self.metrics.demotions.inc()
            await self.writeback.enqueue(WriteJob(meta.key, payload, meta, ("G3",)))

    # -- get ---------------------------------------------------------------------------------
    async def get(self, keys: Sequence[bytes], *, ctx: RequestCtx,
                  locate: bool = False) -> list[Fetched]:
        """Blocks in request order; ``locate`` answers G2 hits with shared-memory
        slots instead of copies (same-host callers)."""
        cls = self.resolve_class(ctx)
        for i, k in enumerate(keys):
            if len(k) != 16:
                raise InvalidRequest(f"key {i} is not a 16-byte block key")
        fp = ctx.model_fingerprint
        tenant = _tenant(ctx)
        misses: dict[str, list[bytes]] = {name: [] for name in self.tiers}
        denied: list[bytes] = []
        # Seconds per tier, for the trace's "fetch <tier>" spans; only taken in a trace.
        spent: dict[str, float] | None = dict.fromkeys(self.tiers, 0.0) if (
            tracing.active()) else None

        def fetch() -> list[Fetched]:
            out: list[Fetched] = []
            for key in keys:
                found: Fetched | None = None
                for name, tier in self.tiers.items():
                    t0 = time.perf_counter() if spent is not None else 0.0
                    if locate and isinstance(tier, HostTier):
                        meta = tier.meta(key)
                        if meta is not None and meta.tenant != tenant:
                            denied.append(key)  # another namespace's block: a miss, and
                            break               # no index bits cleared on its account
                        slot = tier.locate(key) if meta is not None else None
                        if spent is not None:
                            spent[name] += time.perf_counter() - t0
                        if slot is not None and meta is not None:
                            found = Fetched(key, name, meta, None, slot)
                            break
                        misses[name].append(key)
                        continue
                    try:
                        hit: TierHit | None = tier.get(key)
                    except TierUnavailable:
                        continue  # store down (counted by the tier): a miss; keep the index bit
                    finally:
                        if spent is not None:
                            spent[name] += time.perf_counter() - t0
                    if hit is None:
                        misses[name].append(key)
                        continue
                    if hit.meta.tenant != tenant:
                        denied.append(key)
                        break
                    if fp and hit.meta.fingerprint and hit.meta.fingerprint != fp:
                        misses[name].append(key)  # a key collision across models: never serve
                        continue
                    found = Fetched(key, name, hit.meta, hit.payload)
                    break
                out.append(found or Fetched(key, "", None, None))
            return out

        started = tracing.now()
        fetched = await asyncio.to_thread(fetch)
        if spent is not None:
            _trace_tiers(started, spent, fetched, misses, cls)
        if denied:
            self.metrics.errors.labels("Get", "PERMISSION_DENIED").inc(len(denied))
        await self._after_get(fetched, misses, cls)
        return fetched

    async def _after_get(self, fetched: list[Fetched], misses: dict[str, list[bytes]],
                         cls: str) -> None:
        m = self.metrics
        for f in fetched:
            if f.tier:
                m.hits.labels(f.tier, cls).inc()
                m.bytes_out.labels(f.tier).inc(f.meta.size if f.meta else 0)
                self._class_hits[cls] += 1
            else:
                self._class_misses[cls] += 1
        for name, ks in misses.items():
            if ks:
                m.misses.labels(name, cls).inc(len(ks))
        # Entries that promised a tier the block was not in (corrupt, deleted behind
        # our back): clear those bits so the index stops pointing at nothing.
        lost = [f.key for f in fetched if not f.tier]
        for name in self.tiers:
            stale = [k for k in misses[name] if name != "G2" or k in lost]
            if stale:
                await self.index.remove(stale, tier=name)
        promote = [f for f in fetched
                   if f.tier in ("G3", "G4") and f.meta is not None and f.payload is not None]
        if promote and self.g2 is not None:
            await self._into_g2([(f.meta, f.payload) for f in promote])  # type: ignore[misc]
            for f in promote:
                m.promotions.labels(f.tier).inc()
        if "G3" in self.tiers:
            for f in fetched:
                if f.tier == "G4" and f.meta is not None and f.payload is not None:
                    await self.writeback.enqueue(WriteJob(f.key, f.payload, f.meta, ("G3",)))

    # -- delete / stats / maintenance --------------------------------------------------------
    async def delete(self, keys: Sequence[bytes], *, ctx: RequestCtx) -> DeleteResult:
        self.resolve_class(ctx)

        def drop() -> int:
            n = 0
            for key in keys:
                hit = [tier.delete(key) for tier in self.tiers.values()]
                n += any(hit)
            return n

        await self.index.delete(keys)
        return DeleteResult(await asyncio.to_thread(drop))

    def whatif_rows(self, ttls: Sequence[float], capacities: Sequence[float]) -> list[Any]:
        """The live what-if's predictions (kvstore.whatif.WhatIfRow), [] before it runs."""
        if self.whatif is None:
            return []
        self._whatif_drained(1.0)
        with self._whatif_lock:
            return self.whatif.predict(ttls, capacities)

    def _whatif_drained(self, timeout_s: float) -> None:
        """Let the estimator take the few lookups still queued (at most ``timeout_s``),
        so a scrape right after a burst reflects it."""
        q, deadline = self._whatif_q, time.monotonic() + timeout_s
        with q.all_tasks_done:
            while q.unfinished_tasks and (left := deadline - time.monotonic()) > 0:
                q.all_tasks_done.wait(left)

    def tier_snapshots(self) -> list[TierSnapshot]:
        out = []
        for name, tier in self.tiers.items():
            s = tier.stats()
            out.append(TierSnapshot(name, s.capacity_bytes, s.used_bytes, s.blocks, s.hits,
                                    s.misses, s.evictions, s.checksum_failures))
        return out

    # -- quotas ------------------------------------------------------------------------------
    async def set_quota(self, tier: str, tenant: str, quota_bytes: int | None, *,
                        reset: bool = False) -> QuotaTable:
        """An operator's quota (None: no limit; ``reset``: back to the config's),
        kept in Redis and applied here at once (other stores within refresh_s)."""
        await self._drop_evicted(await self.quotas.set(tier, tenant, quota_bytes, reset))
        return self.quotas.table

    async def _drop_evicted(self, evicted: dict[str, list[BlockMeta]]) -> None:
        """Index bits of blocks a quota change evicted (G2's as one step with G2, as
        puts do; a G2 block no lower tier holds is demoted like any G2 eviction)."""
        for name, metas in evicted.items():
            keys = [m.key for m in metas]
            if name == "G2":
                async with self._g2_lock:
                    await self.index.remove(keys, tier=name)
                await self._demote()
            else:
                await self.index.remove(keys, tier=name)

    async def _quota_refresher(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.quotas.refresh_s)
            try:
                await self._drop_evicted(await self.quotas.refresh())
            except Exception:  # Redis hiccup: keep the quotas in force, retry later
                log.warning("quota refresh failed", exc_info=True)

    def count_class_blocks(self, traffic_class: str, n: int) -> None:
        """Blocks of a class this store holds: written, or found in a tier at a reindex."""
        if traffic_class in self._class_blocks:
            self._class_blocks[traffic_class] += n

    async def stats(self, tenant: str = "") -> StoreStats:
        """Counters; with ``tenant``, only that tenant's per-tenant rows."""
        classes = [ClassSnapshot(c, ttl, self._class_hits[c], self._class_misses[c],
                                 self._class_blocks[c])
                   for c, ttl in sorted(self.classes.ttl_s.items())]
        whatif_json = ""
        if self.whatif is not None:
            try:
                with self._whatif_lock:
                    whatif_json = self.whatif.to_json()
            except Exception:  # stats must answer even if the estimator fails
                log.exception("what-if estimator failed")
        names = await self.index.ids.tenant_count()
        return StoreStats(self.node, self.tier_snapshots(), classes, whatif_json,
                          shm_capable=self.g2 is not None, hostname=socket.gethostname(),
                          tenants=self.quotas.usage(tenant), tenant_names=names,
                          max_tenants=self.cfg.quotas.max_tenants)

    async def sweep(self) -> maintenance.SweepReport:
        return await maintenance.sweep(self)

    async def reindex(self) -> maintenance.ReindexReport:
        return await maintenance.reindex(self)

    async def _sweeper(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.sweep_interval_s)
            try:
                report = await self.sweep()
                if report.deleted or report.restored:
                    log.info("sweep: %s", report)
            except Exception:  # keep sweeping after a transient failure
                log.exception("sweep failed")


def _trace_tiers(started: float, spent: dict[str, float], fetched: list[Fetched],
                 misses: dict[str, list[bytes]], cls: str) -> None:
    """One "fetch <tier>" span per tier the get touched: the time spent in it,
    the blocks and bytes it served and the blocks it missed."""
    for name, seconds in spent.items():
        hits = [f for f in fetched if f.tier == name]
        if not hits and not misses[name]:
            continue
        tracing.record(f"fetch {name}", started, started + seconds, tier=name,
                       traffic_class=cls, blocks=len(hits), missed_blocks=len(misses[name]),
                       bytes=sum(f.meta.size for f in hits if f.meta is not None))


__all__ = ["Fetched", "Warehouse", "WarehouseConfig"]
