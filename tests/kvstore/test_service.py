"""The gRPC service over real sockets: both transfer paths, health/reflection,
bad input, tenant isolation in every tier, integrity over gRPC, metrics."""

from __future__ import annotations

import asyncio
import urllib.request
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from kvstore.client import KVStoreClient
from kvstore.errors import InvalidRequest
from kvstore.keys import chain_keys
from kvstore.service import RunningServer, ServiceLimits, start_server
from kvstore.tiers.base import key_relpath
from kvstore.types import RequestCtx
from kvstore.warehouse import Warehouse, WarehouseConfig
from proto import common_pb2, kvstore_pb2
from tests.kvstore.storeproc import LAYOUT, blocks, keys, wh_config
from tests.tls import aio_channel, security

CTX = RequestCtx(tenant="acme")


@dataclass
class Served:
    wh: Warehouse
    server: RunningServer
    channel: grpc.aio.Channel

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.server.port}"


@asynccontextmanager
async def serving(cfg: WarehouseConfig, limits: ServiceLimits | None = None,
                  ) -> AsyncIterator[Served]:
    wh = await Warehouse(cfg).start()
    srv = await start_server(wh, limits=limits)
    channel = aio_channel(f"127.0.0.1:{srv.port}")
    try:
        yield Served(wh, srv, channel)
    finally:
        await channel.close()
        await srv.server.stop(0)
        await wh.close()


