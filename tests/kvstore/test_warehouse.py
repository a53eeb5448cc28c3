"""The warehouse: write-through, promotion/demotion, TTL sweeps,
integrity, self-healing of a lost index."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest
import redis

from kvstore.errors import InvalidRequest, StoreDraining
from kvstore.tiers.base import key_relpath
from kvstore.tiers.shm import attach_segment
from kvstore.types import TIER_BITS, RequestCtx
from kvstore.warehouse import Warehouse
from tests.kvstore.storeproc import LAYOUT, blocks, keys, wh_config

CTX = RequestCtx(tenant="t1")
FAST = RequestCtx(tenant="t1", traffic_class="fast")
G2, G3, G4 = TIER_BITS["G2"], TIER_BITS["G3"], TIER_BITS["G4"]


def with_wh(cfg_kw: dict[str, object], body: Callable[[Warehouse], Awaitable[None]],
            redis_url: str) -> None:
    async def main() -> None:
        wh = await Warehouse(wh_config(redis_url, **cfg_kw)).start()  # type: ignore[arg-type]
        try:
            await body(wh)
        finally:
            await wh.close()
    asyncio.run(main())


async def put(wh: Warehouse, ks: list[bytes], seed: int = 0, ctx: RequestCtx = CTX) -> None:
    await wh.put(ks, blocks(len(ks), seed), layout=LAYOUT, token_counts=[4] * len(ks), ctx=ctx)


def test_put_get_round_trip_and_write_once(redis_url: str, tmp_path: Path) -> None:
    async def body(wh: Warehouse) -> None:
        ks, data = keys(6), blocks(6)
        res = await wh.put(ks, data, layout=LAYOUT, token_counts=[4] * 6, ctx=CTX)
        assert (res.stored, res.skipped, res.bytes) == (6, 0, 6 * 1024)
        res = await wh.put(ks[:3], blocks(3, seed=9), layout=LAYOUT, token_counts=[4] * 3,
                           ctx=CTX)
        assert (res.stored, res.skipped) == (0, 3)                # keys are write-once
        got = await wh.get(ks, ctx=CTX)
        assert [f.tier for f in got] == ["G2"] * 6
        assert [bytes(f.payload) for f in got] == [bytes(d) for d in data]  # type: ignore[arg-type]
        assert got[0].meta is not None and got[0].meta.token_count == 4
        await wh.flush()
        entries = await wh.index.entries(ks)
        assert all(e is not None and e.tiers == G2 | G3 for e in entries)
        for k in ks:
            assert (tmp_path / key_relpath(k)).is_file()          # content-addressed path
        missing = await wh.get(keys(1, seed=5), ctx=CTX)
        assert missing[0].payload is None and missing[0].tier == ""
    with_wh({"g3": tmp_path}, body, redis_url)


def test_g2_eviction_leaves_blocks_in_g3_and_hits_promote(redis_url: str,
                                                          tmp_path: Path) -> None:
    async def body(wh: Warehouse) -> None:
        ks = keys(8)
        await put(wh, ks)
        await wh.flush()
        assert wh.g2 is not None and wh.g2.stats().blocks == 4   # G2 holds 4 blocks
        entries = await wh.index.entries(ks)
        assert [e.tiers for e in entries] == [G3] * 4 + [G2 | G3] * 4  # type: ignore[union-attr]
        lk = await wh.lookup(ks, prompt_tokens=33, ctx=CTX)
        assert lk.matched_blocks == 8 and lk.block_tiers == ["G3"] * 4 + ["G2"] * 4
        got = await wh.get(ks[:2], ctx=CTX)
        assert [f.tier for f in got] == ["G3", "G3"]
        assert [bytes(f.payload) for f in got] == [bytes(b) for b in blocks(8)[:2]]  # type: ignore[arg-type]
        entries = await wh.index.entries(ks[:2])
        assert all(e is not None and e.tiers == G2 | G3 for e in entries)  # promoted
        assert wh.g2.contains(ks[0]) and wh.g2.contains(ks[1])
    with_wh({"g3": tmp_path, "g2_bytes": 4 * 1024}, body, redis_url)


def test_g2_eviction_demotes_a_block_g3_lacks(redis_url: str, tmp_path: Path) -> None:
    async def body(wh: Warehouse) -> None:
        ks = keys(6)
        await put(wh, ks[:2])
        await wh.flush()
        g3 = wh.tiers["G3"]
        g3.delete(ks[0])                                           # G3 lost its copy
        await wh.index.remove([ks[0]], tier="G3")
        await put(wh, ks[2:], seed=1)                              # evicts ks[0] from G2
        await wh.flush()
        assert not wh.g2.contains(ks[0])  # type: ignore[union-attr]
        assert g3.contains(ks[0])                                  # demoted, not lost
        got = await wh.get(ks[:1], ctx=CTX)
        assert got[0].tier == "G3" and bytes(got[0].payload) == bytes(blocks(2)[0])  # type: ignore[arg-type]
    with_wh({"g3": tmp_path, "g2_bytes": 4 * 1024}, body, redis_url)


def test_g4_hits_promote_to_g2_and_land_in_g3(redis_url: str, tmp_path: Path) -> None:
    g4 = f"fsspec+file://{tmp_path / 'g4'}"

    async def body(wh: Warehouse) -> None:
        ks = keys(3)
        await put(wh, ks)
        await wh.flush()
        for k in ks:                                               # only G4 keeps them
            wh.tiers["G2"].delete(k)
            wh.tiers["G3"].delete(k)
        await wh.index.remove(ks, tier="G2")
        await wh.index.remove(ks, tier="G3")
        assert all(e is not None and e.tiers == G4 for e in await wh.index.entries(ks))
        got = await wh.get(ks, ctx=CTX)
        assert [f.tier for f in got] == ["G4"] * 3
        await wh.flush()
        assert all(e is not None and e.tiers == G2 | G3 | G4 for e in await wh.index.entries(ks))
    with_wh({"g3": tmp_path / "g3", "g4": g4}, body, redis_url)


def test_ttl_expiry_sweep_and_refresh_on_hit(redis_url: str, tmp_path: Path) -> None:
    """A 2-second class misses after expiry, its files are gone after a
    sweep, and a hit refreshes the TTL."""
    async def body(wh: Warehouse) -> None:
        kept, dropped = keys(2, seed=1), keys(2, seed=2)
        await put(wh, kept, ctx=FAST)
        await put(wh, dropped, seed=1, ctx=FAST)
        await wh.flush()
        assert (await wh.lookup(kept + dropped, prompt_tokens=17, ctx=FAST)).matched_blocks == 4
        for _ in range(3):                       # hits every 1.1 s keep `kept` alive ...
            await asyncio.sleep(1.1)
            assert (await wh.lookup(kept, prompt_tokens=9, ctx=FAST)).matched_blocks == 2
        # ... while `dropped`, untouched for 3.3 s, expired.
        assert (await wh.lookup(dropped, prompt_tokens=9, ctx=FAST)).matched_blocks == 0
        assert await wh.index.ttl(kept[0]) > 0.5
        report = await wh.sweep()
        assert report.deleted == {"G2": 2, "G3": 2}
        for k in dropped:
            assert not (tmp_path / key_relpath(k)).exists()
            assert not wh.tiers["G2"].contains(k)
        for k in kept:
            assert (tmp_path / key_relpath(k)).exists()
        await asyncio.sleep(2.2)                 # no more hits: `kept` expires too
        assert (await wh.lookup(kept, prompt_tokens=9, ctx=FAST)).matched_blocks == 0
        assert (await wh.sweep()).deleted == {"G2": 2, "G3": 2}
        assert list(tmp_path.rglob("*.kvb")) == []
    with_wh({"g3": tmp_path}, body, redis_url)


def test_corrupt_blocks_are_detected_counted_and_never_served(redis_url: str,
                                                             tmp_path: Path) -> None:
    """Integrity in-process (test_service covers it over gRPC after a restart)."""
    async def body(wh: Warehouse) -> None:
        ks, data = keys(6), blocks(6)
        await wh.put(ks, data, layout=LAYOUT, token_counts=[4] * 6, ctx=CTX)
        await wh.flush()
        for k in ks[:4]:
            wh.tiers["G2"].delete(k)
        await wh.index.remove(ks[:4], tier="G2")
        for k in ks[1:3]:                        # flip payload bytes of two G3 files
            path = tmp_path / key_relpath(k)
            raw = bytearray(path.read_bytes())
            raw[-10] ^= 0xFF
            path.write_bytes(bytes(raw))
        g2 = wh.g2
        assert g2 is not None                    # scribble over a G2 block in shared memory
        slot = g2.locate(ks[5])
        assert slot is not None
        seg = attach_segment(slot.shm_name)
        seg.buf[slot.offset] ^= 0xFF
        seg.close()
        got = await wh.get(ks, ctx=CTX)
        assert [f.payload is not None for f in got] == [True, False, False, True, True, True]
        assert got[5].tier == "G3"               # the scribbled G2 copy fell back to G3's
        for f, d in zip(got, data, strict=True):
            if f.payload is not None:
                assert bytes(f.payload) == bytes(d)
        assert wh.tiers["G3"].stats().checksum_failures == 2
        assert g2.stats().checksum_failures == 1
        # The index no longer promises what is gone: the chain now breaks at block 1.
        assert (await wh.lookup(ks, prompt_tokens=25, ctx=CTX)).matched_blocks == 1
        assert not (tmp_path / key_relpath(ks[1])).exists()
        text = wh.metrics.registry.get_sample_value("kvstore_checksum_failures_total",
                                                    {"tier": "G3"})
        assert text == 2
    with_wh({"g3": tmp_path}, body, redis_url)


def test_sweep_reindexes_blocks_whose_entry_vanished(redis_url: str, tmp_path: Path) -> None:
    async def body(wh: Warehouse) -> None:
        ks = keys(4)
        await put(wh, ks)
        await wh.flush()
        r = redis.Redis.from_url(redis_url)
        r.delete(*[b"B" + k for k in ks[:2]])    # lost, though not expired
        assert (await wh.lookup(ks, prompt_tokens=17, ctx=CTX)).matched_blocks == 0
        report = await wh.sweep()
        assert report.restored == 4 and report.deleted == {}   # 2 keys x (G2, G3)
        assert (await wh.lookup(ks, prompt_tokens=17, ctx=CTX)).matched_blocks == 4
        r.flushall()                             # Redis lost everything: rebuild, delete nothing
        report = await wh.sweep()
        assert report.rebuilt
        assert (await wh.lookup(ks, prompt_tokens=17, ctx=CTX)).matched_blocks == 4
        assert len(list(tmp_path.rglob("*.kvb"))) == 4
        r.close()
    with_wh({"g3": tmp_path}, body, redis_url)


def test_restart_clears_stale_g2_bits(redis_url: str, tmp_path: Path) -> None:
    async def main() -> None:
        cfg = wh_config(redis_url, g3=tmp_path)
        wh = await Warehouse(cfg).start()
        ks = keys(3)
        await put(wh, ks)
        await wh.flush()
        # A crash: no close(), G2 gone with the process.
        wh.tiers["G2"].close()
        for t in wh.writeback._tasks:
            t.cancel()
        await wh.index.close()
        wh2 = await Warehouse(cfg).start()
        try:
            assert all(e is not None and e.tiers == G3 for e in await wh2.index.entries(ks))
        finally:
            await wh2.close()
    asyncio.run(main())


def test_bad_requests(redis_url: str) -> None:
    async def body(wh: Warehouse) -> None:
        ks = keys(2)
        with pytest.raises(InvalidRequest, match="unknown traffic class"):
            await put(wh, ks, ctx=RequestCtx(traffic_class="batch"))
        with pytest.raises(InvalidRequest, match="same key twice"):
            await put(wh, [ks[0], ks[0]])
        with pytest.raises(InvalidRequest, match="checksum"):
            await wh.put(ks[:1], blocks(1), layout=LAYOUT, token_counts=[4], ctx=CTX,
                         checksums=[b"\0" * 16])
        with pytest.raises(InvalidRequest, match="prompt_tokens"):
            await wh.lookup(ks, prompt_tokens=7, ctx=CTX)
        with pytest.raises(InvalidRequest, match="tenant"):
            RequestCtx(tenant="bad tenant!")
        assert (await wh.lookup(ks, prompt_tokens=9, ctx=CTX)).matched_blocks == 0
        wh.accepting = False
        with pytest.raises(StoreDraining):
            await put(wh, ks)
    with_wh({}, body, redis_url)


def test_fingerprint_mismatch_is_a_miss(redis_url: str) -> None:
    async def body(wh: Warehouse) -> None:
        ks = keys(1)
        await put(wh, ks, ctx=RequestCtx(model_fingerprint="aa" * 16))
        other = await wh.get(ks, ctx=RequestCtx(model_fingerprint="bb" * 16))
        same = await wh.get(ks, ctx=RequestCtx(model_fingerprint="aa" * 16))
        assert other[0].payload is None and same[0].payload is not None
    with_wh({}, body, redis_url)


def test_stats_count_hits_and_misses_per_class(redis_url: str) -> None:
    async def body(wh: Warehouse) -> None:
        ks = keys(3)
        await put(wh, ks[:2])
        t0 = time.time()
        await wh.get(ks, ctx=CTX)
        s = await wh.stats()
        chat = next(c for c in s.classes if c.traffic_class == "chat")
        assert (chat.hits, chat.misses, chat.blocks) == (2, 1, 2)
        g2 = next(t for t in s.tiers if t.tier == "G2")
        assert g2.blocks == 2 and g2.used_bytes >= 2048
        assert s.shm_capable and s.node == "n1" and time.time() - t0 < 5
        await wh.lookup(ks, prompt_tokens=14, ctx=CTX)          # feeds the what-if estimator
        await wh.whatif_settled()
        doc = json.loads((await wh.stats()).whatif_json)
        assert doc["classes"]["chat"]["blocks"] == 3
        assert doc["uncacheable"]["chat"] == [1.0, 2.0]         # the 2-token tail
    with_wh({}, body, redis_url)


def test_blocks_per_class_survive_a_restart_on_a_fresh_redis(redis_url: str,
                                                              tmp_path: Path) -> None:
    """`kvserve up` restarts its embedded Redis empty: the store reindexes G3
    at start, and its per-class block counts show what G3 holds, not 0."""
    async def main() -> None:
        cfg = wh_config(redis_url, g3=tmp_path)
        wh = await Warehouse(cfg).start()
        await put(wh, keys(3))
        await put(wh, keys(2, seed=7), ctx=RequestCtx(tenant="t1", traffic_class="agent"))
        await wh.flush()
        await wh.close()
        r = redis.Redis.from_url(redis_url)
        r.flushall()                                          # the new, empty Redis
        r.close()
        wh2 = await Warehouse(cfg).start()
        try:
            counts = {c.traffic_class: c.blocks for c in (await wh2.stats()).classes}
            assert counts["chat"] == 3 and counts["agent"] == 2
        finally:
            await wh2.close()
    asyncio.run(main())
