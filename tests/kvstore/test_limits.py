"""The kvstore server's limits (kvstore/limits.py), over real mTLS sockets and a real
Redis: a Put is refused from its header, before any payload arrives, when its bytes
exceed the Put budget (RESOURCE_EXHAUSTED, with retry-after-ms when waiting helps);
calls beyond ``max_concurrent_rpcs`` are refused by gRPC; a caller's staging
segments stay within its share and never push out another caller's; a client
splits a large put into calls that fit the budget."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc
import pytest

from common.config import TierConfig
from kvstore.client import KVStoreClient, ctx_to_proto
from kvstore.errors import ResourceExhausted
from kvstore.limits import ServiceLimits
from kvstore.service import RunningServer, start_server
from kvstore.types import RequestCtx
from kvstore.warehouse import Warehouse, WarehouseConfig
from kvstore.wire import encode_put_data, encode_put_header
from proto import kvstore_pb2
from security.config import SecurityConfig
from security.pki import CertAuthority, CertRequest
from tests.kvstore.storeproc import LAYOUT, blocks, keys

CTX = RequestCtx(tenant="acme")
KIB = 1024


def run(fn: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(asyncio.wait_for(fn(), 120))


@pytest.fixture(scope="module")
def idents(tls_dir: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, SecurityConfig]:
    ca = CertAuthority.load(Path(tls_dir) / "ca")
    out = {role: SecurityConfig(tls_dir, role=role) for role in ("operator", "prefill", "decode")}
    for tenant in ("churn", "calm"):
        d = tmp_path_factory.mktemp(f"tenant-{tenant}")
        ca.issue(CertRequest("tenant", tenant=tenant)).save(d)
        out[tenant] = SecurityConfig(str(d))
    return out


async def _serve(redis_url: str, limits: ServiceLimits) -> tuple[Warehouse, RunningServer]:
    wh = await Warehouse(WarehouseConfig(redis_url=redis_url,
                                         tiers=TierConfig(g2_bytes=4 * 2**20))).start()
    return wh, await start_server(wh, limits=limits)


async def _until(cond: Callable[[], bool], what: str) -> None:
    """Wait for a condition the server reaches on its own (never a fixed sleep)."""
    for _ in range(2000):
        if cond():
            return
        await asyncio.sleep(0.005)
    raise AssertionError(f"timed out waiting for {what}")


class HeldPut:
    """A Put whose header goes out at once and whose data waits for ``release``."""

    def __init__(self, client: KVStoreClient, n: int, seed: int) -> None:
        self.keys, self.blocks = keys(n, seed=seed), blocks(n, seed=seed)
        self.release = asyncio.Event()
        hdr = kvstore_pb2.PutHeader(ctx=ctx_to_proto(CTX), layout=LAYOUT, blocks=[
            kvstore_pb2.BlockHeader(key=k, size=KIB, token_count=4) for k in self.keys])
        self.call = client._put_call(self._chunks(hdr), timeout=60)

    async def _chunks(self, hdr: kvstore_pb2.PutHeader) -> AsyncIterator[bytes]:
        yield encode_put_header(hdr)
        await self.release.wait()
        for b in self.blocks:
            yield encode_put_data(b)

    async def refused(self) -> grpc.aio.AioRpcError:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await self.call
        return err.value


def test_a_put_over_the_budget_is_refused_before_any_payload(
        redis_url: str, idents: dict[str, SecurityConfig]) -> None:
    async def body() -> None:
        wh, srv = await _serve(redis_url, ServiceLimits(put_budget_bytes=64 * KIB))
        budget = srv.service.put_budget       # type: ignore[union-attr]
        try:
            async with KVStoreClient(f"127.0.0.1:{srv.port}", security=idents["prefill"],
                                     use_shm=False) as c:
                # Larger than the whole budget: refused on its header while its data is
                # still held back by the client; waiting would not help (no retry-after).
                big = HeldPut(c, 65, seed=1)
                err = await big.refused()
                assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                assert "exceeds this store's Put budget" in (err.details() or "")
                assert not [k for k, _ in err.trailing_metadata() or () if k == "retry-after-ms"]
                big.release.set()
                assert budget.in_flight == 0
                # Two puts that fit alone but not together: the second is told to retry.
                first = HeldPut(c, 48, seed=2)
                await _until(lambda: budget.in_flight == 48 * KIB, "the first put's header")
                second = HeldPut(c, 32, seed=3)
                err = await second.refused()
                second.release.set()
                assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                assert dict(err.trailing_metadata())["retry-after-ms"] == "100"
                with pytest.raises(ResourceExhausted) as mapped:   # through the client API
                    await c.put(second.keys, second.blocks, layout=LAYOUT, token_count=4,
                                ctx=CTX)
                assert mapped.value.retry_after_s == pytest.approx(0.1)
                first.release.set()
                assert (await first.call).stored_blocks == 48
                assert budget.in_flight == 0
                res = await c.put(second.keys, second.blocks, layout=LAYOUT, token_count=4,
                                  ctx=CTX)
                assert res.stored == 32
                lost = await c.lookup(big.keys, prompt_tokens=65 * 64, ctx=CTX)
                assert lost.matched_blocks == 0               # the refused put stored nothing
            # A client splits a put larger than the budget into calls that fit it.
            async with KVStoreClient(f"127.0.0.1:{srv.port}", security=idents["prefill"],
                                     use_shm=False, put_call_bytes=16 * KIB) as c:
                ks = keys(100, seed=4)
                res = await c.put(ks, blocks(100, seed=4), layout=LAYOUT, token_count=4,
                                  ctx=CTX)
                assert (res.stored, res.bytes) == (100, 100 * KIB)
            assert budget.refused == 3
        finally:
            await srv.drain(0)
            await wh.close()

    run(body)


def test_calls_beyond_max_concurrent_rpcs_are_refused(
        redis_url: str, idents: dict[str, SecurityConfig]) -> None:
    async def body() -> None:
        wh, srv = await _serve(redis_url, ServiceLimits(max_concurrent_rpcs=3))
        budget = srv.service.put_budget       # type: ignore[union-attr]
        try:
            async with KVStoreClient(f"127.0.0.1:{srv.port}", security=idents["prefill"],
                                     use_shm=False) as c:
                held = [HeldPut(c, 2, seed=10 + i) for i in range(3)]
                await _until(lambda: budget.in_flight == 3 * 2 * KIB, "three calls in flight")
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await c._stub.Lookup(kvstore_pb2.LookupRequest(
                        ctx=ctx_to_proto(CTX), keys=held[0].keys, prompt_tokens=999),
                        timeout=10)
                assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                assert "Concurrent RPC limit" in (err.value.details() or "")
                for h in held:
                    h.release.set()
                assert [(await h.call).stored_blocks for h in held] == [2, 2, 2]
                hit = await c.lookup(held[0].keys, prompt_tokens=999, ctx=CTX)
                assert hit.matched_blocks == 2
        finally:
            await srv.drain(0)
            await wh.close()

    run(body)


async def _stage(c: KVStoreClient, nbytes: int) -> Any:
    return await c._stub.Stage(kvstore_pb2.StageRequest(ctx=ctx_to_proto(RequestCtx()),
                                                        min_bytes=nbytes), timeout=10)


def test_a_caller_keeps_to_its_staging_share_and_cannot_churn_anothers(
        redis_url: str, idents: dict[str, SecurityConfig]) -> None:
    # An 8 MiB pool, 2 MiB per calling identity.
    limits = ServiceLimits(max_staging_bytes=8 * 2**20, staging_share=0.25)

    async def body() -> None:
        wh, srv = await _serve(redis_url, limits)
        staging = srv.service.staging          # type: ignore[union-attr]
        addr = f"127.0.0.1:{srv.port}"
        clients = {who: KVStoreClient(addr, security=idents[who], use_shm=True)
                   for who in ("calm", "churn", "prefill", "decode", "operator")}
        try:
            calm = clients["calm"]
            ks = keys(4, seed=20)
            await calm.put(ks, blocks(4, seed=20), layout=LAYOUT, token_count=4,
                           ctx=RequestCtx())
            (seg,) = calm._staging.segments()
            mine = seg.name                       # calm's segment, handed out by the store
            assert mine in staging
            churn = clients["churn"]
            for _ in range(12):                   # stage again and again
                await _stage(churn, 2**20)
            use = staging.usage()
            assert len(use) == 2 and all(n == 2 * 2**20 for n in use.values())
            assert mine in staging                # calm's segment survived the churn
            with pytest.raises(grpc.aio.AioRpcError) as err:          # beyond a share
                await _stage(churn, 3 * 2**20)
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "share" in (err.value.details() or "")
            await _stage(clients["prefill"], 2**20)
            await _stage(clients["decode"], 2**20)
            with pytest.raises(grpc.aio.AioRpcError) as err:          # the pool is full
                await _stage(clients["operator"], 2**20)
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "staging pool is full" in (err.value.details() or "")
            assert mine in staging
            # A client refused a segment streams instead: its put still lands.
            op_keys = keys(3, seed=21)
            res = await clients["operator"].put(op_keys, blocks(3, seed=21), layout=LAYOUT,
                                                token_count=4, ctx=CTX)
            assert res.stored == 3
            got = await calm.get(ks, ctx=RequestCtx())
            assert [bytes(p) for p in got.payloads] == [bytes(b) for b in blocks(4, seed=20)]
        finally:
            for c in clients.values():
                await c.close()
            await srv.drain(0)
            await wh.close()

    run(body)
