"""The gRPC ``KVStore`` service (proto/kvstore.proto) over a Warehouse.

- Errors become status codes in one place: ``_STATUS`` below, applied by the
  ``rpc`` decorator to every method. Requests that do not even parse (garbage
  bytes) reach the handlers as ``_Unparsable`` and fail the same way, with
  INVALID_ARGUMENT instead of gRPC's generic INTERNAL.
- A Put is validated completely (header, chunk order, sizes, checksums)
  before anything is stored, so a bad request stores nothing and the store
  keeps serving.
- Same-host fast path: a Get with ``use_shm`` answers G2 hits with shared
  memory descriptors (the client verifies every copy); a Put may name a
  staging segment instead of streaming, but only one this store created and
  handed to the same connection (``Stage``, kvstore.segments.StagingSegments),
  within the calling identity's share of the staging pool.
- Limits (kvstore.limits): at most ``max_concurrent_rpcs`` calls at once; a Put
  reserves its announced bytes from the Put budget when its header arrives,
  before any payload is received, or is refused with RESOURCE_EXHAUSTED and
  ``retry-after-ms`` trailing metadata.
- Operators set per-tenant quotas (``SetQuota``/``GetQuotas``, kept in Redis);
  ``Stats`` reports per-tenant usage, only the caller's own to a tenant identity.
- Standard health and reflection services; SIGTERM drains (``serve``).
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection

from common.config import ConfigError
from kvstore.blockfile import BlockCorruptError, BlockFormatError
from kvstore.errors import (
    InvalidRequest,
    PayloadTooLarge,
    ResourceExhausted,
    ShmUnavailable,
    StoreDraining,
    StoreUnavailable,
)
from kvstore.keys import KeyInputError
from kvstore.limits import PutBudget, ServiceLimits
from kvstore.quotas import QuotaTable
from kvstore.segments import SegmentCache, StagingSegments, digest_matches
from kvstore.tiers import ShmSlot, TierError
from kvstore.types import BlockLayout, RequestCtx
from kvstore.warehouse import Warehouse
from kvstore.wire import PutPart, decode_put_chunk, encode_get_chunks, get_chunk_prefix
from proto import common_pb2, kvstore_pb2
from security.authz import (
    AuthInterceptor,
    PermissionDenied,
    Unauthenticated,
    acting_tenant,
    current_identity,
)
from security.config import SecurityConfig
from security.grpc_input import InputGuard
from security.health_port import start_health_port
from security.redact import redact
from telemetry.grpc_hooks import server_interceptors

log = logging.getLogger(__name__)

SERVICE_NAME = "kvserve.v1.KVStore"
KEY_BYTES = 16
SHM_GET_BATCH = 64


# -- errors -> status codes, the one table ---------------------------------------------------
_STATUS: tuple[tuple[type[BaseException], grpc.StatusCode], ...] = (
    (Unauthenticated, grpc.StatusCode.UNAUTHENTICATED),
    (PermissionDenied, grpc.StatusCode.PERMISSION_DENIED),  # e.g. another tenant's key
    (ResourceExhausted, grpc.StatusCode.RESOURCE_EXHAUSTED),  # budget, share, tenant table
    (StoreDraining, grpc.StatusCode.UNAVAILABLE),
    (StoreUnavailable, grpc.StatusCode.UNAVAILABLE),
    (ShmUnavailable, grpc.StatusCode.FAILED_PRECONDITION),
    (InvalidRequest, grpc.StatusCode.INVALID_ARGUMENT),     # includes PayloadTooLarge
    (KeyInputError, grpc.StatusCode.INVALID_ARGUMENT),
    (BlockFormatError, grpc.StatusCode.INVALID_ARGUMENT),
    (BlockCorruptError, grpc.StatusCode.INVALID_ARGUMENT),  # a put whose checksum is wrong
    (TierError, grpc.StatusCode.INVALID_ARGUMENT),
    (ConfigError, grpc.StatusCode.INVALID_ARGUMENT),        # e.g. an unknown traffic class
    (TimeoutError, grpc.StatusCode.DEADLINE_EXCEEDED),
    (NotImplementedError, grpc.StatusCode.UNIMPLEMENTED),
)


def status_for(exc: BaseException) -> grpc.StatusCode:
    for exc_type, code in _STATUS:
        if isinstance(exc, exc_type):
            return code
    return grpc.StatusCode.INTERNAL


class _Unparsable:
    """What a request that failed to deserialize turns into."""

    __slots__ = ("error",)

    def __init__(self, error: Exception) -> None:
        self.error = error


def _safe(parse: Callable[[bytes], Any]) -> Callable[[bytes], Any]:
    def deserialize(raw: bytes) -> Any:
        try:
            return parse(raw)
        except Exception as exc:  # protobuf DecodeError and friends
            return _Unparsable(exc)
    return deserialize


def _parsed(msg: Any, what: str) -> Any:
    if isinstance(msg, _Unparsable):
        raise InvalidRequest(f"{what} is not a valid protobuf message ({msg.error})")
    return msg


def rpc(method: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Maps exceptions to status codes for unary and streaming handlers alike."""

    def deco(fn: Callable[..., Any]) -> Callable[..., Any]:
        async def fail(self: KVStoreService, exc: Exception,
                       context: grpc.aio.ServicerContext) -> None:
            code = status_for(exc)
            self.wh.metrics.errors.labels(method, code.name).inc()
            if code is grpc.StatusCode.INTERNAL:
                log.exception("%s failed", method)
            wait = getattr(exc, "retry_after_s", 0.0)
            trailers = (("retry-after-ms", str(max(1, round(wait * 1000)))),) if wait else ()
            # Status text reaches any caller (tenants included): never a secret in it.
            await context.abort(code, redact(f"{method}: {exc}"), trailing_metadata=trailers)

        if inspect.isasyncgenfunction(fn):
            @functools.wraps(fn)
            async def stream(self: KVStoreService, request: Any,
                             context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
                try:
                    async for item in fn(self, request, context):
                        yield item
                except (asyncio.CancelledError, grpc.aio.AbortError):
                    raise
                except Exception as exc:
                    await fail(self, exc, context)
            return stream

        @functools.wraps(fn)
        async def unary(self: KVStoreService, request: Any,
                        context: grpc.aio.ServicerContext) -> Any:
            try:
                return await fn(self, request, context)
            except (asyncio.CancelledError, grpc.aio.AbortError):
                raise
            except Exception as exc:
                await fail(self, exc, context)
        return unary

    return deco


# -- request validation -----------------------------------------------------------------------
def ctx_from_proto(ctx: common_pb2.RequestContext) -> RequestCtx:
    """The request's context with the tenant the caller is authorised to act for
    (security.authz.acting_tenant: a tenant-scoped caller naming another tenant
    is refused; a service acts for the tenant it names)."""
    return RequestCtx(ctx.request_id, acting_tenant(ctx.tenant), ctx.traffic_class,
                      ctx.model_fingerprint)


def _caller(context: grpc.aio.ServicerContext) -> str:
    """Whose share a staging segment counts against: the certificate identity
    (however many connections it opens), or the connection in plain text."""
    ident = current_identity()
    return context.peer() if ident.insecure else ident.describe()


def _quota_response(table: QuotaTable) -> kvstore_pb2.QuotaResponse:
    return kvstore_pb2.QuotaResponse(quotas=[
        kvstore_pb2.QuotaEntry(tier=e.tier, tenant=e.tenant, source=e.source,
                               quota_bytes=-1 if e.quota_bytes is None else e.quota_bytes)
        for e in table.entries])


def _keys(raw: Any, limits: ServiceLimits) -> list[bytes]:
    keys = list(raw)
    if len(keys) > limits.max_keys:
        raise PayloadTooLarge(f"{len(keys)} keys exceed the limit of {limits.max_keys}")
    for i, k in enumerate(keys):
        if len(k) != KEY_BYTES:
            raise InvalidRequest(f"key {i} has {len(k)} bytes; block keys are {KEY_BYTES} bytes")
    return keys


@dataclass(frozen=True, slots=True)
class _PutPlan:
    ctx: RequestCtx
    layout: str
    keys: list[bytes]
    sizes: list[int]
    token_counts: list[int]
    checksums: list[bytes]
    shm_name: str
    shm_offset: int

    @property
    def total(self) -> int:
        return sum(self.sizes)


def _plan_put(hdr: kvstore_pb2.PutHeader, limits: ServiceLimits) -> _PutPlan:
    ctx = ctx_from_proto(hdr.ctx)
    layout = BlockLayout.parse(hdr.layout)
    want = layout.block_nbytes
    blocks = list(hdr.blocks)
    keys = _keys([b.key for b in blocks], limits)
    if len(set(keys)) != len(keys):
        raise InvalidRequest("the PutHeader names the same key twice")
    if want > limits.max_block_bytes:
        raise PayloadTooLarge(f"layout {hdr.layout} makes {want}-byte blocks, over the "
                              f"{limits.max_block_bytes}-byte limit")
    for i, b in enumerate(blocks):
        if b.size != want:
            raise InvalidRequest(f"block {i} announces {b.size} bytes but layout {hdr.layout} "
                                 f"makes {want}-byte blocks (wrong payload size)")
        if not 0 < b.token_count <= layout.block_tokens:
            raise InvalidRequest(f"block {i}: token_count {b.token_count} not in "
                                 f"1..{layout.block_tokens}")
        if b.checksum and len(b.checksum) != 16:
            raise InvalidRequest(f"block {i}: checksum must be 16 bytes (xxh3-128) or empty")
    plan = _PutPlan(ctx, hdr.layout, keys, [want] * len(blocks),
                    [b.token_count for b in blocks], [b.checksum for b in blocks],
                    hdr.shm_name, hdr.shm_offset)
    if plan.total > limits.max_put_bytes:
        raise PayloadTooLarge(f"put of {plan.total} bytes exceeds the {limits.max_put_bytes}-byte "
                              "limit; split it")
    return plan


def _piece_sizes(size: int, chunk: int) -> list[int]:
    return [min(chunk, size - off) for off in range(0, size, chunk)] or [0]


def _pieces(hdr: kvstore_pb2.BlockHeader, payload: memoryview, chunk: int) -> list[bytes]:
    """GetChunk messages of one block: the header rides with the first piece."""
    out = []
    for i, n in enumerate(_piece_sizes(payload.nbytes, chunk)):
        off = i * chunk
        out.append(b"".join((get_chunk_prefix(hdr if i == 0 else None, n),
                             payload[off:off + n])))
    return out


class KVStoreService:
    """The servicer; handlers are registered with tolerant deserializers in
    ``add_to_server`` rather than through the generated helper."""

    def __init__(self, wh: Warehouse, limits: ServiceLimits | None = None) -> None:
        self.wh = wh
        self.limits = limits or ServiceLimits()
        self._segments = SegmentCache()          # the store's own G2 arena, mapped once
        pool = min(self.limits.max_staging_bytes, self.limits.max_put_bytes)
        self.staging = StagingSegments(max_bytes=pool,
                                       share_bytes=int(pool * self.limits.staging_share))
        self.put_budget = PutBudget(self.limits.put_budget_bytes)

    @rpc("Lookup")
    async def Lookup(self, request: Any, context: grpc.aio.ServicerContext,
                     ) -> kvstore_pb2.LookupResponse:
        req: kvstore_pb2.LookupRequest = _parsed(request, "LookupRequest")
        res = await self.wh.lookup(_keys(req.keys, self.limits), prompt_tokens=req.prompt_tokens,
                                   ctx=ctx_from_proto(req.ctx), touch=req.touch)
        return kvstore_pb2.LookupResponse(
            matched_blocks=res.matched_blocks, usable_tokens=res.usable_tokens,
            tiers=[kvstore_pb2.TierMatch(tier=t, blocks=n) for t, n in res.tier_counts.items()],
            block_tiers=res.block_tiers, lookup_s=res.lookup_s)

    @rpc("Put")
    async def Put(self, request_iterator: AsyncIterator[Any],
                  context: grpc.aio.ServicerContext) -> kvstore_pb2.PutResponse:
        it = request_iterator.__aiter__()
        first: PutPart = _parsed(await anext(it, None) or _Unparsable(ValueError("empty stream")),
                                 "PutChunk")
        if first.header is None:
            raise InvalidRequest("a Put must start with its PutHeader (wrong chunk order)")
        plan = _plan_put(first.header, self.limits)
        with self.put_budget.hold(plan.total):   # before one payload byte is received
            if plan.shm_name:
                payloads = self._staged(plan, context.peer())
                async for chunk in it:
                    _parsed(chunk, "PutChunk")
                    raise InvalidRequest("a shared-memory Put carries no data chunks")
            else:
                payloads = await self._receive(plan, it)
            res = await self.wh.put(plan.keys, payloads, layout=plan.layout,
                                    token_counts=plan.token_counts, ctx=plan.ctx,
                                    checksums=plan.checksums, borrowed=bool(plan.shm_name))
        return kvstore_pb2.PutResponse(stored_blocks=res.stored, skipped_blocks=res.skipped,
                                       bytes=res.bytes)

    async def _receive(self, plan: _PutPlan, it: AsyncIterator[Any]) -> list[memoryview]:
        """Blocks from data chunks. A chunk holding whole blocks is used in place
        (views of the received message, no copy); blocks split across chunks are
        assembled."""
        sizes, out = plan.sizes, []
        partial: bytearray | None = None
        filled = 0
        async for raw in it:
            part: PutPart = _parsed(raw, "PutChunk")
            if part.data is None:
                raise InvalidRequest("a second PutHeader arrived after the first (wrong chunk "
                                     "order: one header, then data)")
            data = part.data
            if data.nbytes > self.limits.max_message_bytes:
                raise PayloadTooLarge(f"data chunk of {data.nbytes} bytes exceeds the "
                                      f"{self.limits.max_message_bytes}-byte message limit")
            off = 0
            while off < data.nbytes:
                if len(out) == len(sizes):
                    raise InvalidRequest(f"more data than the header announces "
                                         f"({plan.total} bytes)")
                size = sizes[len(out)]
                if partial is None and data.nbytes - off >= size:
                    out.append(data[off:off + size])
                    off += size
                    continue
                if partial is None:
                    partial, filled = bytearray(size), 0
                n = min(size - filled, data.nbytes - off)
                partial[filled:filled + n] = data[off:off + n]
                filled += n
                off += n
                if filled == size:
                    out.append(memoryview(partial))
                    partial = None
        if len(out) != len(sizes):
            got = sum(sizes[:len(out)]) + (filled if partial is not None else 0)
            raise InvalidRequest(f"the stream ended after {got} of the {plan.total} bytes "
                                 "announced")
        return out

    def _staged(self, plan: _PutPlan, owner: str) -> list[memoryview]:
        """Views of the staging segment this store handed to the caller's connection
        (the warehouse copies what it keeps: ``borrowed=True``). A name the store did
        not hand out, or handed to another connection, is refused: a Put must never
        make the store read some other process's memory."""
        seg = self.staging.resolve(owner, plan.shm_name)
        end = plan.shm_offset + plan.total
        if end > seg.size:
            raise InvalidRequest(f"staging segment {plan.shm_name!r} holds {seg.size} bytes; "
                                 f"the header needs {end}")
        out, pos = [], plan.shm_offset
        for size in plan.sizes:
            out.append(seg.buf[pos:pos + size])
            pos += size
        return out

    @rpc("Stage")
    async def Stage(self, request: Any, context: grpc.aio.ServicerContext,
                    ) -> kvstore_pb2.StageResponse:
        req: kvstore_pb2.StageRequest = _parsed(request, "StageRequest")
        if self.wh.g2 is None:
            raise ShmUnavailable("this store has no shared-memory tier")
        seg = await asyncio.to_thread(self.staging.open, context.peer(), req.min_bytes,
                                      _caller(context))
        return kvstore_pb2.StageResponse(shm_name=seg.name, size=seg.size)

    @rpc("Get")
    async def Get(self, request: Any, context: grpc.aio.ServicerContext,
                  ) -> AsyncIterator[bytes]:
        req: kvstore_pb2.GetRequest = _parsed(request, "GetRequest")
        ctx = ctx_from_proto(req.ctx)
        keys = _keys(req.keys, self.limits)
        chunk = min(req.max_chunk_bytes or self.limits.get_chunk_bytes,
                    self.limits.max_message_bytes - 4096)
        chunk = max(chunk, 4096)
        batch = max(1, self.limits.get_chunk_bytes * 8 // chunk)
        if req.use_shm:  # G2 hits pin nothing (descriptors only): fewer, larger batches
            batch = max(batch, SHM_GET_BATCH)
        # Batches bound the memory a big Get pins at once; one thread hop per batch.
        # G2 hits are always located, not copied: a socket client gets the bytes
        # copied once, from the arena straight into the outgoing message.
        # Descriptor-only chunks (misses, shared-memory slots) of consecutive blocks
        # travel together in one message (GetChunk.more), flushed before any data.
        small: list[kvstore_pb2.GetChunk] = []
        for start in range(0, len(keys), batch):
            fetched = await self.wh.get(keys[start:start + batch], ctx=ctx, locate=True)
            for f in fetched:
                if f.meta is None:
                    small.append(kvstore_pb2.GetChunk(
                        header=kvstore_pb2.BlockHeader(key=f.key), missing=True))
                    continue
                hdr = kvstore_pb2.BlockHeader(key=f.key, size=f.meta.size,
                                              token_count=f.meta.token_count,
                                              checksum=f.meta.checksum)
                if f.slot is not None and req.use_shm:
                    small.append(kvstore_pb2.GetChunk(
                        header=hdr, shm_name=f.slot.shm_name, shm_offset=f.slot.offset,
                        shm_valid_until=f.slot.valid_until,
                        shm_reuse_gen=max(f.slot.reuse_gen, 0)))
                    continue
                if small:
                    yield encode_get_chunks(small)
                    small = []
                pieces = self._from_slot(hdr, f.slot, chunk) if f.slot is not None else None
                if pieces is None and f.slot is not None:  # reused under us: read it again
                    again = await self.wh.get([f.key], ctx=ctx, locate=False)
                    f = again[0]
                    if f.payload is None:
                        yield encode_get_chunks([kvstore_pb2.GetChunk(
                            header=kvstore_pb2.BlockHeader(key=f.key), missing=True)])
                        continue
                if pieces is None:
                    assert f.payload is not None
                    pieces = _pieces(hdr, f.payload, chunk)
                for piece in pieces:
                    yield piece
            if small:  # the batch's descriptors before its next thread hop
                yield encode_get_chunks(small)
                small = []

    def _from_slot(self, hdr: kvstore_pb2.BlockHeader, slot: ShmSlot,
                   chunk: int) -> list[bytes] | None:
        """The block's GetChunk messages, copied straight out of the arena, or None
        when the copy does not match the checksum taken at put (scribbled, or the
        slot was reused under us): verified before anything is sent."""
        seg = self._segments.get(slot.shm_name)
        src = seg.buf[slot.offset:slot.offset + slot.size]
        try:
            pieces = _pieces(hdr, src, chunk)
        finally:
            src.release()
        data = [memoryview(p)[len(p) - n:] for p, n in
                zip(pieces, _piece_sizes(slot.size, chunk), strict=True)]
        return pieces if digest_matches(data, slot.checksum) else None

    @rpc("Delete")
    async def Delete(self, request: Any, context: grpc.aio.ServicerContext,
                     ) -> kvstore_pb2.DeleteResponse:
        req: kvstore_pb2.DeleteRequest = _parsed(request, "DeleteRequest")
        res = await self.wh.delete(_keys(req.keys, self.limits), ctx=ctx_from_proto(req.ctx))
        return kvstore_pb2.DeleteResponse(deleted=res.deleted)

    @rpc("Stats")
    async def Stats(self, request: Any, context: grpc.aio.ServicerContext,
                    ) -> kvstore_pb2.StatsResponse:
        _parsed(request, "StatsRequest")
        # A tenant identity learns nothing of other tenants (names, volumes, how many):
        # only the aggregate tier and class counters (docs/security.md, side channels).
        own = current_identity().tenant
        s = await self.wh.stats(tenant=own)
        return kvstore_pb2.StatsResponse(
            node=s.node,
            tiers=[kvstore_pb2.TierStats(tier=t.tier, capacity_bytes=t.capacity_bytes,
                                         used_bytes=t.used_bytes, blocks=t.blocks, hits=t.hits,
                                         misses=t.misses, evictions=t.evictions,
                                         checksum_failures=t.checksum_failures)
                   for t in s.tiers],
            classes=[kvstore_pb2.ClassStats(traffic_class=c.traffic_class, ttl_s=c.ttl_s,
                                            hits=c.hits, misses=c.misses, blocks=c.blocks)
                     for c in s.classes],
            whatif_json=s.whatif_json, shm_capable=s.shm_capable, hostname=s.hostname,
            tenants=[kvstore_pb2.TenantStats(tier=t.tier, tenant=t.tenant,
                                             used_bytes=t.used_bytes, blocks=t.blocks,
                                             quota_bytes=t.quota_bytes, evictions=t.evictions)
                     for t in s.tenants],
            tenant_names=0 if own else s.tenant_names, max_tenants=s.max_tenants)

    @rpc("SetQuota")
    async def SetQuota(self, request: Any, context: grpc.aio.ServicerContext,
                       ) -> kvstore_pb2.QuotaResponse:
        req: kvstore_pb2.SetQuotaRequest = _parsed(request, "SetQuotaRequest")
        if req.quota_bytes < -1:
            raise InvalidRequest(f"quota_bytes must be >= 0, or -1 for no limit; got "
                                 f"{req.quota_bytes}")
        nbytes = None if req.quota_bytes == -1 else req.quota_bytes
        log.info("quota %s %s: %s (by %s)", req.tier[:8], req.tenant[:64],
                 "reset to the config" if req.reset else nbytes, current_identity().describe())
        return _quota_response(await self.wh.set_quota(req.tier, req.tenant, nbytes,
                                                       reset=req.reset))

    @rpc("GetQuotas")
    async def GetQuotas(self, request: Any, context: grpc.aio.ServicerContext,
                        ) -> kvstore_pb2.QuotaResponse:
        _parsed(request, "GetQuotasRequest")
        return _quota_response(self.wh.quotas.table)

    @rpc("Warm")
    async def Warm(self, request: Any, context: grpc.aio.ServicerContext,
                   ) -> kvstore_pb2.WarmResponse:
        from kvstore.warm import warm

        req: kvstore_pb2.WarmRequest = _parsed(request, "WarmRequest")
        res = await warm(self.wh, _keys(req.keys, self.limits), prompt_tokens=req.prompt_tokens,
                         ctx=ctx_from_proto(req.ctx))
        return kvstore_pb2.WarmResponse(matched_blocks=res.matched_blocks,
                                        in_g2_blocks=res.in_g2_blocks,
                                        promoted_blocks=res.promoted_blocks)

    def add_to_server(self, server: grpc.aio.Server) -> None:
        ser = {"response_serializer": lambda m: m.SerializeToString()}
        handlers = {
            "Lookup": grpc.unary_unary_rpc_method_handler(
                self.Lookup, request_deserializer=_safe(kvstore_pb2.LookupRequest.FromString),
                **ser),
            "Put": grpc.stream_unary_rpc_method_handler(
                self.Put, request_deserializer=_safe(decode_put_chunk), **ser),
            "Get": grpc.unary_stream_rpc_method_handler(
                self.Get, request_deserializer=_safe(kvstore_pb2.GetRequest.FromString),
                response_serializer=bytes),  # pieces arrive serialized (kvstore.wire)
            "Delete": grpc.unary_unary_rpc_method_handler(
                self.Delete, request_deserializer=_safe(kvstore_pb2.DeleteRequest.FromString),
                **ser),
            "Stats": grpc.unary_unary_rpc_method_handler(
                self.Stats, request_deserializer=_safe(kvstore_pb2.StatsRequest.FromString),
                **ser),
            "Stage": grpc.unary_unary_rpc_method_handler(
                self.Stage, request_deserializer=_safe(kvstore_pb2.StageRequest.FromString),
                **ser),
            "Warm": grpc.unary_unary_rpc_method_handler(
                self.Warm, request_deserializer=_safe(kvstore_pb2.WarmRequest.FromString),
                **ser),
            "SetQuota": grpc.unary_unary_rpc_method_handler(
                self.SetQuota,
                request_deserializer=_safe(kvstore_pb2.SetQuotaRequest.FromString), **ser),
            "GetQuotas": grpc.unary_unary_rpc_method_handler(
                self.GetQuotas,
                request_deserializer=_safe(kvstore_pb2.GetQuotasRequest.FromString), **ser),
        }
        server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))