def run(body: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(body())  # type: ignore[arg-type]


@pytest.mark.parametrize("use_shm", [False, True])
def test_round_trip_through_the_service(redis_url: str, tmp_path: Path, use_shm: bool) -> None:
    async def body() -> None:
        async with serving(wh_config(redis_url, tmp_path, g2_bytes=64 * 1024)) as s, \
                KVStoreClient(s.address, use_shm=use_shm) as c:
            ks = keys(40)
            arr = np.random.default_rng(0).random((40, 2, 2, 2, 4, 8), dtype=np.float32)
            res = await c.put(ks, arr, layout=LAYOUT, token_count=4, ctx=CTX)
            assert (res.stored, res.skipped, res.bytes) == (40, 0, arr.nbytes)
            await s.wh.flush()
            lk = await c.lookup(ks + keys(1, seed=9), prompt_tokens=4 * 41 + 1, ctx=CTX)
            assert lk.matched_blocks == 40 and lk.usable_tokens == 160
            assert lk.block_tiers == ["G2"] * 40
            got = await c.get(ks + keys(1, seed=9), ctx=CTX)
            assert got.payloads[-1] is None and got.hit_prefix == 40
            for i, p in enumerate(got.payloads[:40]):
                assert p is not None and bytes(p) == arr[i].tobytes()
            assert got.tiers == ["shm" if use_shm else "grpc"] * 40 + [""]
            out = np.zeros_like(arr)                        # straight into a caller buffer
            got = await c.get(ks, ctx=CTX, out=out)
            assert np.array_equal(out, arr) and got.bytes == arr.nbytes
            for k in ks[:20]:                               # from G3 through either path
                s.wh.tiers["G2"].delete(k)
            got = await c.get(ks, ctx=CTX)
            assert [bytes(p) for p in got.payloads] == [a.tobytes() for a in arr]  # type: ignore[arg-type]
            async with KVStoreClient(s.address, security=security("operator")) as op:
                assert await op.delete(ks[:5], ctx=CTX) == 5    # maintenance: operators only
            assert (await c.lookup(ks, prompt_tokens=161, ctx=CTX)).matched_blocks == 0
    run(body)


@pytest.mark.parametrize("why", ["reused", "grace_over"])
def test_shm_get_never_serves_a_rewritten_slot(redis_url: str, tmp_path: Path, why: str) -> None:
    """A slot rewritten after the store located it (the reuse generation moved,
    or the grace window is over) is verified, and a bad copy is fetched again:
    the caller gets the stored bytes, never the scribble."""
    from kvstore.tiers.shm import GEN

    async def body() -> None:
        async with serving(wh_config(redis_url, tmp_path, g2_bytes=64 * 1024)) as s, \
                KVStoreClient(s.address, use_shm=True) as c:
            ks = keys(8)
            arr = np.random.default_rng(1).random((8, 2, 2, 2, 4, 8), dtype=np.float32)
            await c.put(ks, arr, layout=LAYOUT, token_count=4, ctx=CTX)
            await s.wh.flush()                              # G3 holds a good copy
            g2 = s.wh.tiers["G2"]
            slot = g2.locate(ks[3])
            assert slot is not None
            buf = g2._shm.buf
            buf[slot.offset:slot.offset + 64] = b"\xee" * 64   # a writer reused the slot
            if why == "reused":
                GEN.pack_into(buf, 0, g2._generation + 1)   # ...announced by the generation
            else:
                g2._arena.grace_s = 0.0                     # ...after the grace window
            out = np.zeros_like(arr)
            got = await c.get(ks, ctx=CTX, out=out)
            assert got.hit_prefix == 8 and got.tiers == ["shm"] * 8
            assert np.array_equal(out, arr)
    run(body)


def test_get_chunk_carries_descriptors_and_rejects_nesting() -> None:
    from kvstore.wire import WireError, decode_get_chunk, encode_get_chunks

    hdr = [kvstore_pb2.BlockHeader(key=k, size=64) for k in keys(3)]
    raw = encode_get_chunks([
        kvstore_pb2.GetChunk(header=hdr[0], shm_name="seg", shm_offset=64, shm_reuse_gen=2),
        kvstore_pb2.GetChunk(header=hdr[1], missing=True),
        kvstore_pb2.GetChunk(header=hdr[2], shm_name="seg", shm_offset=128)])
    parts = decode_get_chunk(raw).parts()
    assert [p.header.key for p in parts] == keys(3)          # type: ignore[union-attr]
    assert [(p.shm_offset, p.missing) for p in parts] == [(64, False), (0, True), (128, False)]
    assert kvstore_pb2.GetChunk.FromString(raw).more[0].missing  # plain protobuf agrees
    nested = kvstore_pb2.GetChunk(header=hdr[0], more=[kvstore_pb2.GetChunk(
        header=hdr[1], more=[kvstore_pb2.GetChunk(header=hdr[2])])])
    with pytest.raises(WireError, match="carries no more"):
        decode_get_chunk(nested.SerializeToString())
    with_data = kvstore_pb2.GetChunk(header=hdr[0], more=[kvstore_pb2.GetChunk(
        header=hdr[1], data=b"x")])
    with pytest.raises(WireError, match="without data"):
        decode_get_chunk(with_data.SerializeToString())


def test_health_and_reflection(redis_url: str) -> None:
    async def body() -> None:
        async with serving(wh_config(redis_url)) as s:
            health = health_pb2_grpc.HealthStub(s.channel)
            for name in ("", "kvserve.v1.KVStore"):
                r = await health.Check(health_pb2.HealthCheckRequest(service=name), timeout=5)
                assert r.status == health_pb2.HealthCheckResponse.SERVING
            refl = reflection_pb2_grpc.ServerReflectionStub(s.channel)
            call = refl.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(
                list_services="")]), timeout=5)
            names = [svc.name async for r in call for svc in r.list_services_response.service]
            assert "kvserve.v1.KVStore" in names and "grpc.health.v1.Health" in names
            await s.server.health.enter_graceful_shutdown()
            r = await health.Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
            assert r.status == health_pb2.HealthCheckResponse.NOT_SERVING
    run(body)


def _header(ks: list[bytes], *, size: int = 1024, layout: str = LAYOUT, tenant: str = "acme",
            token_count: int = 4) -> kvstore_pb2.PutChunk:
    return kvstore_pb2.PutChunk(header=kvstore_pb2.PutHeader(
        ctx=common_pb2.RequestContext(tenant=tenant), layout=layout,
        blocks=[kvstore_pb2.BlockHeader(key=k, size=size, token_count=token_count)
                for k in ks]))


