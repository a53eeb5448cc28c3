"""Put acknowledgement per traffic class. ``ack = "g2"`` (the
default) answers once blocks are in host memory; ``ack = "durable"`` once they
are fsynced in G3 and indexed there. Checked: with ``durable``, after 20 kill -9
during writes, every acknowledged block is served intact."""

from __future__ import annotations

import asyncio
import contextlib
import random
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from common.config import ConfigError, HitRule, KVServeConfig, TierConfig, TrafficClasses
from kvstore.blockfile import decode_block
from kvstore.client import KVStoreClient
from kvstore.errors import KVStoreError
from kvstore.tiers.base import key_relpath
from kvstore.types import TIER_BITS, RequestCtx
from kvstore.warehouse import Warehouse, WarehouseConfig
from tests.kvstore.storeproc import LAYOUT, StoreProc, blocks, keys
from tests.security.tlsenv import tls_env  # noqa: F401 - a fixture

ROUNDS = 20
DURABLE = RequestCtx(tenant="ack", traffic_class="chat")
CLASSES = TrafficClasses(ttl_s={"agent": 3 * 86_400, "chat": 7 * 86_400},
                         ack={"chat": "durable"})


def test_ack_modes_are_validated() -> None:
    assert TrafficClasses().ack_mode("chat") == "g2"            # today's default
    assert CLASSES.ack_mode("chat") == "durable" and CLASSES.ack_mode("agent") == "g2"
    with pytest.raises(ConfigError, match="must be one of"):
        TrafficClasses(ack={"chat": "fsync"})
    with pytest.raises(ConfigError, match="not a class"):
        TrafficClasses(ack={"batch": "durable"})
    cfg = KVServeConfig.from_dict({"classes": {"ack": {"agent": "durable"}}})
    assert cfg.classes.ack_mode("agent") == "durable"
    with pytest.raises(ConfigError, match="needs a G3"):
        WarehouseConfig(redis_url="redis://x", classes=CLASSES)
    with pytest.raises(ConfigError, match="needs fsync"):
        WarehouseConfig(redis_url="redis://x", classes=CLASSES,
                        tiers=TierConfig(g3_path="/tmp/x"), fsync=False)


def test_a_durable_put_is_on_disk_and_indexed_when_it_returns(redis_url: str,
                                                              tmp_path: Path) -> None:
    async def body() -> None:
        cfg = WarehouseConfig(redis_url=redis_url, classes=CLASSES,
                              tiers=TierConfig(g2_bytes=1 << 20, g3_path=str(tmp_path),
                                               node="ack"),
                              hit_rule=HitRule(block_tokens=4), sweep_interval_s=0,
                              write_workers=1)
        async with Warehouse(cfg) as wh:
            ks, data = keys(16, seed=1), blocks(16, seed=1)
            # A "g2" put of the first half: in G2 at once, on disk later.
            await wh.put(ks[:8], data[:8], layout=LAYOUT, token_counts=[4] * 8,
                         ctx=RequestCtx(tenant="ack", traffic_class="agent"))
            # A durable put, no flush: every block (the g2-acked ones it repeats too)
            # is already a complete, verified G3 file with its G3 index bit.
            res = await wh.put(ks, data, layout=LAYOUT, token_counts=[4] * 16, ctx=DURABLE)
            assert res.stored == 8 and res.skipped == 8
            entries = await wh.index.entries(ks)
            for k, d, e in zip(ks, data, entries, strict=True):
                block = decode_block((tmp_path / key_relpath(k)).read_bytes(), expect_key=k)
                assert bytes(block.payload) == bytes(d)
                assert e is not None and e.tiers & TIER_BITS["G3"]
    asyncio.run(body())


def _config(path: Path) -> Path:
    path.write_text("[blocks]\nblock_tokens = 4\n[classes]\ndefault = \"chat\"\n"
                    "[classes.ttl_s]\nagent = 259200\nchat = 604800\n"
                    "[classes.ack]\nchat = \"durable\"\n")
    return path


async def _write_until_killed(store: StoreProc, seed: int,
                              acked: list[tuple[int, int]]) -> None:
    """Durable puts until a kill -9 at a random moment; records (seed, batch) of each
    put the store acknowledged."""
    rng = random.Random(seed)

    async def writer() -> None:
        async with KVStoreClient(store.address, timeout_s=5, use_shm=seed % 2 == 0) as c:
            batch = 0
            while True:
                await c.put(keys(8, seed=seed * 1000 + batch), blocks(8, seed=batch),
                            layout=LAYOUT, token_count=4, ctx=DURABLE)
                acked.append((seed, batch))
                batch += 1

    task = asyncio.create_task(writer())
    await asyncio.sleep(rng.uniform(0.1, 0.35))
    store.kill()
    with contextlib.suppress(KVStoreError, TimeoutError):
        await asyncio.wait_for(task, timeout=10)


async def _served_intact(store: StoreProc, acked: list[tuple[int, int]]) -> int:
    async with KVStoreClient(store.address, timeout_s=10, use_shm=False) as c:
        for seed, batch in acked:
            got = await c.get(keys(8, seed=seed * 1000 + batch), ctx=DURABLE)
            want = blocks(8, seed=batch)
            assert [bytes(p) if p is not None else None for p in got.payloads] == \
                [bytes(w) for w in want], f"acknowledged put {seed}/{batch} lost or torn"
    return 8 * len(acked)


def _chain(redis_url: str, root: Path, node: str, rounds: int, seed: int) -> tuple[int, int]:
    g3, config = root / node, _config(root / f"{node}.toml")
    acked: list[tuple[int, int]] = []
    kills = 0
    for i in range(rounds + 1):
        # G2 of 8 KiB: the restarted store serves everything from G3.
        store = StoreProc.start(redis_url, g3, node=node, g2_bytes="8KiB", config=config)
        try:
            # After each kill the round's acknowledged puts; after the last, all of them.
            check = acked if i == rounds else [a for a in acked if a[0] == seed + i - 1]
            assert asyncio.run(_served_intact(store, check)) == 8 * len(check)
            if i == rounds:
                break
            asyncio.run(_write_until_killed(store, seed + i, acked))
            kills += 1
        finally:
            store.kill()
    return kills, len(acked)


@pytest.mark.usefixtures("tls_env")
def test_durable_ack_survives_kill_9_during_writes(redis_url: str, tmp_path: Path) -> None:
    half = ROUNDS // 2
    with ThreadPoolExecutor(2) as pool:
        runs = [pool.submit(_chain, redis_url, tmp_path, f"ack-{n}", half, 1000 * n)
                for n in range(2)]
        results = [f.result() for f in runs]
    assert sum(k for k, _ in results) >= ROUNDS
    assert all(acked > 0 for _, acked in results)