@dataclass(slots=True)
class RunningServer:
    server: grpc.aio.Server
    port: int
    health: health_aio.HealthServicer
    service: KVStoreService | None = None
    health_server: grpc.aio.Server | None = None   # plain-text health-only port (probes)
    health_port: int = -1

    async def drain(self, grace_s: float) -> None:
        """Health NOT_SERVING first (balancers stop sending), then finish
        in-flight calls for up to ``grace_s``."""
        await self.health.enter_graceful_shutdown()
        await self.server.stop(grace_s)
        if self.health_server is not None:
            await self.health_server.stop(None)
        if self.service is not None:
            self.service.staging.close()


async def start_server(wh: Warehouse, *, host: str = "127.0.0.1", port: int = 0,
                       limits: ServiceLimits | None = None,
                       security: SecurityConfig | None = None,
                       health_port: int = -1) -> RunningServer:
    """Serve ``wh`` with mTLS (``security``; None = from the environment) and,
    when ``health_port`` >= 0, the health service alone in plain text there."""
    limits = limits or ServiceLimits()
    security = security or SecurityConfig.from_env("kvstore")
    # Calls beyond maximum_concurrent_rpcs get RESOURCE_EXHAUSTED from gRPC itself,
    # before any handler (or the interceptors) run.
    server = grpc.aio.server(options=limits.grpc_options(), interceptors=[
        # Who may call what: the per-role table in security/methods.py.
        *server_interceptors(), AuthInterceptor(insecure=security.insecure), InputGuard()],
        maximum_concurrent_rpcs=limits.max_concurrent_rpcs)
    service = KVStoreService(wh, limits)
    service.add_to_server(server)
    health = health_aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    reflection.enable_server_reflection(
        (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
         reflection.SERVICE_NAME), server)
    bound = security.add_port(server, f"{host}:{port}")
    if bound == 0:
        raise StoreUnavailable(f"cannot bind {host}:{port}")
    await server.start()
    serving = health_pb2.HealthCheckResponse.SERVING
    await health.set("", serving)
    await health.set(SERVICE_NAME, serving)
    probe = await start_health_port(health, host, health_port)
    return RunningServer(server, bound, health, service, *(probe or (None, -1)))
