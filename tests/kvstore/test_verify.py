"""Issue 10, verify on every read path: a scribbled G2 slot is detected, counted and
never served, over same-host shared memory and over the socket, against a real
store process; a shared-memory Put is served only from a staging segment the
store handed to the same connection."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Sequence
from multiprocessing import shared_memory
from pathlib import Path

import grpc
import pytest

from kvstore.client import KVStoreClient
from kvstore.tiers.shm import ShmSlot, attach_segment
from kvstore.types import RequestCtx
from kvstore.wire import decode_get_chunk, encode_put_header
from proto import kvstore_pb2, kvstore_pb2_grpc
from tests.kvstore.storeproc import LAYOUT, StoreProc, blocks, keys, write_config
from tests.security.tlsenv import aio_channel, tls_env  # noqa: F401 - a fixture

CTX = RequestCtx(tenant="verify")
N = 60                      # scribbled slots per read path (the issue asks for >= 50)


@pytest.fixture()
def store(redis_url: str, tmp_path: Path, tls_env: str):  # type: ignore[no-untyped-def]  # noqa: F811
    proc = StoreProc.start(redis_url, None, node="verify", g2_bytes="4MiB",
                           config=write_config(tmp_path / "kv.toml"))
    try:
        yield proc
    finally:
        proc.terminate()


async def slots_of(address: str, ks: Sequence[bytes], tenant: str = CTX.tenant,
                   ) -> list[ShmSlot]:
    """The G2 descriptors the store hands a same-host reader for ``ks``."""
    async with aio_channel(address, "kvstore") as ch:
        call = ch.unary_stream("/kvserve.v1.KVStore/Get",
                               request_serializer=kvstore_pb2.GetRequest.SerializeToString,
                               response_deserializer=decode_get_chunk)
        out = []
        req = kvstore_pb2.GetRequest(ctx={"tenant": tenant}, keys=ks, use_shm=True)
        async for msg in call(req, timeout=10):
            for p in msg.parts():
                assert p.header is not None and p.shm_name, "every block is a G2 slot"
                out.append(ShmSlot(p.shm_name, p.shm_offset, p.header.size, p.header.checksum))
    assert len(out) == len(ks)
    return out


def scribble(slots: Sequence[ShmSlot], seed: int) -> None:
    """What any process of the store's user can do: flip one byte of every slot."""
    rng = random.Random(seed)
    seg = attach_segment(slots[0].shm_name)
    try:
        for s in slots:
            seg.buf[s.offset + rng.randrange(s.size)] ^= 0xFF
    finally:
        seg.close()


async def g2_failures(c: KVStoreClient) -> int:
    return next(t.checksum_failures for t in (await c.stats()).tiers if t.tier == "G2")


@pytest.mark.parametrize("use_shm", [True, False], ids=["shm", "socket"])
def test_every_scribbled_g2_slot_is_detected_counted_and_never_served(
        store: StoreProc, use_shm: bool) -> None:
    async def body() -> None:
        async with KVStoreClient(store.address, timeout_s=10, use_shm=use_shm) as c:
            ks, data = keys(N, seed=7 + use_shm), blocks(N, seed=3)
            assert (await c.put(ks, data, layout=LAYOUT, token_count=4, ctx=CTX)).stored == N
            clean = await c.get(ks, ctx=CTX)            # intact slots are served
            assert [bytes(p or b"") for p in clean.payloads] == [bytes(d) for d in data]
            assert clean.tiers == (["shm"] if use_shm else ["grpc"]) * N
            scribble(await slots_of(store.address, ks), seed=11)
            before = await g2_failures(c)
            got = await c.get(ks, ctx=CTX)
            # Never served: every block comes back missing (no lower tier holds one).
            assert got.payloads == [None] * N
            # Detected and counted: by the client's verified copy (shm path) and, on the
            # socket refetch or socket read, by the store, which drops each bad block.
            assert await g2_failures(c) - before == N
            assert c.shm_verify_failures == (N if use_shm else 0)
            # ...so the index stops promising them: a reader recomputes them.
            res = await c.lookup(ks, prompt_tokens=4 * N + 1, ctx=CTX)
            assert res.matched_blocks == 0
            # Recomputed blocks put again are served intact.
            await c.put(ks, data, layout=LAYOUT, token_count=4, ctx=CTX)
            again = await c.get(ks, ctx=CTX)
            assert [bytes(p or b"") for p in again.payloads] == [bytes(d) for d in data]
    asyncio.run(body())


def _put_header(ks: Sequence[bytes], shm_name: str) -> bytes:
    hdr = kvstore_pb2.PutHeader(
        ctx={"tenant": CTX.tenant}, layout=LAYOUT, shm_name=shm_name, shm_offset=0,
        blocks=[kvstore_pb2.BlockHeader(key=k, size=1024, token_count=4) for k in ks])
    return encode_put_header(hdr)


