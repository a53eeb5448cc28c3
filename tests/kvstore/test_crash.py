"""Kill -9 the store during a stream of writes, 20 times; after each
restart no index entry points at a torn or missing block file."""

from __future__ import annotations

import asyncio
import contextlib
import random
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import redis

from kvstore.blockfile import decode_block
from kvstore.client import KVStoreClient
from kvstore.errors import KVStoreError
from kvstore.index import IDS_HASH, IndexEntry
from kvstore.integrity import block_mac
from kvstore.tiers.base import key_relpath
from kvstore.types import TIER_BITS, RequestCtx
from tests.kvstore.storeproc import LAYOUT, StoreProc, blocks, keys, write_config

ROUNDS = 20
CTX = RequestCtx(tenant="crash")


def audit(redis_url: str, g3_of_node: dict[str, Path]) -> int:
    """Every index entry names a tier holding a complete, verified block; returns
    the number of entries checked."""
    r = redis.Redis.from_url(redis_url)
    mac = block_mac(None)              # the deployment's (KVSERVE_TLS_DIR), as the store's
    dirs = {int(r.hget(IDS_HASH, f"node:n:{node}") or -1): g3 for node, g3 in g3_of_node.items()}
    checked = 0
    for name in r.scan_iter(match=b"B*", count=1000):
        if len(name) != 17:
            continue
        raw = r.get(name)
        if raw is None:                          # expired meanwhile
            continue
        entry = IndexEntry.unpack(raw)
        key = name[1:]
        g3 = dirs.get(entry.node_id)
        if g3 is None:                           # another node's entry (the other chain)
            continue
        assert not entry.tiers & TIER_BITS["G2"], f"{key.hex()}: G2 bit survived the restart"
        assert entry.tiers & TIER_BITS["G3"], f"{key.hex()}: no durable tier ({entry.tiers})"
        path = g3 / key_relpath(key)
        assert path.is_file(), f"{key.hex()}: index points at a missing file"
        block = decode_block(path.read_bytes(), key, mac=mac)   # raises on a torn file
        assert block.meta.size == 1024
        checked += 1
    r.close()
    for g3 in g3_of_node.values():
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
    await asyncio.sleep(rng.uniform(0.1, 0.35))
    store.kill()
    with contextlib.suppress(KVStoreError, TimeoutError):
        await asyncio.wait_for(task, timeout=10)
    return acked


def _chain(redis_url: str, root: Path, node: str, rounds: int, seed: int) -> tuple[int, int]:
    """Start, audit, write, kill -9; ``rounds`` times, then a last start and audit."""
    g3 = root / node
    config = write_config(root / f"{node}.toml")
    kills = acked = 0
    for i in range(rounds + 1):
        store = StoreProc.start(redis_url, g3, node=node, g2_bytes="32KiB", config=config)
        try:
            # The store cleared its G2 bits before answering: audit its node now.
            audit(redis_url, {node: g3})
        except BaseException:
            store.kill()                         # never leave a store behind a failure
            raise
        if i == rounds:
            store.terminate()
            break
        acked += asyncio.run(write_until_killed(store, seed=seed + i))
        kills += 1
    return kills, acked


def test_kill_9_during_writes_leaves_no_dangling_entries(redis_url: str, tmp_path: Path) -> None:
    # Two independent stores (nodes) take turns being killed, to halve the wall time.
    half = ROUNDS // 2
    with ThreadPoolExecutor(2) as pool:
        runs = [pool.submit(_chain, redis_url, tmp_path, f"crash-{n}", half, 1000 * n)
                for n in range(2)]
        results = [f.result() for f in runs]
    assert sum(k for k, _ in results) >= ROUNDS
    assert all(acked > 0 for _, acked in results)
    checked = audit(redis_url, {f"crash-{n}": tmp_path / f"crash-{n}" for n in range(2)})
    assert checked > 0                           # the runs wrote, and the audit saw entries