def test_bad_input_is_invalid_argument_and_loses_nothing(redis_url: str) -> None:
    """Malformed or oversized requests are INVALID_ARGUMENT and leave the store intact."""
    limits = ServiceLimits(max_message_bytes=256 * 1024, max_put_bytes=1 << 20,
                           get_chunk_bytes=64 * 1024)

    async def body() -> None:
        async with serving(wh_config(redis_url), limits) as s, \
                KVStoreClient(s.address, use_shm=False) as c:
            good_keys, good = keys(4), blocks(4)
            await c.put(good_keys, good, layout=LAYOUT, token_count=4, ctx=CTX)
            ch = s.channel
            raw_put = ch.stream_unary("/kvserve.v1.KVStore/Put")
            put = ch.stream_unary("/kvserve.v1.KVStore/Put",
                                  request_serializer=kvstore_pb2.PutChunk.SerializeToString,
                                  response_deserializer=kvstore_pb2.PutResponse.FromString)
            ks = keys(2, seed=1)
            data = kvstore_pb2.PutChunk(data=b"\1" * 1024)

            async def expect(call: Awaitable[object], *words: str) -> None:
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await call
                assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
                for w in words:
                    assert w in (err.value.details() or ""), err.value.details()

            # Tenant and class names.
            await expect(put(iter([_header(ks, tenant="no spaces!"), data, data])), "tenant")
            bad_ctx = kvstore_pb2.LookupRequest(
                ctx=common_pb2.RequestContext(tenant="x" * 65), keys=ks, prompt_tokens=9)
            await expect(c._stub.Lookup(bad_ctx, timeout=5), "tenant")
            with pytest.raises(InvalidRequest, match="unknown traffic class"):
                await c.lookup(ks, prompt_tokens=9, ctx=RequestCtx(traffic_class="nope"))
            # Chunk order.
            await expect(put(iter([data, _header(ks)])), "wrong chunk order")
            await expect(put(iter([_header(ks), data, _header(ks), data])), "wrong chunk order")
            await expect(put(iter([])), "PutChunk")
            # Sizes: wrong payload size, short and long streams, oversized messages.
            await expect(put(iter([_header(ks, size=1000), data, data])), "wrong payload size")
            await expect(put(iter([_header(ks), data])), "ended after 1024 of the 2048")
            await expect(put(iter([_header(ks), data, data, data])), "more data")
            big = kvstore_pb2.PutChunk(data=b"\0" * (300 * 1024))
            await expect(put(iter([_header(ks), big])), "exceeds", "message limit")
            await expect(put(iter([_header(keys(2000, seed=3)), data])), "exceeds")
            await expect(put(iter([_header(ks, layout="L2xH2:fp32"), data, data])), "layout")
            await expect(put(iter([_header(ks, token_count=5), data, data])), "token_count")
            await expect(put(iter([_header([b"short", ks[0]]), data, data])), "16 bytes")
            await expect(put(iter([_header([ks[0], ks[0]]), data, data])), "same key twice")
            # Garbage bytes to every method.
            garbage = b"\xff" * 11
            await expect(raw_put(iter([garbage])), "not a valid protobuf")
            await expect(raw_put(iter([_header(ks).SerializeToString(), garbage])),
                         "not a valid protobuf")
            for method in ("Lookup", "Delete", "Stats"):
                await expect(ch.unary_unary(f"/kvserve.v1.KVStore/{method}")(garbage, timeout=5),
                             "not a valid protobuf")
            get = ch.unary_stream("/kvserve.v1.KVStore/Get")
            with pytest.raises(grpc.aio.AioRpcError) as err:
                [m async for m in get(garbage, timeout=5)]
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            # A message beyond even the transport limit: gRPC itself refuses it.
            huge = kvstore_pb2.PutChunk(data=b"\0" * (600 * 1024))
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await put(iter([_header(ks), huge]))
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            # Nothing was stored by any of that, and everything stored before is intact.
            assert s.wh.g2 is not None and s.wh.g2.stats().blocks == 4
            assert (await c.lookup(ks, prompt_tokens=9, ctx=CTX)).matched_blocks == 0
            got = await c.get(good_keys, ctx=CTX)
            assert [bytes(p) for p in got.payloads] == [bytes(b) for b in good]  # type: ignore[arg-type]
            res = await c.put(ks, blocks(2, seed=5), layout=LAYOUT, token_count=4, ctx=CTX)
            assert res.stored == 2                              # and it keeps serving
            errors = s.wh.metrics.registry.get_sample_value(
                "kvstore_rpc_errors_total", {"method": "Put", "code": "INVALID_ARGUMENT"})
            assert errors is not None and errors >= 14
    run(body)


