"""The gRPC Prefill service (grpc.aio).

Prefill: refuse at once when the waiting queue is full (RESOURCE_EXHAUSTED +
``retry-after-ms``), tokenize, chain keys (tenant + engine fingerprint), G1
match, then queue the request in the step loop (prefill_svc/steps.py), whose
scheduler batches the prompts of many requests into each engine step under a
token budget, in a cache-aware order. While the request waits, its warehouse
lookup, hit rule and cost-aware fetch run. The reply goes out as soon as its
first token is sampled; its prompt stays resident in the engine with a
buffer entry for decode right behind it, and the new full blocks go to the
block writer.

PullKV / Release serve that buffer to decode (waiting for the entry if it is
not there yet). A resident entry's first pull copies out only the tokens
decode asks for (``start_token``), on the engine thread; one not pulled
within ``resident_s`` was copied out whole (steps.py). A pull from decode on
the same GPU (its device UUID in the request equals this engine's) gets the
KV as a CUDA IPC handle of a device copy (service/kv_ipc.py); any other pull,
or one whose KV already left the engine, takes the file or the byte stream.
Errors become status codes only in service.errors.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import grpc
import torch

from engine.staging import HostCopy
from kvstore.client import ctx_to_proto
from kvstore.keys import chain_keys
from kvstore.registry import LoadReport
from kvstore.types import PutResult
from prefill_svc.config import PrefillConfig
from prefill_svc.steps import Computed, Job, StepLoop
from proto import common_pb2, prefill_pb2, prefill_pb2_grpc
from service import kv_ipc
from service.aio import background
from service.cost import CostModel
from service.engine_thread import EngineThread
from service.errors import grpc_stream, grpc_unary, status_for
from service.kv_buffer import KVBuffer, KVPiece, KVShape, Resident
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
    pulls_total: dict[str, int] = field(default_factory=dict)   # "ipc" / "shm" / "stream"
    pulls_ipc_declined_total: int = 0       # asked for IPC, served from the host (not same
                                            # GPU, knob off, KV already on the host, error)
    prefill_tokens_per_s: float = 0.0
    in_flight_tokens: int = 0               # tokens still to compute, queued and running
    queue_waiting: int = 0                  # requests waiting to be admitted
    running: int = 0                        # prompts being computed
    refused_total: int = 0                  # RESOURCE_EXHAUSTED: the queue was full
    cancelled_total: int = 0                # callers gone before their first token
    admitted_total: int = 0                 # requests admitted into the engine
    queue_wait_s_total: float = 0.0         # their time from arrival to admission
    # That time split by its cause (prefill_svc/scheduler.py, WAIT_REASONS): warm (lookup
    # and fetch), pool (no KV blocks), held (a running prompt computes its prefix),
    # running (max_running), budget (the step's tokens went to others), engine (the
    # step in flight, demotions, the hop). Sums to queue_wait_s_total within the
    # tokenization before a request is queued.
    queue_split_seconds_total: dict[str, float] = field(default_factory=dict)
    demote_seconds_total: float = 0.0       # engine thread copying unpulled residents out whole
    finish_seconds_total: float = 0.0       # engine thread finishing prompts (write-through
                                            # gather, G1 publish): no step runs meanwhile
    steps_total: int = 0                    # engine steps (one forward with bik)
    step_tokens_total: int = 0              # prompt tokens computed by them
    step_seconds_total: float = 0.0         # their time on the engine thread (waits for the
                                            # device included where a step samples): busy
    chunks_total: int = 0                   # prompt chunks computed (one per prompt per step)
    stopped_total: int = 0                  # prompts ended early: their caller went away
    rewarmed_total: int = 0                 # fetches planned again: G1 lost blocks meanwhile
    resident: int = 0                       # finished prompts held in the engine for their pull
    handoff_materialized_total: int = 0     # copied out by their first pull (from its start)
    handoff_demoted_total: int = 0          # copied out whole: not pulled in time, or room needed
    handoff_bytes_total: int = 0            # KV bytes copied out of the engine for decode
    # Where a pull's time goes on this side (issue 18: 268 MB took ~1 s a pull
    # under load on the H200, and nothing said where):
    handoff_copy_seconds_total: float = 0.0     # the copy-outs themselves (engine -> host)
    pull_hold_seconds_total: float = 0.0        # PullKV start -> KV on the host (waits included)
    pull_shm_seconds_total: float = 0.0         # the hand-off file's checksum (or write)
    # Bulk copies held back while a step that completes prompts ran (CPU: they share its
    # cores; prefill_svc/steps.py, StepLoop.yield_to_finishing):
    copy_yield_seconds_total: float = 0.0
    queue_seconds: Hist = field(default_factory=Hist)   # arrival to admission


def _trace_engine(queue_s: float, res: Any) -> None:
    """The engine thread's part of the request as spans, placed back from now
    (the first token was just sampled): its queue wait, then the compute."""
    t = tracing.now()
    tracing.record("queue", t - res.compute_s - queue_s, t - res.compute_s, stage="prefill")
    tracing.record("compute", t - res.compute_s, t, computed_tokens=res.computed_tokens,
                   cached_tokens=res.restored_tokens + res.g1_tokens, g1_tokens=res.g1_tokens)


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
        self.buffer = KVBuffer(abandon_s=cfg.buffer_ttl_s, max_bytes=cfg.buffer_max_bytes,
                               chunk_bytes=cfg.chunk_bytes, shm_dir=cfg.shm_dir,
                               ipc_hold_s=cfg.ipc_hold_s)
        device = getattr(engine, "device", None)
        # This engine's GPU as decode names its own: equal UUIDs = one device.
        self.ipc_device = (kv_ipc.device_uuid(device)
                           if cfg.ipc_pulls and isinstance(device, torch.device) else "")
        self.stats = PrefillStats()
        self._sweeper: asyncio.Task[None] | None = None
        self._writes: set[asyncio.Task[None]] = set()   # new blocks on their way to the writer
        mc = engine.model_config
        self.token_nbytes = KVShape(mc.num_layers, mc.num_kv_heads, mc.head_dim,
                                    engine.dtype).token_nbytes
        self.steps = StepLoop(engine, self.thread, cfg.scheduler, self.stats,
                              tokens_per_s=self.cost.snapshot().prefill_tokens_per_s,
                              on_computed=self._buffer, on_demoted=self._demoted,
                              observe=self._observe)

    # -- lifecycle -----------------------------------------------------------

    async def start(self) -> None:
        if self.cfg.warmup_tokens:
            await self.thread.call(self._warmup, self.cfg.warmup_tokens)
        self.writer.start()
        await self.store.tier_names()              # learnt now if the store is up
        self._sweeper = asyncio.get_running_loop().create_task(self._sweep(), name="kv-sweeper")
        self.steps.start()

    async def close(self) -> None:
        await self.steps.close()
        if self._writes:                # their host copies, then the writer drains them
            await asyncio.wait(list(self._writes), timeout=self.cfg.endpoint.drain_grace_s)
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
        instance's prefill speed for the cost rule and the scheduler."""
        from engine import SamplingParams

        n = min(n, self.model.max_prompt_tokens)
        tokens = [i % min(self.model.vocab_size, 200) + 1 for i in range(n)]
        self.engine.prefill("__warmup__", tokens, sampling=SamplingParams(max_tokens=1))
        self.engine.free("__warmup__")
        res = self.engine.prefill("__warmup__", tokens, sampling=SamplingParams(max_tokens=1))
        self.engine.free("__warmup__")
        self.cost.observe_prefill(res.computed_tokens, res.compute_s, calibrate=True)
        self.stats.prefill_tokens_per_s = self.cost.snapshot().prefill_tokens_per_s
        self.steps.sched.tokens_per_s = self.stats.prefill_tokens_per_s

    def _observe(self, tokens: int, seconds: float) -> float:
        """A step computed ``tokens`` in ``seconds``: the speed the cost rule and
        the scheduler use (per step, not per request: requests share steps)."""
        self.cost.observe_prefill(tokens, seconds)
        self.stats.prefill_tokens_per_s = self.cost.snapshot().prefill_tokens_per_s
        return self.stats.prefill_tokens_per_s

    def load_report(self) -> LoadReport:
        sched = self.steps.sched
        return LoadReport(load=self.thread.utilization(), queue=sched.queue,
                          tokens_in_flight=sched.tokens_in_flight,
                          capacity=float(self.cfg.engine.num_blocks))

    def metric_sources(self) -> dict[str, Source]:
        return {"prefill": lambda: self.stats, "writer": lambda: self.writer.stats,
                "store": lambda: self.store.stats, "buffer": self.buffer.stats,
                "restore": lambda: self.restorer.stats, "memory": self.engine.memory,
                "engine": self.engine.shared_stats}

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
        self.steps.check_count()                  # a full queue refuses before any work
        inp = prefill_input(request, self.model, self.engine.tokenizer,
                            classes=self.cfg.classes, default_tenant=self.cfg.default_tenant)
        tokens, ctx = inp.tokens, inp.ctx
        keys = chain_keys(tokens, block_tokens=self.block_tokens, tenant=ctx.tenant,
                          fingerprint=self.engine.fingerprint, secret=self.secret)
        # Read off the engine thread: BlockPool.match only reads dicts, and the
        # admission matches again on the engine thread (this count only ranks
        # the request and sizes the fetch).
        g1 = self.engine.g1_match(keys) if self.cfg.local_prefix_cache else 0
        loop = asyncio.get_running_loop()
        job = Job(ctx, tokens, inp.sampling, keys, keys if self.cfg.local_prefix_cache else None,
                  len(keys), loop.create_future(), loop.create_future(),
                  kv_seed=self.buffer.new_seed())
        entry = self.steps.submit(job, g1_blocks=g1, warm=functools.partial(self._warm, job))
        try:
            first = await job.first
        except asyncio.CancelledError:
            # Stoppable: a caller that hangs up (the router's client left) leaves the
            # queue at once, or stops its prompt before the next step.
            self.steps.cancel(entry)
            raise
        restore = job.restore
        assert restore is not None
        res = first.result
        self.stats.queue_seconds.observe(first.queue_s)
        _trace_engine(first.queue_s, res)
        written: list[str] = []
        if job.write_from < len(keys):
            written = await self.store.tier_names() or ["warehouse"]
        self._count(restore, res)
        total_s = time.perf_counter() - t0
        return prefill_pb2.KVHandle(
            ctx=ctx_to_proto(ctx), prefill_address=self.address, prompt_ids=tokens,
            block_keys=keys, first_token=res.first_token,
            cached_tokens=res.restored_tokens + res.g1_tokens, kv_seed=job.kv_seed,
            layout=self.engine.layout.name,
            timings=common_pb2.Timings(queue_s=first.queue_s, lookup_s=restore.lookup_s,
                                       fetch_s=restore.fetch_s, compute_s=res.compute_s,
                                       total_s=total_s),
            written_tiers=written, fetch_decision=restore.decision)

    async def _warm(self, job: Job, g1: int) -> Restore:
        """While the request waits: warehouse lookup, hit rule, cost-aware fetch."""
        restore = await self.restorer.restore(job.keys, prompt_tokens=len(job.tokens),
                                              g1_blocks=g1, ctx=job.ctx)
        # Blocks the warehouse lacks get written through (none without a warehouse).
        if self.store.enabled and self.cfg.writer.enabled:
            job.write_from = restore.stored_blocks or 0
        return restore

    def _buffer(self, job: Job, computed: Computed) -> None:
        """A finished prompt (loop thread): a resident buffer entry for decode
        (its KV still in the engine), its new blocks to the block writer."""
        assert computed.resident
        job.resident = Resident(functools.partial(self.steps.materialize, job),
                                functools.partial(self.steps.release_held, job))
        self.buffer.put_resident(job.ctx.request_id, len(job.tokens), seed=job.kv_seed,
                                 resident=job.resident)
        if computed.new_blocks is not None:
            background(self._write_through(job, computed.new_blocks), self._writes,
                       f"write-{job.ctx.request_id}")

    async def _write_through(self, job: Job, copy: HostCopy) -> None:
        """The new blocks to the block writer once on the host (the copy waits on
        a worker thread, never on the engine's), after a step completing prompts."""
        await self.steps.yield_to_finishing()
        blocks = await asyncio.to_thread(copy.wait)
        self.writer.submit(job.keys[job.write_from:], blocks, layout=self.engine.layout.name,
                           token_count=self.block_tokens, ctx=job.ctx)

    def _demoted(self, job: Job, kv: torch.Tensor | BaseException) -> None:
        """A resident prompt was copied out whole (loop thread): its entry holds it."""
        if job.resident is None:
            return                          # never registered: nothing to hold it
        if isinstance(kv, BaseException):
            log.warning("KV of prefilled request %s not copied out: %s", job.ctx.request_id, kv)
            self.buffer.lose(job.resident, f"copy-out failed: {kv}; rebuild it")
            return
        self.buffer.fill(job.resident, kv)

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

    async def _put(self, job: WriteJob) -> PutResult:
        return await self.store.put(job.keys, job.blocks, layout=job.layout,
                                    token_count=job.token_count, ctx=job.ctx)

    @grpc_stream
    async def PullKV(self, request: prefill_pb2.PullKVRequest,
                     context: grpc.aio.ServicerContext) -> AsyncIterator[prefill_pb2.KVChunk]:
        t0 = time.perf_counter()
        await self._buffered(request.request_id)
        first = request.start_token
        ipc = bool(self.ipc_device) and request.ipc_device == self.ipc_device
        entry = await self.buffer.hold(self.buffer.get(request.request_id), first,
                                       on_device=ipc)
        t1 = time.perf_counter()
        self.stats.pull_hold_seconds_total += t1 - t0
        if ipc:
            piece = await self._ipc_piece(entry, first, request.ipc_peer)
            if piece is not None:
                yield piece
                return
        if request.ipc_device:
            self.stats.pulls_ipc_declined_total += 1
        if request.use_shm and self.buffer.shm_capable:
            try:
                p = await asyncio.to_thread(self.buffer.shm_piece, entry, first)
                self.stats.pull_shm_seconds_total += time.perf_counter() - t1
            except OSError as exc:               # /dev/shm full: stream instead
                log.warning("shared-memory pull of %s failed (%s); streaming", entry.request_id,
                            exc)
            else:
                self.stats.pulls_total["shm"] = self.stats.pulls_total.get("shm", 0) + 1
                yield prefill_pb2.KVChunk(start_token=p.start_token, token_count=p.token_count,
                                          shm_name=p.shm_name, shm_offset=p.shm_offset,
                                          size=p.size, checksum=p.checksum)
                return
        self.stats.pulls_total["stream"] = self.stats.pulls_total.get("stream", 0) + 1
        for p in self.buffer.pieces(entry, first):
            yield prefill_pb2.KVChunk(start_token=p.start_token, token_count=p.token_count,
                                      data=p.data, size=len(p.data), checksum=p.checksum)

    async def _ipc_piece(self, entry: Any, first: int, peer: str) -> prefill_pb2.KVChunk | None:
        """The entry's device copy as a CUDA IPC handle; None: take the host path."""
        try:
            p: KVPiece | None = await asyncio.to_thread(self.buffer.ipc_piece, entry, first,
                                                        peer)
        except (RuntimeError, torch.OutOfMemoryError) as exc:   # the share failed
            log.warning("same-device pull of %s failed (%s); host path", entry.request_id, exc)
            return None
        if p is None or p.ipc is None:
            return None
        self.stats.pulls_total["ipc"] = self.stats.pulls_total.get("ipc", 0) + 1
        s = p.ipc
        return prefill_pb2.KVChunk(
            start_token=p.start_token, token_count=p.token_count, size=p.size,
            checksum=p.checksum,
            ipc=prefill_pb2.CudaIpc(handle=s.handle, storage_bytes=s.storage_bytes,
                                    offset_bytes=s.offset_bytes, ref_handle=s.ref_handle,
                                    ref_offset=s.ref_offset, event_handle=s.event_handle,
                                    event_sync=s.event_sync))

    @grpc_unary
    async def Release(self, request: prefill_pb2.ReleaseRequest,
                      context: grpc.aio.ServicerContext) -> prefill_pb2.ReleaseResponse:
        await self._buffered(request.request_id)
        return prefill_pb2.ReleaseResponse(released=self.buffer.release(request.request_id))

    @grpc_unary
    async def ResetPrefixCache(self, request: common_pb2.ResetPrefixCacheRequest,
                               context: grpc.aio.ServicerContext
                               ) -> common_pb2.ResetPrefixCacheResponse:
        from service.operator import reset_prefix_cache

        return await reset_prefix_cache(self.thread, self.engine)

    async def _buffered(self, request_id: str) -> None:
        """Wait until a just-prefilled request has its buffer entry (or failed to get one)."""
        job = self.steps.jobs.get(request_id)
        if job is not None:
            await asyncio.wait([job.buffered])   # never raises the request's own outcome
