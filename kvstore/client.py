"""``KVStoreClient``: the async client of the KVStore service (proto/kvstore.proto).

Every call carries a deadline. Status codes come back as the warehouse's own
errors (one table, ``_ERRORS``): INVALID_ARGUMENT -> InvalidRequest,
UNAVAILABLE / DEADLINE_EXCEEDED -> StoreUnavailable, so callers can fall
back to recomputing without knowing gRPC.

Same-host fast path (``use_shm``): when the store says it can and runs on
this host, a Get asks for shared-memory descriptors of G2 blocks (all of a
chain in one message) and copies them straight out of the store's segment
(attached once, its pages mapped at attach) on copier threads; a Put writes its
blocks into a staging segment the store handed it (``Stage``) and sends only
the header. Every shared-memory copy is verified against the checksum taken at
put; one that does not match (scribbled, or the slot was reused meanwhile) is
never used but fetched again through the socket, where the store verifies
again, so the fast path can never serve bad bytes.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import queue
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from multiprocessing import shared_memory
from typing import Any, TypeVar

import grpc
import numpy as np

from kvstore.errors import (
    AccessDenied,
    InvalidRequest,
    KVStoreError,
    ResourceExhausted,
    ShmUnavailable,
    StoreUnavailable,
)
from kvstore.segments import PER_OWNER, SegmentCache, copy_verified
from kvstore.tiers.shm import ShmSlot, attach_segment, copy_verified_scatter
from kvstore.types import (
    ClassSnapshot,
    ClearResult,
    GetResult,
    LookupResult,
    PutResult,
    QuotaEntry,
    RequestCtx,
    StoreStats,
    TenantSnapshot,
    TierCleared,
    TierSnapshot,
)
from kvstore.wire import decode_get_chunk, encode_put_data, encode_put_header
from proto import common_pb2, kvstore_pb2, kvstore_pb2_grpc
from security.config import SecurityConfig

log = logging.getLogger(__name__)
T = TypeVar("T")

CHUNK_BYTES = 4 * 2**20
# One Put call carries at most this many payload bytes (a larger put is split), so
# that it fits the store's Put budget beside other callers' (kvstore.limits).
PUT_CALL_BYTES = 128 * 2**20
MAX_MESSAGE_BYTES = 128 * 2**20
COPY_THREADS = 2    # shared-memory Get copier threads (see _SlotCopier)
# Shared-memory Puts in flight per client (_StagingLanes). At most half the
# store's segments per connection: a lane that outgrows its segment asks for a
# new one while the store still lists the old, and the store makes room by
# dropping the connection's least recently used segment, which must be a stale
# one, never a lane's in use.
PUT_LANES = 4
MAX_PUT_LANES = PER_OWNER // 2

_ERRORS: dict[grpc.StatusCode, type[KVStoreError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidRequest,
    grpc.StatusCode.UNAVAILABLE: StoreUnavailable,
    grpc.StatusCode.DEADLINE_EXCEEDED: StoreUnavailable,
    grpc.StatusCode.CANCELLED: StoreUnavailable,
    grpc.StatusCode.RESOURCE_EXHAUSTED: ResourceExhausted,
    grpc.StatusCode.FAILED_PRECONDITION: ShmUnavailable,
    grpc.StatusCode.UNAUTHENTICATED: AccessDenied,
    grpc.StatusCode.PERMISSION_DENIED: AccessDenied,
}


def _mapped(fn: Callable[..., Awaitable[T]]) -> Callable[..., Awaitable[T]]:
    @functools.wraps(fn)
    async def call(*args: Any, **kwargs: Any) -> T:
        try:
            return await fn(*args, **kwargs)
        except grpc.aio.AioRpcError as exc:
            err = _ERRORS.get(exc.code(), KVStoreError)
            if err is ResourceExhausted:
                raise ResourceExhausted(f"{exc.code().name}: {exc.details()}",
                                        _retry_after_s(exc)) from exc
            raise err(f"{exc.code().name}: {exc.details()}") from exc
    return call


def _retry_after_s(exc: grpc.aio.AioRpcError) -> float:
    """The store's ``retry-after-ms`` trailer, in seconds (0: none)."""
    for key, value in exc.trailing_metadata() or ():
        if key == "retry-after-ms":
            with contextlib.suppress(ValueError):
                return max(0.0, int(value) / 1000.0)
    return 0.0


