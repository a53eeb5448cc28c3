"""Per-tenant quotas (docs/operators.md, "Per-tenant quotas"), against a real
``kvserve store serve`` process over mTLS and a real Redis, with tenant-scoped
identities from the session's deployment CA.

A tenant flooding the store past its quota evicts only its own blocks: another
tenant's blocks all stay, byte for byte. Operators' quotas live in Redis and
survive a store restart; the CLI sets and shows them. A tenant sees only its own
usage. The tenant-name table is bounded and lookups never grow it.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest
import redis

from common.config import QuotaSection, TierConfig
from kvstore.client import KVStoreClient
from kvstore.errors import AccessDenied, ResourceExhausted
from kvstore.index_ids import IDS_HASH
from kvstore.service import start_server
from kvstore.types import RequestCtx
from kvstore.warehouse import Warehouse, WarehouseConfig
from security.config import SecurityConfig
from security.pki import CertAuthority, CertRequest
from tests.kvstore.storeproc import LAYOUT, StoreProc, blocks, keys, write_config

ME = RequestCtx()          # a tenant identity names no tenant: it acts for its own


def run(fn: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(asyncio.wait_for(fn(), 120))


@pytest.fixture(scope="module")
def idents(tls_dir: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, SecurityConfig]:
    ca = CertAuthority.load(Path(tls_dir) / "ca")
    out = {"operator": SecurityConfig(tls_dir, role="operator"),
           "prefill": SecurityConfig(tls_dir, role="prefill")}
    for tenant in ("flood", "quiet"):
        d = tmp_path_factory.mktemp(f"tenant-{tenant}")
        ca.issue(CertRequest("tenant", tenant=tenant)).save(d)
        out[tenant] = SecurityConfig(str(d))
    return out


def _config(tmp_path: Path, quotas: str = "") -> Path:
    path = write_config(tmp_path / "kv.toml")
    path.write_text(path.read_text() + quotas)
    return path


def test_a_tenant_over_quota_never_evicts_another_tenants_blocks(
        redis_url: str, tmp_path: Path, idents: dict[str, SecurityConfig]) -> None:
    # G2 holds 16 blocks, G3 about 19 (files carry a header); flood may keep 4 KiB in G2
    # and 8 KiB in G3, so quiet's blocks plus flood's quota fit: nothing of quiet's goes.
    config = _config(tmp_path, '[quotas]\ng2 = { flood = "4KiB" }\ng3 = { flood = "8KiB" }\n')
    store = StoreProc.start(redis_url, tmp_path / "g3", g2_bytes="16KiB", config=config,
                            extra=["--g3-bytes", "32KiB"])
    quiet_keys, quiet_blocks = keys(6, seed=1), blocks(6, seed=1)

    async def body() -> None:
        async with KVStoreClient(store.address, security=idents["quiet"], use_shm=False) as q, \
                KVStoreClient(store.address, security=idents["flood"], use_shm=False) as f, \
                KVStoreClient(store.address, security=idents["operator"],
                              use_shm=False) as op:
            assert (await q.put(quiet_keys, quiet_blocks, layout=LAYOUT, token_count=4,
                                ctx=ME)).stored == 6
            for round_ in range(8):          # 80 blocks, 20x its G2 quota
                ks = keys(10, seed=100 + round_)
                await f.put(ks, blocks(10, seed=100 + round_), layout=LAYOUT, token_count=4,
                            ctx=ME)
            # Every one of quiet's blocks is still there, byte for byte.
            assert (await q.lookup(quiet_keys, prompt_tokens=6 * 4 + 1,
                                   ctx=ME)).matched_blocks == 6
            got = await q.get(quiet_keys, ctx=ME)
            assert [bytes(p) if p is not None else None for p in got.payloads] == \
                [bytes(b) for b in quiet_blocks]
            # flood stayed within its quotas, paying with its own blocks; it sees only
            # its own rows, quiet only quiet's, the operator everyone's.
            mine = {t.tier: t for t in (await f.stats()).tenants}
            assert {t.tenant for t in (await f.stats()).tenants} == {"flood"}
            assert mine["G2"].used_bytes <= 4096 and mine["G2"].quota_bytes == 4096
            assert mine["G3"].used_bytes <= 8192 and mine["G3"].quota_bytes == 8192
            assert mine["G2"].evictions > 0
            theirs = {t.tier: t for t in (await q.stats()).tenants}
            assert set(theirs) == {"G2", "G3"} and all(t.tenant == "quiet"
                                                      for t in theirs.values())
            assert theirs["G2"].evictions == theirs["G3"].evictions == 0
            assert theirs["G2"].quota_bytes == -1
            everyone = {(t.tier, t.tenant) for t in (await op.stats()).tenants}
            assert {("G2", "flood"), ("G2", "quiet")} <= everyone
            # Quotas are the operators' business.
            for who in (q, f):
                with pytest.raises(AccessDenied):
                    await who.set_quota("G2", "quiet", 0)
                with pytest.raises(AccessDenied):
                    await who.get_quotas()

    try:
        run(body)
    finally:
        store.terminate()


def _quota_cli(address: str, *args: str) -> list[dict[str, object]]:
    out = subprocess.run([sys.executable, "-m", "kvserve.cli", "store", "quota", "--address",
                          address, "--json", *args],
                         capture_output=True, text=True, timeout=60, check=True)
    return json.loads(out.stdout)


def test_operator_quotas_survive_a_store_restart_and_apply_at_once(
        redis_url: str, tmp_path: Path, idents: dict[str, SecurityConfig]) -> None:
    config = _config(tmp_path, '[quotas]\ng3 = { "*" = "1MiB" }\n')
    g3 = tmp_path / "g3"
    store = StoreProc.start(redis_url, g3, g2_bytes="64KiB", config=config)
    ks = keys(12, seed=5)

    async def fill() -> None:
        async with KVStoreClient(store.address, security=idents["prefill"],
                                 use_shm=False) as svc:
            await svc.put(ks, blocks(12, seed=5), layout=LAYOUT, token_count=4,
                          ctx=RequestCtx(tenant="acme"))

    async def read_back() -> None:
        async with KVStoreClient(store.address, security=idents["prefill"],
                                 use_shm=False) as svc:
            got = await svc.get(ks, ctx=RequestCtx(tenant="acme"))
            assert got.hit_prefix == 12

    async def acme_g2() -> tuple[int, int]:
        async with KVStoreClient(store.address, security=idents["operator"],
                                 use_shm=False) as op:
            row = next(t for t in (await op.stats()).tenants
                       if t.tier == "G2" and t.tenant == "acme")
            return row.used_bytes, row.quota_bytes

    try:
        run(fill)
        assert run_value(acme_g2) == (12 * 1024, -1)
        # An operator's quota applies at once: acme's own oldest blocks go.
        table = _quota_cli(store.address, "--tenant", "acme", "--tier", "G2", "--bytes", "4KiB")
        assert {"tier": "G2", "tenant": "acme", "quota_bytes": 4096,
                "source": "operator"} in table
        assert {"tier": "G3", "tenant": "*", "quota_bytes": 2**20, "source": "config"} in table
        assert run_value(acme_g2) == (4096, 4096)
        _quota_cli(store.address, "--tenant", "*", "--tier", "G3", "--unlimited")
    finally:
        store.terminate()
    store = StoreProc.start(redis_url, g3, g2_bytes="64KiB", config=config)
    try:
        table = _quota_cli(store.address)        # kept in Redis: the restarted store has them
        assert {"tier": "G2", "tenant": "acme", "quota_bytes": 4096,
                "source": "operator"} in table
        assert {"tier": "G3", "tenant": "*", "quota_bytes": None, "source": "operator"} in table
        run(read_back)                            # G3 hits come up into G2, within the quota
        assert run_value(acme_g2) == (4096, 4096)
        table = _quota_cli(store.address, "--tenant", "acme", "--tier", "G2", "--reset")
        assert not [e for e in table if e["tenant"] == "acme"]
    finally:
        store.terminate()


def run_value(fn: Callable[[], Awaitable[tuple[int, int]]]) -> tuple[int, int]:
    return asyncio.run(asyncio.wait_for(fn(), 60))


def test_the_tenant_name_table_is_bounded_and_lookups_never_grow_it(
        redis_url: str, idents: dict[str, SecurityConfig]) -> None:
    async def body() -> None:
        wh = await Warehouse(WarehouseConfig(
            redis_url=redis_url, tiers=TierConfig(g2_bytes=1 << 20),
            quotas=QuotaSection(max_tenants=3))).start()
        srv = await start_server(wh)
        r = redis.Redis.from_url(redis_url)
        try:
            async with KVStoreClient(f"127.0.0.1:{srv.port}", security=idents["prefill"],
                                     use_shm=False) as svc:
                for i in range(50):   # lookups and gets of names that never stored: nothing
                    ctx = RequestCtx(tenant=f"probe-{i}")
                    assert (await svc.lookup(keys(2), prompt_tokens=129,
                                             ctx=ctx)).matched_blocks == 0
                    assert (await svc.get(keys(2), ctx=ctx)).payloads == [None, None]
                assert r.hget(IDS_HASH, "tenant:#next") is None
                for i in range(3):
                    await svc.put(keys(1, seed=i), blocks(1), layout=LAYOUT, token_count=4,
                                  ctx=RequestCtx(tenant=f"t{i}"))
                with pytest.raises(ResourceExhausted, match="tenant-name table is full"):
                    await svc.put(keys(1, seed=9), blocks(1), layout=LAYOUT, token_count=4,
                                  ctx=RequestCtx(tenant="one-too-many"))
                # Names that hold an id keep working; the count is reported.
                await svc.put(keys(1, seed=8), blocks(1), layout=LAYOUT, token_count=4,
                              ctx=RequestCtx(tenant="t0"))
                s = await svc.stats()
                assert (s.tenant_names, s.max_tenants) == (3, 3)
        finally:
            r.close()
            await srv.drain(0)
            await wh.close()

    run(body)