def test_tenant_isolation_in_every_tier(redis_url: str, tmp_path: Path) -> None:
    """The same prompt under two tenants shares no key and never hits
    across tenants, whichever tier holds the blocks."""
    fp = bytes(range(16))
    tokens = list(range(1000, 1000 + 4 * 12))
    ka = chain_keys(tokens, block_tokens=4, tenant="alice", fingerprint=fp)
    kb = chain_keys(tokens, block_tokens=4, tenant="bob", fingerprint=fp)
    assert len(ka) == 12 and not set(ka) & set(kb)
    g4 = f"fsspec+file://{tmp_path / 'g4'}"
    alice, bob = RequestCtx(tenant="alice"), RequestCtx(tenant="bob")

    async def body() -> None:
        cfg = wh_config(redis_url, tmp_path / "g3", g2_bytes=6 * 1024, g4=g4)
        async with serving(cfg) as s, KVStoreClient(s.address) as c:
            await c.put(ka, blocks(12), layout=LAYOUT, token_count=4, ctx=alice)
            await s.wh.flush()
            for name, tier in s.wh.tiers.items():
                held = [k for k in ka if tier.contains(k)]
                assert held, f"{name} holds none of alice's blocks"
                assert not any(tier.contains(k) for k in kb), name
            assert {t for t in (await c.lookup(ka, prompt_tokens=49, ctx=alice)).block_tiers} \
                == {"G2", "G3"}
            lk = await c.lookup(kb, prompt_tokens=49, ctx=bob)
            assert lk.matched_blocks == 0 and lk.usable_tokens == 0
            got = await c.get(kb, ctx=bob)
            assert got.payloads == [None] * 12
            # Even with G2 and G3 emptied (only G4 left), bob still finds nothing.
            for k in ka:
                s.wh.tiers["G2"].delete(k)
                s.wh.tiers["G3"].delete(k)
            assert (await c.get(kb, ctx=bob)).payloads == [None] * 12
            assert (await c.get(ka, ctx=alice)).hit_prefix == 12   # from G4
    run(body)


def test_corrupt_files_after_restart_are_reported_missing(redis_url: str,
                                                         tmp_path: Path) -> None:
    """Over gRPC: flipped bytes in stored files are detected, counted,
    reported missing and never served."""
    async def body() -> None:
        ks, data = keys(8), blocks(8)
        cfg = wh_config(redis_url, tmp_path)
        async with serving(cfg) as s, KVStoreClient(s.address) as c:
            await c.put(ks, data, layout=LAYOUT, token_count=4, ctx=CTX)
            await s.wh.flush()
        flipped = [1, 4, 6]
        for i in flipped:
            path = tmp_path / key_relpath(ks[i])
            raw = bytearray(path.read_bytes())
            raw[len(raw) // 2 + 100] ^= 0x01                       # one bit of the payload
            path.write_bytes(bytes(raw))
        async with serving(cfg) as s, KVStoreClient(s.address) as c:   # restarted: G2 empty
            got = await c.get(ks, ctx=CTX)
            for i, p in enumerate(got.payloads):
                if i in flipped:
                    assert p is None
                else:
                    assert p is not None and bytes(p) == bytes(data[i])
            stats = await c.stats()
            g3 = next(t for t in stats.tiers if t.tier == "G3")
            assert g3.checksum_failures == len(flipped)
            assert (await c.lookup(ks, prompt_tokens=33, ctx=CTX)).matched_blocks == 1
            again = await c.get(ks, ctx=CTX)                         # never served later either
            assert [p is None for p in again.payloads] == [i in flipped for i in range(8)]
    run(body)


def test_metrics_endpoint(redis_url: str) -> None:
    async def body() -> None:
        async with serving(wh_config(redis_url)) as s, KVStoreClient(s.address) as c:
            srv = s.wh.metrics.serve(0)
            try:
                ks = keys(3)
                await c.put(ks[:2], blocks(2), layout=LAYOUT, token_count=4, ctx=CTX)
                await c.lookup(ks, prompt_tokens=13, ctx=CTX)
                await c.get(ks, ctx=CTX)
                text = await asyncio.to_thread(
                    lambda: urllib.request.urlopen(f"http://127.0.0.1:{srv.port}/metrics",
                                                   timeout=5).read().decode())
            finally:
                srv.close()
            assert 'kvstore_hits_total{tier="G2",traffic_class="chat"} 2.0' in text
            assert 'kvstore_misses_total{tier="G2",traffic_class="chat"} 1.0' in text
            assert 'kvstore_tier_blocks{tier="G2"} 2.0' in text
            assert "kvstore_lookup_seconds_count 1.0" in text
            assert 'kvstore_lookup_tokens_total{kind="matched"} 8.0' in text
            assert "kvstore_checksum_failures_total" in text
    run(body)
