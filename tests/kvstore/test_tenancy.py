"""Tenant-bound blocks (docs/security.md): a kvstore over real mTLS sockets and a
real Redis; identities from the session's deployment CA (tests/conftest.py).

An identity scoped to tenant B cannot Lookup, Get, Put or Delete tenant A's
blocks, not even knowing their keys; a block forged under A's key is refused
and A's answer is unchanged; services act for the tenant they name; only an
operator deletes.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path

import grpc
import numpy as np
import pytest

from common.config import TierConfig
from kvstore.client import KVStoreClient, ctx_to_proto
from kvstore.errors import AccessDenied
from kvstore.keys import chain_keys
from kvstore.service import start_server
from kvstore.types import RequestCtx
from kvstore.warehouse import Warehouse, WarehouseConfig
from proto import kvstore_pb2
from security.config import SecurityConfig
from security.identity import TENANT_METADATA
from security.pki import CertAuthority, CertRequest

LAYOUT = "L1xH1xT16xD8:float32"              # 1*2*1*16*8*4 = 1,024-byte blocks
FP = bytes(range(16))


def run(fn: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(asyncio.wait_for(fn(), 60))


@pytest.fixture(scope="module")
def idents(tls_dir: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, SecurityConfig]:
    ca = CertAuthority.load(Path(tls_dir) / "ca")
    out = {"operator": SecurityConfig(tls_dir, role="operator"),
           "prefill": SecurityConfig(tls_dir, role="prefill")}
    for tenant in ("acme", "evil"):
        d = tmp_path_factory.mktemp(f"tenant-{tenant}")
        ca.issue(CertRequest("tenant", tenant=tenant)).save(d)
        out[tenant] = SecurityConfig(str(d))
    return out


@asynccontextmanager
async def store(redis_url: str) -> AsyncIterator[str]:
    wh = await Warehouse(WarehouseConfig(redis_url=redis_url,
                                         tiers=TierConfig(g2_bytes=8 * 2**20))).start()
    srv = await start_server(wh)        # mTLS from KVSERVE_TLS_DIR, as deployed
    try:
        yield f"127.0.0.1:{srv.port}"
    finally:
        await srv.drain(0)
        await wh.close()


def blocks(n: int, fill: float) -> np.ndarray:
    return np.full((n, 1, 2, 1, 16, 8), fill, dtype=np.float32)


def test_another_tenant_can_neither_read_write_nor_delete(redis_url: str,
                                                         idents: dict[str, SecurityConfig]
                                                         ) -> None:
    secret = idents["operator"].require_secret()
    tokens = list(range(1, 16 * 6 + 1))
    keys = chain_keys(tokens, block_tokens=16, tenant="acme", fingerprint=FP, secret=secret)
    a_keys, next_key = keys[:4], keys[4]
    mine = blocks(4, 1.5)

    async def body() -> None:
        async with store(redis_url) as addr, \
                KVStoreClient(addr, security=idents["acme"], use_shm=False) as a, \
                KVStoreClient(addr, security=idents["evil"], use_shm=False) as b:
            # A tenant identity names no tenant: it is its own.
            assert (await a.put(a_keys, mine, layout=LAYOUT, token_count=16,
                                ctx=RequestCtx())).stored == 4
            # B knows A's keys (say they leaked) and tries everything.
            miss = await b.lookup(a_keys, prompt_tokens=1000, ctx=RequestCtx())
            assert miss.matched_blocks == 0                  # its own namespace: nothing
            assert (await b.get(a_keys, ctx=RequestCtx())).payloads == [None] * 4
            for attempt in (
                    lambda: b.lookup(a_keys, prompt_tokens=1000, ctx=RequestCtx(tenant="acme")),
                    lambda: b.get(a_keys, ctx=RequestCtx(tenant="acme")),
                    lambda: b.put(a_keys, blocks(4, 9.0), layout=LAYOUT, token_count=16,
                                  ctx=RequestCtx()),          # forging under A's keys
                    lambda: b.put(a_keys, blocks(4, 9.0), layout=LAYOUT, token_count=16,
                                  ctx=RequestCtx(tenant="acme")),
                    lambda: b.delete(a_keys, ctx=RequestCtx()),
                    lambda: b.delete(a_keys, ctx=RequestCtx(tenant="acme"))):
                with pytest.raises(AccessDenied):
                    await attempt()
            # Claiming A through the tenant metadata is refused the same way.
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await b._stub.Lookup(kvstore_pb2.LookupRequest(
                    ctx=ctx_to_proto(RequestCtx()), keys=a_keys, prompt_tokens=1000),
                    metadata=((TENANT_METADATA, "acme"),), timeout=5)
            assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
            # B pre-claims A's NEXT key (before A ever stores it): A never gets B's bytes.
            await b.put([next_key], blocks(1, 7.0), layout=LAYOUT, token_count=16,
                        ctx=RequestCtx())
            # A's answer is unchanged: 4 blocks, its own bytes, B's block not matched.
            hit = await a.lookup(keys, prompt_tokens=1000, ctx=RequestCtx())
            assert hit.matched_blocks == 4
            got = await a.get(keys[:5], ctx=RequestCtx())
            assert got.payloads[4] is None
            for i in range(4):
                assert bytes(got.payloads[i]) == mine[i].tobytes()
            with pytest.raises(AccessDenied):   # A's own forged-key collision: refused too
                await a.put([next_key], blocks(1, 2.0), layout=LAYOUT, token_count=16,
                            ctx=RequestCtx())
    run(body)


def test_services_act_for_the_tenant_they_name_and_only_operators_delete(
        redis_url: str, idents: dict[str, SecurityConfig]) -> None:
    keys = chain_keys(list(range(64)), block_tokens=16, tenant="acme", fingerprint=FP,
                      secret=idents["operator"].require_secret())
    acme = RequestCtx(tenant="acme")

    async def body() -> None:
        async with store(redis_url) as addr, \
                KVStoreClient(addr, security=idents["prefill"], use_shm=False) as svc, \
                KVStoreClient(addr, security=idents["operator"], use_shm=False) as op, \
                KVStoreClient(addr, security=idents["acme"], use_shm=False) as a:
            await svc.put(keys, blocks(4, 3.0), layout=LAYOUT, token_count=16, ctx=acme)
            # What the service stored for acme is acme's: acme's own identity sees it.
            assert (await a.lookup(keys, prompt_tokens=1000, ctx=RequestCtx())).matched_blocks == 4
            # The same keys in another tenant's name match nothing.
            other = RequestCtx(tenant="someone-else")
            assert (await svc.lookup(keys, prompt_tokens=1000, ctx=other)).matched_blocks == 0
            assert (await svc.get(keys, ctx=other)).payloads == [None] * 4
            # Delete is maintenance: services and tenants are refused, operators may.
            for client in (svc, a):
                with pytest.raises(AccessDenied):
                    await client.delete(keys, ctx=acme)
            assert await op.delete(keys, ctx=acme) == 4
            assert (await a.lookup(keys, prompt_tokens=1000, ctx=RequestCtx())).matched_blocks == 0
    run(body)


def test_the_index_records_each_blocks_tenant_namespace(redis_url: str,
                                                       idents: dict[str, SecurityConfig]) -> None:
    from common.config import TrafficClasses
    from kvstore.index import BlockIndex

    keys = [bytes([i]) * 16 for i in range(1, 4)]

    async def body() -> None:
        async with store(redis_url) as addr, \
                KVStoreClient(addr, security=idents["acme"], use_shm=False) as a, \
                KVStoreClient(addr, security=idents["evil"], use_shm=False) as b:
            await a.put(keys[:2], blocks(2, 1.0), layout=LAYOUT, token_count=16, ctx=RequestCtx())
            await b.put(keys[2:], blocks(1, 1.0), layout=LAYOUT, token_count=16, ctx=RequestCtx())
        async with BlockIndex(redis_url, node="audit", classes=TrafficClasses(),
                              publish_events=False) as ix:
            acme, evil = await ix.tenant_id("acme"), await ix.tenant_id("evil")
            assert acme != evil
            entries = await ix.entries(keys)
            assert [e.tenant_id for e in entries if e] == [acme, acme, evil]
            # A chain lookup in one namespace stops at the first block of another.
            assert (await ix.match_chain(keys, tenant="acme", local_only=False)).matched == 2
            assert (await ix.match_chain(keys[2:], tenant="evil", local_only=False)).matched == 1
            assert (await ix.match_chain(keys, tenant="evil", local_only=False)).matched == 0
    run(body)
