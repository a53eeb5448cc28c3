"""``kvserve bench store --redis-cluster N`` and ``--g4 URL``: the index on a
Redis Cluster beside one server, and G4 (e.g. S3) put/get, in the same run.

Rows:
- cluster_lookup_p50_ms / cluster_lookup_p99_ms: one lookup of a ``--chain``
  block chain on N local masters (+ N replicas) of the bundled redis-server,
  alternated lookup by lookup with the same chain on one server
  (``single_lookup_p99_ms``), so both see the same moments of the machine;
  cluster_lookup_ratio = cluster p99 / single p99 of those alternated runs;
- cluster_index_bytes_per_block: ``MEMORY USAGE`` of an entry on the cluster
  (the yardstick of docs/warehouse-sizing.md), and ..._all_in: growth of
  ``used_memory`` over every master per entry (slot bookkeeping included);
- failover_s: SIGKILL a master during back-to-back lookups; seconds from the
  kill to the first lookup that answers again (replica promoted);
- g4_put_gbps / g4_get_gbps: the blocks through the G4 tier (``ObjectTier``,
  checksum on read), g4_latency_ms: median get of a 4 KiB block.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from typing import Any

from benchmarks.harness import Goal, Timing, quantile
from common.config import TrafficClasses
from kvstore.errors import StoreUnavailable
from kvstore.index import BlockIndex, IndexRecord
from kvstore.redis_cluster import EmbeddedRedisCluster

CLUSTER_GOALS: tuple[Goal, ...] = (
    Goal("cluster lookup p99 < 2 ms (2,048-block chain, 3 masters)", "cluster_lookup_p99_ms",
         below=2.0),
    Goal("cluster index < 101 bytes per block (MEMORY USAGE)", "cluster_index_bytes_per_block",
         below=101.0),
)


def _p(times: list[float], q: float) -> float:
    """The ``q`` quantile, ms."""
    return quantile(times, q) * 1e3


def _chain(n: int, tag: bytes) -> list[bytes]:
    # Distinct random-looking keys (a counter hashed would do; these spread over slots).
    import hashlib

    return [hashlib.blake2b(tag + i.to_bytes(4, "little"), digest_size=16).digest()
            for i in range(n)]


async def _fill(ix: BlockIndex, ks: list[bytes]) -> None:
    for i in range(0, len(ks), 1024):
        await ix.add([IndexRecord(k, 2**20, "chat") for k in ks[i:i + 1024]], tier="G3")


async def _lookups(single_url: str, cluster_url: str, chain: int,
                   lookups: int) -> dict[str, float]:
    classes = TrafficClasses()
    one = await BlockIndex(single_url, node="bench-1", classes=classes,
                           publish_events=False).start()
    many = await BlockIndex(cluster_url, node="bench-c", classes=classes,
                            publish_events=False).start()
    ks = _chain(chain, b"bench-cluster")
    await _fill(one, ks)
    await _fill(many, ks)
    for _ in range(20):
        await one.match_chain(ks)
        await many.match_chain(ks)
    t_one: list[float] = []
    t_many: list[float] = []
    for _ in range(lookups):
        for ix, times in ((one, t_one), (many, t_many)):
            t0 = time.perf_counter()
            m = await ix.match_chain(ks, traffic_class="chat")
            times.append(time.perf_counter() - t0)
            if m.matched != chain:
                raise RuntimeError("a lookup lost blocks during the benchmark")
    await one.delete(ks)
    await one.close()
    await many.close()
    return {"single_lookup_p50_ms": _p(t_one, 0.5),
            "single_lookup_p99_ms": _p(t_one, 0.99),
            "cluster_lookup_p50_ms": _p(t_many, 0.5),
            "cluster_lookup_p99_ms": _p(t_many, 0.99),
            "cluster_lookup_ratio": _p(t_many, 0.99) / _p(t_one, 0.99)}


async def _memory(cluster: EmbeddedRedisCluster, n: int) -> dict[str, float]:
    import redis

    clients = [redis.Redis.from_url(cluster.node_url(p))
               for p in cluster.master_ports()]
    before = sum(int(c.info("memory")["used_memory"]) for c in clients)
    ix = await BlockIndex(cluster.url, node="bench-mem", classes=TrafficClasses(),
                          publish_events=False).start()
    ks = _chain(n, b"bench-memory")
    await _fill(ix, ks)
    after = sum(int(c.info("memory")["used_memory"]) for c in clients)
    sample = ks[:: max(1, n // 200)]
    usage = [int(await ix.memory_usage(k)) for k in sample]
    await ix.delete(ks)
    await ix.close()
    for c in clients:
        c.close()
    return {"cluster_index_bytes_per_block": statistics.mean(usage),
            "cluster_index_bytes_per_block_all_in": (after - before) / n}


async def _failover(cluster: EmbeddedRedisCluster, chain: int) -> float:
    ix = await BlockIndex(cluster.url, node="bench-fo", classes=TrafficClasses(),
                          publish_events=False).start()
    ks = _chain(chain, b"bench-failover")
    await _fill(ix, ks)
    import redis

    for p in cluster.master_ports():       # replicas hold every entry before the kill
        with redis.Redis.from_url(cluster.node_url(p)) as c:
            c.execute_command("WAIT", 1, 5000)
    killed = cluster.kill_master()
    t0 = time.monotonic()
    seconds = float("nan")
    while time.monotonic() - t0 < 60:
        try:
            m = await ix.match_chain(ks)
        except StoreUnavailable:
            await asyncio.sleep(0.01)
            continue
        if m.matched == chain:
            seconds = time.monotonic() - t0
            break
        raise RuntimeError(f"wrong answer after failover: {m.matched} of {chain} blocks")
    await ix.close()
    cluster.restart(killed)
    return seconds


def bench_cluster(masters: int, single_url: str, chain: int, lookups: int) -> dict[str, Any]:
    with EmbeddedRedisCluster(masters=masters) as cluster:
        out: dict[str, Any] = {"cluster_masters": masters}
        out.update(asyncio.run(_lookups(single_url, cluster.url, chain, lookups)))
        out.update(asyncio.run(_memory(cluster, 20_000)))
        out["failover_s"] = asyncio.run(_failover(cluster, chain))
    return out


def bench_g4(url: str, blocks: list[memoryview], repeats: int) -> dict[str, float]:
    """The blocks through G4 (fresh keys per pass: objects are write-once)."""
    import os

    from kvstore.blockfile import BlockMeta
    from kvstore.tiers.objstore import ObjectTier

    tier = ObjectTier(url, name="G4", capacity_bytes=1 << 50)
    total = sum(b.nbytes for b in blocks)
    put_s, get_s = [], []
    made: list[bytes] = []
    try:
        for _ in range(repeats):
            ks = [os.urandom(16) for _ in blocks]
            made += ks
            metas = [BlockMeta(k, "bench", "raw", 64, "chat", time.time() + 3600) for k in ks]
            t0 = time.perf_counter()
            for k, b, m in zip(ks, blocks, metas, strict=True):
                if not tier.put(k, b, m).stored:
                    raise RuntimeError("G4 refused a block")
            put_s.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            for k in ks:
                if tier.get(k) is None:
                    raise RuntimeError("G4 lost a block")
            get_s.append(time.perf_counter() - t0)
        small = os.urandom(16)
        made.append(small)
        tier.put(small, b"\0" * 4096, BlockMeta(small, "bench", "raw", 1, "chat",
                                                time.time() + 3600))
        lat = []
        for _ in range(20):
            t0 = time.perf_counter()
            tier.get(small)
            lat.append(time.perf_counter() - t0)
    finally:
        for k in made:
            tier.delete(k)
        tier.close()
    return {"g4_put_gbps": total / Timing(tuple(put_s)).min / 1e9,
            "g4_get_gbps": total / Timing(tuple(get_s)).min / 1e9,
            "g4_latency_ms": Timing(tuple(lat)).median * 1e3}


__all__ = ["CLUSTER_GOALS", "bench_cluster", "bench_g4"]