def _quota_entries(res: kvstore_pb2.QuotaResponse) -> list[QuotaEntry]:
    return [QuotaEntry(q.tier, q.tenant, None if q.quota_bytes < 0 else q.quota_bytes, q.source)
            for q in res.quotas]


def ctx_to_proto(ctx: RequestCtx) -> common_pb2.RequestContext:
    return common_pb2.RequestContext(request_id=ctx.request_id, tenant=ctx.tenant,
                                     traffic_class=ctx.traffic_class,
                                     model_fingerprint=ctx.model_fingerprint)


def as_byte_views(blocks: Any, n: int) -> list[memoryview]:
    """``n`` equal byte views of a block tensor [n, ...] (torch or numpy), or the
    given bytes-likes. No copies for contiguous CPU tensors."""
    if isinstance(blocks, list | tuple):
        # An element that is itself a list is one block's destination in pieces
        # (filled in order: e.g. a vLLM block's slot in each layer's paged cache).
        return [[memoryview(p).cast("B") for p in b] if isinstance(b, list | tuple)  # type: ignore[misc]
                else memoryview(b).cast("B") for b in blocks]
    if hasattr(blocks, "detach"):  # torch.Tensor; bfloat16 has no numpy dtype: go via uint8
        import torch

        t = blocks.detach()
        if t.device.type != "cpu":
            t = t.cpu()
        arr = t.contiguous().view(torch.uint8).numpy()
    else:
        arr = np.ascontiguousarray(blocks)
    flat = memoryview(arr.reshape(-1).view(np.uint8))
    if n == 0:
        return []
    if flat.nbytes % n:
        raise InvalidRequest(f"{flat.nbytes} bytes of blocks do not split into {n} equal blocks")
    size = flat.nbytes // n
    return [flat[i * size:(i + 1) * size] for i in range(n)]


def _nbytes(payload: Any) -> int:
    return sum(v.nbytes for v in payload) if isinstance(payload, list) else payload.nbytes


def _scatter(pieces: list[memoryview], dst: Any) -> None:
    """Received pieces of one block, in order, into ``dst``: one view, or a list of
    views filled one after another."""
    outs = dst if isinstance(dst, list) else [dst]
    k, at = 0, 0                                  # destination view, offset in it
    for p in pieces:
        src = memoryview(p).cast("B")
        while src.nbytes:
            room = outs[k].nbytes - at
            n = min(room, src.nbytes)
            outs[k][at:at + n] = src[:n]
            src, at = src[n:], at + n
            if at == outs[k].nbytes and k + 1 < len(outs):
                k, at = k + 1, 0


class _Staging:
    """The staging segment the store handed this client for shared-memory Puts
    (``Stage``: the store creates it and binds it to this connection; it never
    reads a segment a client merely names). Re-asked for when a Put needs more
    room or the store forgot it (restart, reconnect, idle expiry)."""

    def __init__(self) -> None:
        self.seg: shared_memory.SharedMemory | None = None

    async def ensure(self, stub: kvstore_pb2_grpc.KVStoreStub, nbytes: int, ctx: RequestCtx,
                     timeout_s: float) -> shared_memory.SharedMemory:
        if self.seg is None or self.seg.size < nbytes:
            res = await stub.Stage(kvstore_pb2.StageRequest(ctx=ctx_to_proto(ctx),
                                                            min_bytes=nbytes), timeout=timeout_s)
            self.close()
            seg = attach_segment(res.shm_name)
            if seg.size < nbytes:
                seg.close()
                raise ShmUnavailable(f"staging segment {res.shm_name!r} holds {seg.size} "
                                     f"bytes, {nbytes} needed")
            self.seg = seg
        return self.seg

    def close(self) -> None:
        if self.seg is not None:
            with contextlib.suppress(BufferError):
                self.seg.close()
            self.seg = None