def test_a_put_naming_a_foreign_shm_segment_is_refused(store: StoreProc) -> None:
    async def body() -> None:
        # Separate connections, as two processes would have (no shared subchannel).
        opts = [("grpc.use_local_subchannel_pool", 1)]
        a = aio_channel(store.address, "kvstore", opts)
        b = aio_channel(store.address, "kvstore", opts)
        secret = shared_memory.SharedMemory(create=True, size=1 << 16)
        try:
            secret.buf[:1 << 16] = bytes(random.Random(1).randbytes(1 << 16))
            put_a = a.stream_unary("/kvserve.v1.KVStore/Put", request_serializer=None,
                                   response_deserializer=kvstore_pb2.PutResponse.FromString)
            put_b = b.stream_unary("/kvserve.v1.KVStore/Put", request_serializer=None,
                                   response_deserializer=kvstore_pb2.PutResponse.FromString)
            ks = keys(4, seed=99)
            async with KVStoreClient(store.address, timeout_s=10) as c:
                await c.put(keys(1, seed=98), blocks(1), layout=LAYOUT, token_count=4, ctx=CTX)
                arena = (await slots_of(store.address, keys(1, seed=98)))[0].shm_name
            staged = await kvstore_pb2_grpc.KVStoreStub(a).Stage(
                kvstore_pb2.StageRequest(min_bytes=4096), timeout=10)
            assert staged.shm_name.startswith("kvs-stage-") and staged.size >= 4096
            foreign = {"some process's segment": secret.name,
                       "the store's own G2 arena": arena,
                       "a staging segment handed to another connection": staged.shm_name,
                       "a path": "../../etc/passwd",
                       "a guessed staging name": "kvs-stage-" + "0" * 32}
            for what, name in foreign.items():
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await put_b(iter([_put_header(ks, name)]), timeout=10)
                assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION, what
                assert "not a staging segment" in (err.value.details() or ""), what
            async with KVStoreClient(store.address, timeout_s=10, use_shm=False) as c:
                assert (await c.get(ks, ctx=CTX)).payloads == [None] * 4   # nothing stored
            # The connection the segment was handed to may use it.
            seg = attach_segment(staged.shm_name)
            data = blocks(4, seed=5)
            for i, d in enumerate(data):
                seg.buf[i * 1024:(i + 1) * 1024] = d
            seg.close()
            res = await put_a(iter([_put_header(ks, staged.shm_name)]), timeout=10)
            assert res.stored_blocks == 4
            async with KVStoreClient(store.address, timeout_s=10, use_shm=False) as c:
                got = await c.get(ks, ctx=CTX)
                assert [bytes(p or b"") for p in got.payloads] == [bytes(d) for d in data]
        finally:
            secret.close()
            secret.unlink()
            await a.close()
            await b.close()
    asyncio.run(body())


def test_the_client_puts_through_a_store_handed_segment(store: StoreProc) -> None:
    async def body() -> None:
        async with KVStoreClient(store.address, timeout_s=10) as c:
            ks, data = keys(8, seed=42), blocks(8, seed=42)
            assert (await c.put(ks, data, layout=LAYOUT, token_count=4, ctx=CTX)).stored == 8
            (seg,) = c._staging.segments()
            assert seg.name.startswith("kvs-stage-")                      # the store's
            got = await c.get(ks, ctx=CTX)
            assert [bytes(p or b"") for p in got.payloads] == [bytes(d) for d in data]
    asyncio.run(body())


def test_one_clients_puts_at_once_stage_in_segments_of_their_own(store: StoreProc) -> None:
    """Concurrent Puts of one client each stage in a lane's own segment (one
    segment made each wait for the Put before it), and every block lands intact."""
    async def body() -> None:
        async with KVStoreClient(store.address, timeout_s=10, put_lanes=3) as c:
            parts = [(keys(4, seed=60 + i), blocks(4, seed=60 + i)) for i in range(6)]
            res = await asyncio.gather(*(c.put(ks, data, layout=LAYOUT, token_count=4, ctx=CTX)
                                         for ks, data in parts))
            assert [r.stored for r in res] == [4] * 6
            segs = c._staging.segments()
            assert len(segs) == 3 and len({s.name for s in segs}) == 3
            assert all(s.name.startswith("kvs-stage-") for s in segs)
            for ks, data in parts:
                got = await c.get(ks, ctx=CTX)
                assert [bytes(p or b"") for p in got.payloads] == [bytes(d) for d in data]
        with pytest.raises(ValueError, match="put_lanes"):
            KVStoreClient(store.address, put_lanes=0)
    asyncio.run(body())


def test_staging_segments_are_fresh_owned_and_bounded() -> None:
    from kvstore.errors import ResourceExhausted, ShmUnavailable
    from kvstore.segments import StagingSegments

    st = StagingSegments(max_bytes=6 << 20, min_bytes=1 << 20, per_owner=2)
    try:
        a1, a2 = st.open("peer-a", 4096), st.open("peer-a", 4096)
        assert a1.name != a2.name          # two clients of one process never share one
        assert st.resolve("peer-a", a1.name) is a1
        with pytest.raises(ShmUnavailable):
            st.resolve("peer-b", a1.name)  # bound to the connection it was handed to
        a3 = st.open("peer-a", 4096)       # per-owner cap: the owner's least recently
        with pytest.raises(ShmUnavailable):  # used goes (a1 was just used)
            st.resolve("peer-a", a2.name)
        assert st.resolve("peer-a", a3.name) is a3
        with pytest.raises(ResourceExhausted, match="staging pool is full"):
            st.open("peer-b", 5 << 20)     # 1 + 1 + 5 MiB > 6: never by pushing out a's
        assert st.resolve("peer-a", a1.name) is a1 and st.resolve("peer-a", a3.name) is a3
        b = st.open("peer-b", 4 << 20)     # what fits beside them
        assert st.resolve("peer-b", b.name) is b and len(st) == 3
        with pytest.raises(ResourceExhausted, match="share"):
            st.open("peer-b", 7 << 20)     # larger than a caller's share: the client streams
    finally:
        st.close()
    assert len(st) == 0
