"""The block index, registry, KV events and maintenance on a real Redis Cluster
(3 masters + 3 replicas of the bundled redis-server): the same workload gives
the same results as on one server, and a killed master's replica takes over
without a wrong hit."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import numpy as np
import redis

from kvstore.errors import StoreUnavailable
from kvstore.events import EventReader
from kvstore.index import BlockIndex, IndexRecord
from kvstore.index_cluster import key_slots
from kvstore.redis_cluster import EmbeddedRedisCluster
from kvstore.registry import InstanceInfo, InstanceRegistry, LoadReport
from kvstore.types import RequestCtx
from kvstore.warehouse import Warehouse
from tests.kvstore.storeproc import LAYOUT, TEST_CLASSES, blocks, keys, wh_config

FAST = RequestCtx(traffic_class="fast")


async def _index(url: str, node: str) -> BlockIndex:
    return await BlockIndex(url, node=node, classes=TEST_CLASSES).start()


def _entries(raw: list[Any]) -> list[tuple[int, ...] | None]:
    # Everything but the refresh stamp (whole seconds of two runs may differ).
    return [None if e is None else (e.tiers, e.class_id, e.node_id, e.size) for e in raw]


async def _index_workload(url: str) -> list[object]:
    """Two nodes' index traffic: stores in three tiers, gaps, evictions, deletes."""
    a, b = await _index(url, "na"), await _index(url, "nb")
    reader = await EventReader(url).pin()
    ks = keys(600, seed=3)
    out: list[object] = []
    out.append(await a.add([IndexRecord(k, 100, "chat") for k in ks[:400]], tier="G2"))
    out.append(await a.add([IndexRecord(k, 100, "chat") for k in ks[:300]], tier="G3"))
    out.append(await b.add([IndexRecord(k, 200, "agent") for k in ks[200:500]], tier="G2"))
    out.append(await b.add([IndexRecord(k, 300, "chat") for k in ks[450:600]], tier="G4"))
    for ix in (a, b):
        for local in (True, False):
            m = await ix.match_chain(ks, traffic_class="agent", local_only=local)
            out.append((m.matched, _entries(m.entries)))
    out.append(await a.remove(ks[100:120], tier="G2"))
    out.append(await a.remove(ks[100:110], tier="G3"))      # a gap: entries gone
    out.append((await a.match_chain(ks)).matched)
    out.append((await b.match_chain(ks[110:], local_only=False)).matched)
    out.append(await b.delete(ks[250:260]))
    out.append(_entries(await a.entries(ks[95:125] + ks[245:265])))
    out.append(sorted([k async for k in a.scan_keys()]))
    out.append(await a.reconcile_g2())
    out.append((await b.match_chain(ks[200:], local_only=True)).matched)
    events = await reader.read(block_ms=200, count=100)
    # Per-master scripts list an event's keys master by master: compare as sets.
    out.append([(e.kind, e.node, e.tier, sorted(e.keys)) for e in events])
    for ix in (a, b):
        await ix.close()
    await reader.close()
    return out


def test_index_workload_equals_single_server(redis_url: str, cluster_url: str) -> None:
    async def both() -> tuple[list[object], list[object]]:
        return await asyncio.gather(_index_workload(redis_url), _index_workload(cluster_url))

    single, cluster = asyncio.run(both())
    assert cluster == single
    assert single[4][0] == 400 and single[15] > 0 and len(single[17]) >= 8   # it did something


def test_cluster_lookup_fans_out_one_script_per_master(redis_cluster: EmbeddedRedisCluster,
                                                       cluster_url: str) -> None:
    async def body() -> None:
        ix = await _index(cluster_url, "n1")
        ks = keys(2048, seed=5)
        await ix.add([IndexRecord(k, 10, "chat") for k in ks], tier="G3")
        masters = redis_cluster.master_ports()
        clients = [redis.Redis.from_url(redis_cluster.node_url(p)) for p in masters]

        def evalsha_calls() -> list[int]:
            return [c.info("commandstats").get("cmdstat_evalsha", {}).get("calls", 0)
                    for c in clients]

        before = evalsha_calls()        # CONFIG RESETSTAT is disabled on our servers
        m = await ix.match_chain(ks)
        assert m.matched == 2048
        assert [a - b for a, b in zip(evalsha_calls(), before, strict=True)] == [1, 1, 1]
        rows = np.frombuffer(b"".join(b"B" + k for k in ks), np.uint8).reshape(-1, 17)
        per_master = [c.dbsize() for c in clients]
        assert sum(per_master) >= 2048 and min(per_master) > 500   # keys spread out
        assert len(set(key_slots(rows).tolist())) > 1500           # no hot slot
        for c in clients:
            c.close()
        await ix.close()
    asyncio.run(body())


