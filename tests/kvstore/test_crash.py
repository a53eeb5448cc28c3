"""Must show 5: kill -9 the store during a stream of writes, 20 times; after each
restart no index entry points at a torn or missing block file."""

from __future__ import annotations

import asyncio
import random
import struct
from pathlib import Path

import redis

from kvstore.blockfile import decode_block
from kvstore.client import KVStoreClient
from kvstore.errors import KVStoreError
from kvstore.tiers.base import key_relpath
from kvstore.types import TIER_BITS, RequestCtx
from tests.kvstore.storeproc import LAYOUT, StoreProc, blocks, keys, write_config

ROUNDS = 20
CTX = RequestCtx(tenant="crash")


def audit(redis_url: str, g3: Path) -> int:
    """Every index entry names a tier holding a complete, verified block; returns
    the number of entries checked."""
    r = redis.Redis.from_url(redis_url)
    checked = 0
    for name in r.scan_iter(match=b"B*", count=1000):
        if len(name) != 17:
            continue
        raw = r.get(name)
        if raw is None:                          # expired meanwhile
            continue
        mask = struct.unpack_from("<B", raw)[0]
        key = name[1:]
        assert not mask & TIER_BITS["G2"], f"{key.hex()}: G2 bit survived the restart"
        assert mask & TIER_BITS["G3"], f"{key.hex()}: entry with no durable tier ({mask})"
        path = g3 / key_relpath(key)
        assert path.is_file(), f"{key.hex()}: index points at a missing file"
        block = decode_block(path.read_bytes(), expect_key=key)   # raises on a torn file
        assert block.meta.size == 1024
        checked += 1
    r.close()
    assert not list(g3.rglob("*.tmp")), "temp files of interrupted writes were left behind"
    return checked


async def write_until_killed(store: StoreProc, seed: int) -> int:
    """Stream puts; kill -9 the store at a random moment mid-stream."""
    rng = random.Random(seed)
    acked = 0

    async def writer() -> None:
        nonlocal acked
        async with KVStoreClient(store.address, timeout_s=5, use_shm=seed % 2 == 0) as c:
            batch = 0
            while True:
                ks = keys(8, seed=seed * 1000 + batch)
                await c.put(ks, blocks(8, seed=batch), layout=LAYOUT, token_count=4, ctx=CTX)
                acked += 8
                batch += 1

    task = asyncio.create_task(writer())
    await asyncio.sleep(rng.uniform(0.15, 0.5))
    store.kill()
    try:
        await asyncio.wait_for(task, timeout=10)
    except (KVStoreError, TimeoutError):
        pass
    return acked


def test_kill_9_during_writes_leaves_no_dangling_entries(redis_url: str, tmp_path: Path) -> None:
    g3 = tmp_path / "g3"
    config = write_config(tmp_path / "kv.toml")
    kills = acked = checked = 0
    for i in range(ROUNDS + 1):
        store = StoreProc.start(redis_url, g3, g2_bytes="32KiB", config=config)
        checked = audit(redis_url, g3)
        if i == ROUNDS:
            store.terminate()
            break
        acked += asyncio.run(write_until_killed(store, seed=i))
        kills += 1
    assert kills == ROUNDS
    assert acked > 0 and checked > 0             # the runs wrote, and the audit saw entries
