"""An operator's ``Clear`` (kvstore/clear.py) against a real ``kvserve store serve``
process over mTLS and a real Redis: blocks in G2 and G3 are dropped with their
index entries, the tier and per-tenant accounting reads zero, a Get racing the
clear gets the exact bytes or a miss, the store keeps serving, and only operators
(and the router) may call it; ``kvserve store clear`` refuses without ``--yes``."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import pytest
import redis

from kvstore.client import KVStoreClient
from kvstore.errors import AccessDenied, InvalidRequest
from kvstore.index import g2_set_name, index_key
from kvstore.types import RequestCtx
from security.config import SecurityConfig
from security.methods import may_call
from security.pki import CertAuthority, CertRequest
from tests.kvstore.storeproc import BLOCK_BYTES, LAYOUT, StoreProc, blocks, keys, write_config

ACME = RequestCtx(tenant="acme", traffic_class="chat")
OTHER = RequestCtx(tenant="other", traffic_class="chat")


@pytest.fixture(scope="module")
def idents(tls_dir: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, SecurityConfig]:
    ca = CertAuthority.load(Path(tls_dir) / "ca")
    out = {"operator": SecurityConfig(tls_dir, role="operator"),
           "prefill": SecurityConfig(tls_dir, role="prefill"),
           "engine": SecurityConfig(tls_dir, role="engine")}
    d = tmp_path_factory.mktemp("tenant-acme")
    ca.issue(CertRequest("tenant", tenant="acme")).save(d)
    out["tenant"] = SecurityConfig(str(d))
    return out


def _clear_cli(address: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvserve.cli", "store", "clear", "--address",
                           address, *args], capture_output=True, text=True, timeout=60)


def test_clear_drops_every_tier_and_its_index_and_only_operators_may(
        redis_url: str, tmp_path: Path, idents: dict[str, SecurityConfig]) -> None:
    # "chat" puts answer once fsynced in G3: every block is in G2 and in G3 before Clear.
    config = write_config(tmp_path / "kv.toml")
    config.write_text(config.read_text() + '[classes.ack]\nchat = "durable"\n')
    g3 = tmp_path / "g3"
    store = StoreProc.start(redis_url, g3, g2_bytes="64KiB", config=config)
    acme_keys, acme_blocks = keys(12, seed=1), blocks(12, seed=1)
    other_keys = keys(4, seed=2)
    r = redis.Redis.from_url(redis_url)

    async def body() -> None:
        async with KVStoreClient(store.address, security=idents["prefill"], use_shm=False) as svc, \
                KVStoreClient(store.address, security=idents["operator"], use_shm=False) as op:
            await svc.put(acme_keys, acme_blocks, layout=LAYOUT, token_count=4, ctx=ACME)
            await svc.put(other_keys, blocks(4, seed=2), layout=LAYOUT, token_count=4, ctx=OTHER)
            tiers = {t.tier: t for t in (await op.stats()).tiers}
            assert tiers["G2"].blocks == tiers["G3"].blocks == 16

            # Tenants and engines may not; nothing is dropped by their attempt.
            for who in ("tenant", "engine"):
                async with KVStoreClient(store.address, security=idents[who],
                                         use_shm=False) as c:
                    with pytest.raises(AccessDenied, match="PERMISSION_DENIED"):
                        await c.clear()
            with pytest.raises(InvalidRequest):
                await op.clear(tenant="no such/name")

            # One tenant's blocks only: the other tenant keeps every byte.
            res = await op.clear(tenant="other")
            assert {t.tier: (t.blocks, t.bytes) for t in res.tiers} == {
                "G2": (4, 4 * BLOCK_BYTES), "G3": (4, res.tiers[1].bytes)}
            assert res.tiers[1].bytes >= 4 * BLOCK_BYTES and res.pending_blocks == 0
            assert (await svc.lookup(other_keys, prompt_tokens=17, ctx=OTHER)).matched_blocks == 0
            assert (await svc.lookup(acme_keys, prompt_tokens=49, ctx=ACME)).matched_blocks == 12

            # A Get racing the full clear: exact bytes or a miss, never anything else.
            seen: list[list[bytes | None]] = []
            cleared = asyncio.Event()

            async def reader() -> None:
                while not cleared.is_set():
                    got = await svc.get(acme_keys, ctx=ACME)
                    seen.append([bytes(p) if p is not None else None for p in got.payloads])

            task = asyncio.create_task(reader())
            await asyncio.sleep(0)
            res = await op.clear()
            cleared.set()
            await task
            want = [bytes(b) for b in acme_blocks]
            assert seen and all(p is None or p == want[i]
                                for row in seen for i, p in enumerate(row))
            dropped = {t.tier: t.blocks for t in res.tiers}
            # Reads promote nothing here (G2 holds every block), so exactly acme's 12 go.
            assert dropped == {"G2": 12, "G3": 12}

            # Gone from the index, the tiers and the accounting.
            assert (await svc.lookup(acme_keys, prompt_tokens=49, ctx=ACME)).matched_blocks == 0
            assert (await svc.get(acme_keys, ctx=ACME)).payloads == [None] * 12
            s = await op.stats()
            assert [(t.tier, t.used_bytes, t.blocks) for t in s.tiers] == [
                ("G2", 0, 0), ("G3", 0, 0)]
            assert all(t.used_bytes == 0 and t.blocks == 0 for t in s.tenants)
            assert not any(r.exists(index_key(k)) for k in acme_keys + other_keys)
            assert r.scard(g2_set_name("n1")) == 0
            assert not list(g3.rglob("*.kvb"))

            # The store keeps serving: the same keys are stored anew, not skipped.
            again = await svc.put(acme_keys[:3], acme_blocks[:3], layout=LAYOUT, token_count=4,
                                  ctx=ACME)
            assert (again.stored, again.skipped) == (3, 0)

        # The CLI: nothing without --yes (one line saying so), then what it dropped.
        no = _clear_cli(store.address)
        assert no.returncode == 2 and "--yes" in no.stderr and len(no.stderr.splitlines()) == 1
        yes = _clear_cli(store.address, "--yes", "--json")
        assert yes.returncode == 0, yes.stderr
        out = json.loads(yes.stdout)
        assert {t["tier"]: t["blocks"] for t in out["tiers"]} == {"G2": 3, "G3": 3}
        assert out["node"] == "n1"

    try:
        asyncio.run(asyncio.wait_for(body(), 120))
    finally:
        r.close()
        store.terminate()


def test_only_operators_and_the_router_may_clear() -> None:
    clear = "/kvserve.v1.KVStore/Clear"
    assert may_call("operator", clear, scoped=False)
    assert may_call("router", clear, scoped=False)
    for role in ("kvstore", "prefill", "decode", "engine", "tenant"):
        assert not may_call(role, clear, scoped=False)
    for role in ("operator", "router", "tenant", "engine"):
        assert not may_call(role, clear, scoped=True)