async def _ttl_workload(url: str, g3: Path) -> list[object]:
    wh = await Warehouse(wh_config(url, g3=g3)).start()
    kept, dropped = keys(4, seed=1), keys(4, seed=2)
    out: list[object] = []
    try:
        for seed, ks in ((0, kept), (1, dropped)):
            await wh.put(ks, blocks(4, seed), layout=LAYOUT, token_counts=[4] * 4, ctx=FAST)
        await wh.flush()
        out.append((await wh.lookup(kept + dropped, prompt_tokens=33, ctx=FAST)).matched_blocks)
        for _ in range(2):                         # hits every 1.1 s keep `kept` alive
            await asyncio.sleep(1.1)
            out.append((await wh.lookup(kept, prompt_tokens=17, ctx=FAST)).matched_blocks)
        out.append((await wh.lookup(dropped, prompt_tokens=17, ctx=FAST)).matched_blocks)
        out.append(0.5 < await wh.index.ttl(kept[0]) <= 2.0)
        report = await wh.sweep()
        out.append((report.deleted, report.restored))
        # The index lost everything (a flush): the sweeper rebuilds it from the tiers.
        redis_flush(url)
        report = await wh.sweep()
        out.append((report.rebuilt, (await wh.lookup(kept, prompt_tokens=17,
                                                     ctx=FAST)).matched_blocks))
        out.append((await wh.reindex()).blocks)
    finally:
        await wh.close()
    return out


def redis_flush(url: str) -> None:
    from kvstore.redis_conn import connect_sync, is_cluster_url

    c = connect_sync(url)
    if is_cluster_url(url):
        c.flushall(target_nodes="primaries")  # type: ignore[call-arg]
    else:
        c.flushall()
    c.close()


def test_ttl_refresh_sweep_and_reindex_equal_single_server(redis_url: str, cluster_url: str,
                                                            tmp_path: Path) -> None:
    async def both() -> tuple[list[object], list[object]]:
        return await asyncio.gather(_ttl_workload(redis_url, tmp_path / "one"),
                                    _ttl_workload(cluster_url, tmp_path / "cluster"))

    single, cluster = asyncio.run(both())
    assert cluster == single
    assert single[:4] == [8, 4, 4, 0]                  # expiry and refresh really happened
    assert single[5] == ({"G2": 4, "G3": 4}, 0)


def test_registry_on_cluster(cluster_url: str) -> None:
    async def body() -> None:
        reg = InstanceRegistry(cluster_url, ttl_s=1.0)
        await reg.register(InstanceInfo(instance_id="p1", role="prefill", address="h:1"))
        await reg.register(InstanceInfo(instance_id="d1", role="decode", address="h:2"))
        assert await reg.heartbeat("p1", LoadReport(load=0.5))
        got = await reg.list_instances("prefill")
        assert [(i.instance_id, i.load) for i in got] == [("p1", 0.5)]
        await reg.deregister("d1")
        assert [i.instance_id for i in await reg.list_instances()] == ["p1"]
        await asyncio.sleep(1.2)                       # no heartbeat: expired
        assert await reg.list_instances() == []
        assert not await reg.heartbeat("p1")
        await reg.close()
    asyncio.run(body())


def test_master_killed_during_lookups_no_wrong_hit_then_resume(
        redis_cluster: EmbeddedRedisCluster, cluster_url: str) -> None:
    """kill -9 of a master while lookups run: every answer is either the true
    prefix or an error (counted, the caller recomputes); lookups resume once
    the replica is promoted."""
    async def body() -> tuple[list[int], int, float]:
        ix = await _index(cluster_url, "n1")
        ks = keys(512, seed=9)
        await ix.add([IndexRecord(k, 10, "chat") for k in ks[:384]], tier="G3")
        for p in redis_cluster.master_ports():          # replicas have every entry
            with redis.Redis.from_url(redis_cluster.node_url(p)) as c:
                assert c.execute_command("WAIT", 1, 5000) == 1
        seen: list[int] = []
        errors = 0
        killed_at = 0.0
        resumed_at = 0.0
        t_end = time.monotonic() + 30.0
        while time.monotonic() < t_end:
            if not killed_at and len(seen) >= 20:
                redis_cluster.kill_master()
                killed_at = time.monotonic()
            try:
                m = await ix.match_chain(ks)
            except StoreUnavailable:
                errors += 1
                await asyncio.sleep(0.05)
                continue
            seen.append(m.matched)
            assert m.matched == 384 and {e.size for e in m.entries} == {10}   # never wrong
            if killed_at and errors and not resumed_at:
                resumed_at = time.monotonic()
                break
        assert ix.cluster_errors == errors
        await ix.close()
        return seen, errors, resumed_at - killed_at

    dead = 0
    try:
        seen, errors, failover_s = asyncio.run(body())
        assert seen and seen[-1] == 384
        assert errors > 0 and failover_s > 0            # the outage was seen, then it ended
        assert failover_s < 20
    finally:
        for port in redis_cluster.ports:
            if port not in redis_cluster.live_ports():
                dead = port
        if dead:
            redis_cluster.restart(dead)