class _StagingLanes:
    """Staging segments for up to ``n`` shared-memory Puts at once, one each
    from staging to the store's answer. With one segment, every Put of a
    process waited for the one before it: on the H200 stack, 64 decode answers
    ending together put their blocks in line, 1.55 s each
    (docs/benchmarks-history.md, run 14). ``n`` stays within the store's
    segments per connection (``StagingSegments.per_owner``), so asking for a
    lane's segment never drops another lane's."""

    def __init__(self, n: int) -> None:
        self._all = [_Staging() for _ in range(n)]
        self._idle: asyncio.Queue[_Staging] = asyncio.Queue()
        for lane in self._all:
            self._idle.put_nowait(lane)

    @contextlib.asynccontextmanager
    async def take(self) -> AsyncIterator[_Staging]:
        lane = await self._idle.get()
        try:
            yield lane
        finally:
            self._idle.put_nowait(lane)

    def segments(self) -> list[shared_memory.SharedMemory]:
        """The lanes' current segments (those that staged a Put yet)."""
        return [lane.seg for lane in self._all if lane.seg is not None]

    def close(self) -> None:
        for lane in self._all:
            lane.close()


class _SlotCopier:
    """Copies shared-memory slots out of the store's arena on ``threads`` worker
    threads, started at the first descriptor: one thread hop per Get, not per
    block, and numpy copies that release the GIL, so the workers copy in
    parallel (one core's copy does not saturate memory: 2 threads measured
    ~1.3x a single memcpy here) while the event loop keeps receiving. Every
    copy is hashed as it is made and compared with the checksum taken at put
    (``copy_verified``); one that does not match is never used, only reported
    for a socket refetch (where the store verifies again and drops a bad block)."""

    def __init__(self, segments: SegmentCache, dst: list[memoryview] | None,
                 payloads: list[memoryview | None], threads: int) -> None:
        self._segments, self._dst, self._payloads = segments, dst, payloads
        self._queue: queue.SimpleQueue[tuple[int, ShmSlot] | None] = queue.SimpleQueue()
        self.failed = 0     # copies that did not match their checksum (int += under the GIL)
        loop = asyncio.get_running_loop()
        self._workers = [loop.run_in_executor(None, self._run) for _ in range(threads)]

    def submit(self, i: int, slot: ShmSlot) -> None:
        self._queue.put((i, slot))

    async def done(self) -> list[int]:
        """Indices whose copy cannot be trusted, once every submitted copy is over."""
        for _ in self._workers:
            self._queue.put(None)
        return sorted(i for redo in await asyncio.gather(*self._workers) for i in redo)

    def _run(self) -> list[int]:
        redo = []
        while (item := self._queue.get()) is not None:
            i, slot = item
            if not self._copy(i, slot):
                redo.append(i)
        return redo

    def _copy(self, i: int, slot: ShmSlot) -> bool:
        try:
            seg = self._segments.get(slot.shm_name)
        except (FileNotFoundError, ValueError, OSError):
            return False
        target = self._dst[i] if self._dst is not None else memoryview(bytearray(slot.size))
        ok = (copy_verified_scatter(seg, slot, target) if isinstance(target, list)
              else copy_verified(seg, slot, target))
        if not ok:
            self.failed += 1                     # scribbled or reused: never used
            return False
        self._payloads[i] = target
        return True


DEFAULT_CLIENT_ROLE = "engine"


