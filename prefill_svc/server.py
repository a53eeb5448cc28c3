"""The gRPC Prefill service (grpc.aio).

Prefill: tokenize, chain keys (tenant + engine fingerprint), G1 match,
warehouse lookup, hit rule, cost-aware fetch, ``Engine.prefill`` of the rest,
then in one engine-thread job the prompt's KV is copied to the host buffer,
the new full blocks are exported for write-through, and the sequence is freed
(its blocks stay in G1 under their keys). The reply goes out as soon as that
job has sampled the first token, so the copy-out runs behind it; the block
writer then puts the new blocks into the warehouse.

PullKV / Release serve that host buffer to decode (waiting for a copy-out
still in progress). Errors become status
codes only in service.errors.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
import torch

from kvstore.client import ctx_to_proto
from kvstore.keys import chain_keys
from kvstore.registry import LoadReport
from kvstore.types import PutResult, RequestCtx
from prefill_svc.config import PrefillConfig
from proto import common_pb2, prefill_pb2, prefill_pb2_grpc
from service.cost import CostModel
from service.engine_thread import EngineThread, Stop
from service.errors import grpc_stream, grpc_unary, status_for
from service.kv_buffer import KVBuffer, KVShape
from service.metrics import Hist, Source
from service.request import ModelIdentity, prefill_input
from service.restore import Restore, Restorer
from service.store_link import StoreLink
from service.writer import BlockWriter, WriteJob
from telemetry import tracing

log = logging.getLogger(__name__)

SERVICE_NAME = prefill_pb2.DESCRIPTOR.services_by_name["Prefill"].full_name


@dataclass(slots=True)
class PrefillStats:
    requests_total: dict[str, int] = field(default_factory=dict)    # "ok" / status name
    degraded_requests_total: int = 0        # answered without the warehouse (it was down)
    cached_tokens_total: int = 0            # = g1_tokens_total + warehouse_tokens_total
    g1_tokens_total: int = 0                # of them from the engine's own prefix cache
    warehouse_tokens_total: int = 0         # of them restored from the warehouse
    computed_tokens_total: int = 0
    fetch_decisions_total: dict[str, int] = field(default_factory=dict)
    fetch_short_blocks_total: int = 0
    pulls_total: dict[str, int] = field(default_factory=dict)       # "shm" / "stream"
    prefill_tokens_per_s: float = 0.0
    in_flight_tokens: int = 0
    chunks_total: int = 0                   # prefill chunks computed (engine.prefill)
    stopped_total: int = 0                  # prefills ended early: their caller went away
    queue_seconds: Hist = field(default_factory=Hist)   # waiting for the engine thread


@dataclass(frozen=True, slots=True)
class _Sampled:
    result: Any                     # engine.PrefillResult
    queue_s: float


@dataclass(frozen=True, slots=True)
class _Computed:
    kv: torch.Tensor                # [layers, 2, kv_heads, L, head_dim] on the host
    new_blocks: torch.Tensor | None  # [n, layers, 2, kv_heads, B, head_dim], blocks write_from..


def _trace_engine(queue_s: float, res: Any) -> None:
    """The engine thread's part of the request as spans, placed back from now
    (the first token was just sampled): its queue wait, then the compute."""
    t = tracing.now()
    tracing.record("queue", t - res.compute_s - queue_s, t - res.compute_s, stage="prefill")
    tracing.record("compute", t - res.compute_s, t, computed_tokens=res.computed_tokens,
                   cached_tokens=res.restored_tokens + res.g1_tokens, g1_tokens=res.g1_tokens)


def _resolve(fut: asyncio.Future[_Sampled], first: _Sampled) -> None:
    if not fut.done():
        fut.set_result(first)


class PrefillService(prefill_pb2_grpc.PrefillServicer):
    def __init__(self, cfg: PrefillConfig, engine: Any, *, address: str) -> None:
        self.cfg = cfg
        self.engine = engine
        self.address = address
        self.block_tokens = engine.layout.block_tokens
        mc = engine.model_config
        self.model = ModelIdentity(
            name=cfg.engine.model, fingerprint_hex=engine.fingerprint_hex,
            layout=engine.layout.name, vocab_size=mc.vocab_size,
            max_prompt_tokens=min(cfg.max_prompt_tokens or mc.max_position, mc.max_position - 1))
        self.thread = EngineThread("prefill-engine")
        security = cfg.endpoint.security_for("prefill")
        self.secret = security.require_secret()  # keys tenant salts (kvstore.keys)
        self.store = StoreLink(cfg.endpoint.store_address, timeout_s=cfg.endpoint.call_timeout_s,
                               security=security)
        self.cost = CostModel(cfg.cost, block_nbytes=engine.layout.block_nbytes,
                              block_tokens=self.block_tokens)
        self.restorer = Restorer(self.store, self.cost, engine.hit_rule, engine.layout,
                                 pin=engine.device.type == "cuda")
        self.writer = BlockWriter(self._put, retries=cfg.writer.retries,
                                  backoff_s=cfg.writer.backoff_s, max_queue=cfg.writer.max_queue)
        self.buffer = KVBuffer(ttl_s=cfg.buffer_ttl_s, max_bytes=cfg.buffer_max_bytes,
                               chunk_bytes=cfg.chunk_bytes, shm_dir=cfg.shm_dir)
        self.stats = PrefillStats()
        self._sweeper: asyncio.Task[None] | None = None
        mc = engine.model_config
        self.token_nbytes = KVShape(mc.num_layers, mc.num_kv_heads, mc.head_dim,
                                    engine.dtype).token_nbytes
        # Requests whose handle is out while their KV is still being copied out.
        self._pending: dict[str, asyncio.Task[None]] = {}

    # -- lifecycle -----------------------------------------------------------

    async def start(self) -> None:
        if self.cfg.warmup_tokens:
            await self.thread.call(self._warmup, self.cfg.warmup_tokens)
        self.writer.start()
        await self.store.tier_names()              # learnt now if the store is up
        self._sweeper = asyncio.get_running_loop().create_task(self._sweep(), name="kv-sweeper")

    async def close(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sweeper
        await self.writer.close(drain_s=self.cfg.endpoint.drain_grace_s)
        await self.store.close()
        self.buffer.close()
        self.thread.close()

    async def _sweep(self) -> None:
        while True:
            await asyncio.sleep(1.0)
            self.buffer.sweep()

    def _warmup(self, n: int) -> None:
        """One cold prefill at start: warms the kernels and measures this
        instance's prefill speed for the cost rule."""
        from engine import SamplingParams

        n = min(n, self.model.max_prompt_tokens)
        tokens = [i % min(self.model.vocab_size, 200) + 1 for i in range(n)]
        self.engine.prefill("__warmup__", tokens, sampling=SamplingParams(max_tokens=1))
        self.engine.free("__warmup__")
        res = self.engine.prefill("__warmup__", tokens, sampling=SamplingParams(max_tokens=1))
        self.engine.free("__warmup__")
        self.cost.observe_prefill(res.computed_tokens, res.compute_s, calibrate=True)
        self.stats.prefill_tokens_per_s = self.cost.snapshot().prefill_tokens_per_s

    def load_report(self) -> LoadReport:
        return LoadReport(load=self.thread.utilization(), queue=max(0, self.thread.pending - 1),
                          tokens_in_flight=self.stats.in_flight_tokens,
                          capacity=float(self.cfg.engine.num_blocks))

    def metric_sources(self) -> dict[str, Source]:
        return {"prefill": lambda: self.stats, "writer": lambda: self.writer.stats,
                "store": lambda: self.store.stats, "buffer": self.buffer.stats,
                "restore": lambda: self.restorer.stats}

    # -- RPCs ----------------------------------------------------------------

    @grpc_unary
    async def Prefill(self, request: prefill_pb2.PrefillRequest,
                      context: grpc.aio.ServicerContext) -> prefill_pb2.KVHandle:
        try:
            handle = await self._prefill(request)
        except Exception as exc:
            name = status_for(exc).code.name
            self.stats.requests_total[name] = self.stats.requests_total.get(name, 0) + 1
            raise
        self.stats.requests_total["ok"] = self.stats.requests_total.get("ok", 0) + 1
        return handle

    async def _prefill(self, request: prefill_pb2.PrefillRequest) -> prefill_pb2.KVHandle:
        t0 = time.perf_counter()
        inp = prefill_input(request, self.model, self.engine.tokenizer,
                            classes=self.cfg.classes, default_tenant=self.cfg.default_tenant)
        tokens, ctx, L = inp.tokens, inp.ctx, len(inp.tokens)
        keys = chain_keys(tokens, block_tokens=self.block_tokens, tenant=ctx.tenant,
                          fingerprint=self.engine.fingerprint, secret=self.secret)
        self.buffer.check_room(L * self.token_nbytes)
        self.stats.in_flight_tokens += L
        try:
            g1 = (await self.thread.call(self.engine.g1_match, keys)
                  if self.cfg.local_prefix_cache else 0)
            restore = await self.restorer.restore(keys, prompt_tokens=L, g1_blocks=g1, ctx=ctx)
        except BaseException:
            self.stats.in_flight_tokens -= L
            raise
        # Blocks the warehouse lacks get written through (none without a warehouse).
        writing = self.store.enabled and self.cfg.writer.enabled
        write_from = (restore.stored_blocks or 0) if writing else len(keys)
        loop = asyncio.get_running_loop()
        sampled: asyncio.Future[_Sampled] = loop.create_future()
        expires_at = self.buffer.expiry()
        job = loop.create_task(self._run(ctx, tokens, inp.sampling, keys, restore, write_from,
                                         expires_at, sampled))
        self._pending[ctx.request_id] = job
        try:
            # The handle goes out as soon as the first token is sampled; the KV
            # copy-out for decode finishes behind it (PullKV waits for it).
            first = await asyncio.shield(sampled)
        except asyncio.CancelledError:
            # Stoppable: a caller that hangs up (the router's client left) ends the
            # prefill before its next chunk instead of after the whole prompt.
            job.cancel()
            raise
        res = first.result
        self.stats.queue_seconds.observe(first.queue_s)
        _trace_engine(first.queue_s, res)
        written: list[str] = []
        if writing and len(tokens) // self.block_tokens > write_from:
            written = await self.store.tier_names() or ["warehouse"]
        self._count(restore, res)
        total_s = time.perf_counter() - t0
        return prefill_pb2.KVHandle(
            ctx=ctx_to_proto(ctx), prefill_address=self.address, prompt_ids=tokens,
            block_keys=keys, first_token=res.first_token,
            cached_tokens=res.restored_tokens + res.g1_tokens, expires_at=expires_at,
            layout=self.engine.layout.name,
            timings=common_pb2.Timings(queue_s=first.queue_s, lookup_s=restore.lookup_s,
                                       fetch_s=restore.fetch_s, compute_s=res.compute_s,
                                       total_s=total_s),
            written_tiers=written, fetch_decision=restore.decision)

    async def _run(self, ctx: RequestCtx, tokens: list[int], sampling: Any,
                   keys: Sequence[bytes], restore: Restore, write_from: int, expires_at: float,
                   sampled: asyncio.Future[_Sampled]) -> None:
        """The engine job of one request and what follows it: buffer the KV for
        decode, queue the new blocks for the warehouse. ``sampled`` resolves
        (or fails) as soon as the first token is known."""
        loop = asyncio.get_running_loop()

        def tell(first: _Sampled) -> None:       # engine thread
            loop.call_soon_threadsafe(_resolve, sampled, first)

        try:
            computed = await self.thread.call_stoppable(
                self._compute, ctx.request_id, tokens, sampling, keys, restore, write_from,
                time.perf_counter(), tell)
            self.buffer.put(ctx.request_id, computed.kv, expires_at=expires_at)
            if computed.new_blocks is not None:
                self.writer.submit(keys[write_from:], computed.new_blocks,
                                   layout=self.engine.layout.name,
                                   token_count=self.block_tokens, ctx=ctx)
        except BaseException as exc:
            if not sampled.done():
                if isinstance(exc, asyncio.CancelledError):
                    sampled.cancel()
                else:
                    sampled.set_exception(exc)
            elif not isinstance(exc, asyncio.CancelledError):
                # The handle is out: its pull will report the KV as gone.
                log.warning("KV of prefilled request %s not buffered: %s", ctx.request_id, exc)
            if isinstance(exc, asyncio.CancelledError):
                raise
        finally:
            self.stats.in_flight_tokens -= len(tokens)
            self._pending.pop(ctx.request_id, None)

    def _compute(self, stop: Stop, seq_id: str, tokens: list[int], sampling: Any,
                 keys: Sequence[bytes], restore: Restore, write_from: int,
                 t_submit: float, tell: Callable[[_Sampled], None]) -> _Computed:
        """Engine thread: prefill, tell the loop the first token, copy the
        prompt's KV out, free the sequence."""
        queue_s = time.perf_counter() - t_submit
        eng = self.engine

        def next_chunk() -> bool:
            """True: stop now. Counts the chunks that do run."""
            if stop():
                self.stats.stopped_total += 1
                return True
            self.stats.chunks_total += 1
            return False

        g1_keys = keys if self.cfg.local_prefix_cache else None
        # restored_start_block pins where the fetched blocks go: if another
        # request evicted part of the G1 hit meanwhile, the engine recomputes.
        res = eng.prefill(seq_id, tokens, sampling=sampling, block_keys=g1_keys,
                          restored=restore.blocks, max_restore_tokens=restore.usable_tokens,
                          restored_start_block=restore.start_block, stop=next_chunk)
        try:
            tell(_Sampled(res, queue_s))
            kv = eng.export_tokens(seq_id, 0, len(tokens))
            n_full = len(tokens) // self.block_tokens
            new = (eng.export_blocks(seq_id, write_from, n_full - write_from)
                   if n_full > write_from else None)
        finally:
            eng.free(seq_id, keep_keys=g1_keys)
        return _Computed(kv, new)

    def _count(self, restore: Restore, res: Any) -> None:
        s = self.stats
        if restore.degraded:
            s.degraded_requests_total += 1
        kind = ("unavailable" if restore.degraded
                else restore.plan.kind if restore.plan else "none")
        s.fetch_decisions_total[kind] = s.fetch_decisions_total.get(kind, 0) + 1
        s.fetch_short_blocks_total += restore.short_blocks
        s.cached_tokens_total += res.restored_tokens + res.g1_tokens
        s.g1_tokens_total += res.g1_tokens
        s.warehouse_tokens_total += res.restored_tokens
        s.computed_tokens_total += res.computed_tokens
        self.cost.observe_prefill(res.computed_tokens, res.compute_s)
        s.prefill_tokens_per_s = self.cost.snapshot().prefill_tokens_per_s

    async def _put(self, job: WriteJob) -> PutResult:
        return await self.store.put(job.keys, job.blocks, layout=job.layout,
                                    token_count=job.token_count, ctx=job.ctx)

    @grpc_stream
    async def PullKV(self, request: prefill_pb2.PullKVRequest,
                     context: grpc.aio.ServicerContext) -> AsyncIterator[prefill_pb2.KVChunk]:
        await self._buffered(request.request_id)
        entry = self.buffer.get(request.request_id)
        if request.use_shm and self.buffer.shm_capable:
            try:
                p = await asyncio.to_thread(self.buffer.shm_piece, entry)
            except OSError as exc:               # /dev/shm full: stream instead
                log.warning("shared-memory pull of %s failed (%s); streaming", entry.request_id,
                            exc)
            else:
                self.stats.pulls_total["shm"] = self.stats.pulls_total.get("shm", 0) + 1
                yield prefill_pb2.KVChunk(start_token=p.start_token, token_count=p.token_count,
                                          shm_name=p.shm_name, shm_offset=p.shm_offset,
                                          size=p.size)
                return
        self.stats.pulls_total["stream"] = self.stats.pulls_total.get("stream", 0) + 1
        for p in self.buffer.pieces(entry):
            yield prefill_pb2.KVChunk(start_token=p.start_token, token_count=p.token_count,
                                      data=p.data, size=len(p.data))

    @grpc_unary
    async def Release(self, request: prefill_pb2.ReleaseRequest,
                      context: grpc.aio.ServicerContext) -> prefill_pb2.ReleaseResponse:
        await self._buffered(request.request_id)
        return prefill_pb2.ReleaseResponse(released=self.buffer.release(request.request_id))

    async def _buffered(self, request_id: str) -> None:
        """Wait until a just-prefilled request's KV is in the buffer (or failed to be)."""
        job = self._pending.get(request_id)
        if job is not None:
            await asyncio.wait([job])           # never raises the job's own outcome

