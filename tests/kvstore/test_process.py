"""The store as a real process (``kvserve store serve``): engine blocks survive a
restart and restore token-identically, ``kvserve store reindex``
after FLUSHALL, graceful drain, ``kvserve store stats``."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import pytest
import redis
import torch

from kvstore.client import KVStoreClient
from kvstore.keys import chain_keys
from kvstore.types import RequestCtx
from tests.kvstore.storeproc import LAYOUT, StoreProc, blocks, keys, write_config
from tests.redis_args import redis_args

CTX = RequestCtx(tenant="acme", traffic_class="agent")


def test_engine_blocks_survive_a_store_restart_token_identically(redis_url: str,
                                                                  tmp_path: Path) -> None:
    """Blocks an engine wrote survive a store restart and restore token-identically."""
    from engine import Engine, EngineConfig, SamplingParams

    torch.set_num_threads(1)
    cfg = EngineConfig(model="tiny-dense")
    eng = Engine(cfg)
    tokens = [(i * 37 + 11) % 250 + 1 for i in range(300)]   # 4 full blocks of 64 + 44
    sampling = SamplingParams(max_tokens=8)
    cold = eng.generate(tokens, sampling)
    eng.prefill("s", tokens, sampling=sampling)
    exported = eng.export_blocks("s")                          # [4, L, 2, H, 64, D]
    eng.free("s")
    ks = chain_keys(tokens, block_tokens=64, tenant=CTX.tenant, fingerprint=eng.fingerprint)
    assert exported.shape[0] == len(ks) == 4
    ctx = RequestCtx(tenant=CTX.tenant, model_fingerprint=eng.fingerprint_hex)

    async def put() -> None:
        async with KVStoreClient(store.address) as c:
            res = await c.put(ks, exported, layout=eng.layout.name, token_count=64, ctx=ctx)
            assert res.stored == 4

    async def fetch() -> torch.Tensor:
        async with KVStoreClient(store.address) as c:
            lk = await c.lookup(ks, prompt_tokens=len(tokens), ctx=ctx)
            assert lk.matched_blocks == 4 and lk.usable_tokens == 256
            assert lk.block_tiers == ["G3"] * 4                # G2 died with the process
            got = await c.get(ks, ctx=ctx)
        assert all(p is not None for p in got.payloads)
        flat = [torch.frombuffer(bytearray(p), dtype=torch.float32) for p in got.payloads]  # type: ignore[arg-type]
        return torch.stack(flat).view(exported.shape)

    config = write_config(tmp_path / "kv.toml", block_tokens=64)
    store = StoreProc.start(redis_url, tmp_path / "g3", config=config)
    try:
        asyncio.run(put())
    finally:
        assert store.terminate() == 0                          # drains the disk writes
    store = StoreProc.start(redis_url, tmp_path / "g3", config=config)
    try:
        restored = asyncio.run(fetch())
    finally:
        store.terminate()
    assert torch.equal(restored, exported)
    fresh = Engine(cfg)
    warm = fresh.generate(tokens, sampling, restored=restored)
    assert warm.prefill.restored_tokens == 256
    assert warm.tokens == cold.tokens


def _reindex_cli(redis_url: str, g3: Path, node: str) -> dict[str, object]:
    out = subprocess.run(
        [sys.executable, "-m", "kvserve.cli", "store", "reindex", *redis_args(redis_url),
         "--g3-path", str(g3), "--node", node, "--json"],
        capture_output=True, text=True, timeout=60, check=True)
    return json.loads(out.stdout)


def test_flushall_then_reindex_restores_every_block_on_disk(redis_url: str,
                                                            tmp_path: Path) -> None:
    """After FLUSHALL, ``store reindex`` indexes every block on disk again."""
    ks = keys(30)
    g3 = tmp_path / "g3"

    async def put_and_check() -> None:
        async with KVStoreClient(store.address) as c:
            await c.put(ks, blocks(30), layout=LAYOUT, token_count=4, ctx=CTX)

    async def lookup() -> int:
        async with KVStoreClient(store.address) as c:
            return (await c.lookup(ks, prompt_tokens=121, ctx=CTX)).matched_blocks

    config = write_config(tmp_path / "kv.toml")
    store = StoreProc.start(redis_url, g3, g2_bytes="8KiB", config=config)  # mostly on disk
    try:
        asyncio.run(put_and_check())
    finally:
        store.terminate()
    store = StoreProc.start(redis_url, g3, g2_bytes="8KiB", config=config)
    try:
        assert asyncio.run(lookup()) == 30
        redis.Redis.from_url(redis_url).flushall()
        assert asyncio.run(lookup()) == 0
        report = _reindex_cli(redis_url, g3, "n1")
        assert report["blocks"] == {"G3": 30} and report["total"] == 30
        assert asyncio.run(lookup()) == 30
    finally:
        store.terminate()


def test_sigterm_drains_and_stats_cli(redis_url: str, tmp_path: Path) -> None:
    store = StoreProc.start(redis_url, tmp_path / "g3")
    ks = keys(5)

    async def put() -> None:
        async with KVStoreClient(store.address) as c:
            await c.put(ks, blocks(5), layout=LAYOUT, token_count=4, ctx=CTX)

    try:
        asyncio.run(put())
        out = subprocess.run(
            [sys.executable, "-m", "kvserve.cli", "store", "stats", "--address", store.address,
             "--json"], capture_output=True, text=True, timeout=60, check=True)
        stats = json.loads(out.stdout)
        assert stats["node"] == "n1" and stats["shm_capable"]
        agent = next(c for c in stats["classes"] if c["traffic_class"] == "agent")
        assert agent["blocks"] == 5
    finally:
        rc = store.terminate()
    assert rc == 0
    # The drain flushed the queued disk writes before exiting.
    assert len(list((tmp_path / "g3").rglob("*.kvb"))) == 5
    r = redis.Redis.from_url(redis_url)
    assert r.smembers("kvserve:instances:kvstore") == set()             # deregistered
    r.close()


@pytest.mark.parametrize("bad", [["--port", "70000"], ["--config", "/nonexistent.toml"]])
def test_serve_rejects_bad_arguments(bad: list[str]) -> None:
    out = subprocess.run([sys.executable, "-m", "kvserve.cli", "store", "serve", *bad],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "kvserve: error" in out.stderr