class KVStoreClient:
    def __init__(self, address: str, *, timeout_s: float = 5.0, use_shm: bool = True,
                 chunk_bytes: int = CHUNK_BYTES, copy_threads: int = COPY_THREADS,
                 security: SecurityConfig | None = None,
                 put_call_bytes: int = PUT_CALL_BYTES, put_lanes: int = PUT_LANES) -> None:
        """``security``: this caller's credentials (mTLS); None reads them from the
        environment as the least-privileged kvstore client, ``engine`` (the data
        methods and Stats; security/methods.py). Never an operator by default:
        maintenance (Delete) must be asked for with an operator's credentials."""
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        if copy_threads < 1:
            raise ValueError(f"copy_threads must be >= 1, got {copy_threads}")
        if not 1 <= put_lanes <= MAX_PUT_LANES:
            raise ValueError(f"put_lanes must be in [1, {MAX_PUT_LANES}] (the store's staging "
                             f"segments per connection), got {put_lanes}")
        self.copy_threads = copy_threads
        self.address = address
        self.timeout_s = timeout_s
        self.use_shm = use_shm
        self.chunk_bytes = chunk_bytes
        self.put_call_bytes = put_call_bytes
        self.security = security or SecurityConfig.from_env(DEFAULT_CLIENT_ROLE)
        self._channel = self.security.aio_channel(address, "kvstore", options=[
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES)])
        self._stub = kvstore_pb2_grpc.KVStoreStub(self._channel)
        # Bulk calls use the zero-copy codec (kvstore.wire); the messages are the same.
        self._put_call = self._channel.stream_unary(
            "/kvserve.v1.KVStore/Put", request_serializer=None,
            response_deserializer=kvstore_pb2.PutResponse.FromString)
        self._get_call = self._channel.unary_stream(
            "/kvserve.v1.KVStore/Get",
            request_serializer=kvstore_pb2.GetRequest.SerializeToString,
            response_deserializer=decode_get_chunk)
        self._shm_ok: bool | None = None if use_shm else False
        self._segments = SegmentCache(populate=True)  # the store prefaults its arena
        self._staging = _StagingLanes(put_lanes)
        self._shm_put_ok = use_shm
        # Shared-memory copies that failed verification (each was refetched over the
        # socket, where the store verifies again and drops a bad block).
        self.shm_verify_failures = 0

    async def close(self) -> None:
        self._segments.close()
        self._staging.close()
        await self._channel.close()

    async def __aenter__(self) -> KVStoreClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # -- calls ---------------------------------------------------------------------------------
    @_mapped
    async def lookup(self, keys: Sequence[bytes], *, prompt_tokens: int, ctx: RequestCtx,
                     touch: bool = True, timeout_s: float | None = None) -> LookupResult:
        res = await self._stub.Lookup(
            kvstore_pb2.LookupRequest(ctx=ctx_to_proto(ctx), keys=keys,
                                      prompt_tokens=prompt_tokens, touch=touch),
            timeout=timeout_s or self.timeout_s)
        return LookupResult(res.matched_blocks, res.usable_tokens, list(res.block_tiers),
                            res.lookup_s)

    @_mapped
    async def put(self, keys: Sequence[bytes], blocks: Any, *, layout: str,
                  token_count: int | Sequence[int], ctx: RequestCtx,
                  timeout_s: float | None = None) -> PutResult:
        """Store blocks (a tensor [n, layers, 2, kv_heads, block_tokens, head_dim] or
        n bytes-likes); ``token_count`` per block, or one value for all. Split into
        calls of at most ``put_call_bytes`` (whole blocks each)."""
        views = as_byte_views(blocks, len(keys))
        if len(views) != len(keys):
            raise InvalidRequest(f"{len(keys)} keys but {len(views)} blocks")
        counts = [token_count] * len(keys) if isinstance(token_count, int) else list(token_count)
        stored = skipped = nbytes = 0
        start = 0
        while start < len(keys) or not keys:
            end, size = start, 0
            while end < len(keys) and (end == start or size + views[end].nbytes
                                       <= self.put_call_bytes):
                size += views[end].nbytes
                end += 1
            res = await self._put_one(keys[start:end], views[start:end], counts[start:end],
                                      layout, ctx, timeout_s)
            stored, skipped, nbytes = (stored + res.stored, skipped + res.skipped,
                                       nbytes + res.bytes)
            if not keys:
                break
            start = end
        return PutResult(stored, skipped, nbytes)

    async def _put_one(self, keys: Sequence[bytes], views: list[memoryview], counts: list[int],
                       layout: str, ctx: RequestCtx, timeout_s: float | None) -> PutResult:
        headers = [kvstore_pb2.BlockHeader(key=k, size=v.nbytes, token_count=c)
                   for k, v, c in zip(keys, views, counts, strict=True)]
        hdr = kvstore_pb2.PutHeader(ctx=ctx_to_proto(ctx), layout=layout, blocks=headers)
        timeout = timeout_s or self.timeout_s
        if self._shm_put_ok and await self._same_host():
            nbytes = sum(v.nbytes for v in views)
            for attempt in (0, 1):   # once more with a fresh segment if the store forgot ours
                try:
                    async with self._staging.take() as staging:
                        if attempt:
                            staging.close()
                        seg = await staging.ensure(self._stub, nbytes, ctx, timeout)
                        await asyncio.to_thread(self._stage, seg, views)
                        hdr.shm_name, hdr.shm_offset = seg.name, 0
                        res = await self._put_call(iter([encode_put_header(hdr)]),
                                                   timeout=timeout)
                    return PutResult(res.stored_blocks, res.skipped_blocks, res.bytes)
                except (grpc.aio.AioRpcError, ShmUnavailable, OSError) as exc:
                    code = exc.code() if isinstance(exc, grpc.aio.AioRpcError) else None
                    if code is grpc.StatusCode.RESOURCE_EXHAUSTED and hdr.shm_name == "":
                        # No staging room for us now (our share, or a full pool): stream
                        # this put; later puts try shared memory again.
                        hdr.shm_name, hdr.shm_offset = "", 0
                        res = await self._put_call(self._chunks(hdr, views), timeout=timeout)
                        return PutResult(res.stored_blocks, res.skipped_blocks, res.bytes)
                    if code not in (None, grpc.StatusCode.FAILED_PRECONDITION,
                                    grpc.StatusCode.UNIMPLEMENTED):
                        raise
                    detail = exc.details() if isinstance(exc, grpc.aio.AioRpcError) else exc
                    log.info("shared-memory put failed (%s)%s", detail,
                             "; streaming instead" if attempt else "; asking for a new segment")
                    hdr.shm_name, hdr.shm_offset = "", 0
                    if code is grpc.StatusCode.UNIMPLEMENTED:
                        break
            self._shm_put_ok = False
        res = await self._put_call(self._chunks(hdr, views), timeout=timeout)
        return PutResult(res.stored_blocks, res.skipped_blocks, res.bytes)

    @staticmethod
    def _stage(seg: shared_memory.SharedMemory, views: list[memoryview]) -> None:
        dst = np.frombuffer(seg.buf, dtype=np.uint8)
        pos = 0
        for v in views:
            dst[pos:pos + v.nbytes] = np.frombuffer(v, dtype=np.uint8)
            pos += v.nbytes
        del dst  # release the export so the segment can close

    def _chunks(self, hdr: kvstore_pb2.PutHeader, views: list[memoryview]) -> Iterator[bytes]:
        """Header, then each block as one message (or pieces of ``chunk_bytes``),
        so the store can use every whole block in place."""
        yield encode_put_header(hdr)
        step = self.chunk_bytes
        for v in views:
            for off in range(0, v.nbytes, step):
                yield encode_put_data(v[off:off + step])

    @_mapped
    async def get(self, keys: Sequence[bytes], *, ctx: RequestCtx,
                  out: Any = None, timeout_s: float | None = None) -> GetResult:
        """Blocks in key order; None = missing or corrupt (recompute it). With
        ``out`` (a writable buffer or CPU tensor of len(keys) equal blocks), the
        payloads are views into it."""
        t0 = time.perf_counter()
        dst = as_byte_views(out, len(keys)) if out is not None else None
        shm = await self._same_host()
        payloads, tiers, redo = await self._get(keys, ctx, dst, shm, timeout_s)
        if redo:  # shared-memory copies that could not be trusted: through the socket
            again, _, _ = await self._get([keys[i] for i in redo], ctx,
                                          [dst[i] for i in redo] if dst else None, False,
                                          timeout_s)
            for i, p in zip(redo, again, strict=True):
                payloads[i] = p
        nbytes = sum(_nbytes(p) for p in payloads if p is not None)
        return GetResult(payloads, nbytes, time.perf_counter() - t0, tiers)

    async def _get(self, keys: Sequence[bytes], ctx: RequestCtx,
                   dst: list[memoryview] | None, shm: bool, timeout_s: float | None,
                   ) -> tuple[list[memoryview | None], list[str], list[int]]:
        req = kvstore_pb2.GetRequest(ctx=ctx_to_proto(ctx), keys=keys, use_shm=shm,
                                     max_chunk_bytes=self.chunk_bytes)
        payloads: list[memoryview | None] = [None] * len(keys)
        tiers = [""] * len(keys)
        copier: _SlotCopier | None = None
        pieces: list[memoryview] = []
        i, want = -1, 0

        def finish() -> None:
            if i < 0 or not pieces:
                return
            got = sum(p.nbytes for p in pieces)
            if got != want:
                return  # a short block is no block: leave it missing
            if dst is not None:
                _scatter(pieces, dst[i])
                payloads[i] = dst[i]
            elif len(pieces) == 1:
                payloads[i] = pieces[0]          # a view of the received message: no copy
            else:
                payloads[i] = memoryview(b"".join(pieces))

        try:
            async for msg in self._get_call(req, timeout=timeout_s or self.timeout_s):
                for part in msg.parts():
                    if part.header is not None:
                        finish()
                        pieces = []
                        i += 1
                        if i >= len(keys) or part.header.key != keys[i]:
                            raise StoreUnavailable("Get stream out of order (store bug)")
                        want = part.header.size
                        if part.missing:
                            continue
                        if part.shm_name:
                            tiers[i] = "shm"
                            if copier is None:  # copies overlap the rest of the stream
                                copier = _SlotCopier(self._segments, dst, payloads,
                                                     self.copy_threads)
                            copier.submit(i, ShmSlot(part.shm_name, part.shm_offset, want,
                                                     part.header.checksum, part.shm_valid_until,
                                                     part.shm_reuse_gen))
                            continue
                        tiers[i] = "grpc"
                    if part.data.nbytes:
                        pieces.append(part.data)
            finish()
        finally:
            redo = await copier.done() if copier is not None else []
            if copier is not None:
                self.shm_verify_failures += copier.failed
        return payloads, tiers, redo

    @_mapped
    async def delete(self, keys: Sequence[bytes], *, ctx: RequestCtx,
                     timeout_s: float | None = None) -> int:
        res = await self._stub.Delete(kvstore_pb2.DeleteRequest(ctx=ctx_to_proto(ctx), keys=keys),
                                      timeout=timeout_s or self.timeout_s)
        return int(res.deleted)

    @_mapped
    async def warm(self, keys: Sequence[bytes], *, prompt_tokens: int, ctx: RequestCtx,
                   timeout_s: float | None = None) -> kvstore_pb2.WarmResponse:
        """Move the chain's usable blocks up into G2 now (kvstore.warm)."""
        return await self._stub.Warm(
            kvstore_pb2.WarmRequest(ctx=ctx_to_proto(ctx), keys=keys, prompt_tokens=prompt_tokens),
            timeout=timeout_s or self.timeout_s)

    @_mapped
    async def stats(self, *, timeout_s: float | None = None) -> StoreStats:
        s = await self._stub.Stats(kvstore_pb2.StatsRequest(), timeout=timeout_s or self.timeout_s)
        return StoreStats(
            s.node,
            [TierSnapshot(t.tier, t.capacity_bytes, t.used_bytes, t.blocks, t.hits, t.misses,
                          t.evictions, t.checksum_failures) for t in s.tiers],
            [ClassSnapshot(c.traffic_class, c.ttl_s, c.hits, c.misses, c.blocks)
             for c in s.classes],
            s.whatif_json, s.shm_capable, s.hostname,
            [TenantSnapshot(t.tier, t.tenant, t.used_bytes, t.blocks, t.quota_bytes, t.evictions)
             for t in s.tenants], s.tenant_names, s.max_tenants)

    @_mapped
    async def set_quota(self, tier: str, tenant: str, quota_bytes: int | None, *,
                        reset: bool = False, timeout_s: float | None = None,
                        ) -> list[QuotaEntry]:
        """An operator's per-tenant quota (None: no limit; ``reset``: the config's
        applies again); returns the effective table."""
        res = await self._stub.SetQuota(kvstore_pb2.SetQuotaRequest(
            tier=tier, tenant=tenant, reset=reset,
            quota_bytes=-1 if quota_bytes is None else quota_bytes),
            timeout=timeout_s or self.timeout_s)
        return _quota_entries(res)

    @_mapped
    async def get_quotas(self, *, timeout_s: float | None = None) -> list[QuotaEntry]:
        res = await self._stub.GetQuotas(kvstore_pb2.GetQuotasRequest(),
                                         timeout=timeout_s or self.timeout_s)
        return _quota_entries(res)

    @_mapped
    async def clear(self, *, tenant: str = "", timeout_s: float | None = None) -> ClearResult:
        """Drop every block the store holds (only ``tenant``'s when given): operators
        and the router only (kvstore.clear)."""
        res = await self._stub.Clear(kvstore_pb2.ClearRequest(tenant=tenant),
                                     timeout=timeout_s or self.timeout_s)
        return ClearResult(res.node, [TierCleared(t.tier, t.blocks, t.bytes) for t in res.tiers],
                           res.pending_blocks, res.clear_s)

    async def _same_host(self) -> bool:
        """Whether to use shared memory: asked once (Stats), then remembered."""
        if self._shm_ok is None:
            try:
                s = await self.stats()
                self._shm_ok = bool(s.shm_capable and s.hostname == socket.gethostname())
            except KVStoreError:
                return False
        return self._shm_ok
