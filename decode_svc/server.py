"""The gRPC Decode service (grpc.aio, server streaming).

Decode: check the handle (model, layout, sampling), take the request only if
the bounded queue has room (else RESOURCE_EXHAUSTED with ``retry-after-ms``,
before any work), get the prompt's KV — pulled from the prefill instance's
host buffer and verified piece by piece against the checksums prefill sent,
or, when that fails for any reason (KV dropped for room, a stale handle, a
checksum mismatch, an unreachable prefill), rebuilt: restore the blocks the
warehouse holds, recompute the rest — join the continuous batch and stream
one event per token. When a sequence ends, the canonical blocks after the
prompt (``Engine.canonical_blocks``, recomputed through the prefill path where
the kernels are not batch-invariant) are put into the warehouse *before* the
final event goes out (up to ``canonical_wait_s``); the prompt's own blocks are
prefill's write-through. An agent that sends its next turn the moment the
answer ends then hits the whole previous context (docs/services.md, "After the
answer"). Errors become status codes only in service.errors.

A request with ``local_tail_tokens`` set had no prefill: the router saw its
prefix decoded here. Its KV comes from this instance's own G1 and the tail
is computed here between decode steps, the first token sampled here; when
G1 no longer leaves a tail that short, FAILED_PRECONDITION before any work
(docs/services.md, "A short tail on decode").
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import logging
import math
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import grpc
import torch

from decode_svc.batcher import Batcher, Finished
from decode_svc.config import DecodeConfig
from decode_svc.experts import ExpertLoad, ExpertPlacement
from decode_svc.first_event import EarlyFirst, early_first
from decode_svc.kv_gate import NeverFits
from decode_svc.prefix_hold import PrefixHold, PrefixHolds
from decode_svc.pull import KVPuller
from decode_svc.stopping import TextStream
from engine.staging import DeviceBudget, HostCopy, PinnedChunks
from kvstore.keys import chain_keys
from kvstore.registry import LoadReport
from kvstore.types import PutResult, RequestCtx
from proto import decode_pb2, decode_pb2_grpc, prefill_pb2
from service import kv_ipc
from service.cost import CostModel
from service.engine_thread import EngineThread
from service.errors import InvalidRequest, Overloaded, PreconditionFailed, grpc_stream, grpc_unary
from service.kv_buffer import KVIntegrityError, KVShape, Upload
from service.metrics import Hist, Source
from service.request import ModelIdentity, check_tokens, sampling_from_proto
from service.restore import Restorer
from service.store_link import StoreLink
from service.writer import BlockWriter, WriteJob
from telemetry import tracing

log = logging.getLogger(__name__)

SERVICE_NAME = decode_pb2.DESCRIPTOR.services_by_name["Decode"].full_name


@dataclass(slots=True)
class DecodeStats:
    requests_total: dict[str, int] = field(default_factory=dict)    # finish reason / status
    kv_sources_total: dict[str, int] = field(default_factory=dict)  # ipc/shm/stream/warehouse
    pull_bytes_total: int = 0
    g1_prefix_tokens_total: int = 0      # prompt tokens decode's own G1 held (not pulled)
    pull_seconds_total: float = 0.0
    pull_place_seconds_total: float = 0.0   # of it: reading, verifying, placing (the upload)
    pulls_to_device_total: int = 0          # landed on the device (the rest: host, adopt uploads)
    rebuilt_tokens_total: int = 0        # recomputed during rebuilds from the warehouse
    rebuilds_total: dict[str, int] = field(default_factory=dict)   # why the pull was not used
    kv_integrity_failures_total: int = 0  # hand-off pieces that failed their checksum
    busy_rejections_total: int = 0       # refused with RESOURCE_EXHAUSTED (queue full)
    kv_too_large_total: int = 0          # refused: more KV blocks than the whole pool
    in_service: int = 0                  # Decode calls taken: pulling, waiting or decoding
    canonical_blocks_total: int = 0      # put into the warehouse after requests
    canonical_seconds_total: float = 0.0  # compute + put, added to the end of answers
    canonical_engine_seconds_total: float = 0.0  # of it on the engine thread (steps wait)
    canonical_late_total: int = 0        # final events sent before their blocks were stored
    early_first_total: int = 0           # first events sent before the KV was here
    local_tails_total: int = 0           # prompts computed here with no prefill (short tails)
    local_tail_tokens_total: int = 0     # prompt tokens those computed here
    local_cached_tokens_total: int = 0   # prompt tokens those took from this G1 (not computed)
    local_colds_total: int = 0           # of those, prompts it held none of (short ones)
    local_declined_total: int = 0        # declined: G1 left more than the tail allowed
    expert_imbalance: float = 1.0
    # Prefill -> decode hand-off (pull or rebuild of the prompt's KV), by how it came.
    handoff_seconds: dict[str, Hist] = field(default_factory=lambda: {
        k: Hist() for k in ("ipc", "shm", "stream", "warehouse")})


@dataclass(frozen=True, slots=True)
class ExpertSnapshot:
    imbalance: float
    tokens_total: dict[str, int]        # "L<layer>/E<expert>" -> tokens routed since start


@dataclass(frozen=True, slots=True)
class _Checked:
    ctx: RequestCtx
    tokens: list[int]
    sampling: Any                        # engine.SamplingParams
    stale: bool = False                  # past the handle's expires_at: rebuild, don't pull


class DecodeService(decode_pb2_grpc.DecodeServicer):
    def __init__(self, cfg: DecodeConfig, engine: Any, *, address: str) -> None:
        self.cfg = cfg
        self.engine = engine
        self.address = address
        mc = engine.model_config
        self.block_tokens = engine.layout.block_tokens
        self.model = ModelIdentity(cfg.engine.model, engine.fingerprint_hex, engine.layout.name,
                                   mc.vocab_size, mc.max_position - 1)
        self.shape = KVShape(mc.num_layers, mc.num_kv_heads, mc.head_dim, engine.dtype)
        self.thread = EngineThread("decode-engine")
        self.experts = _expert_load(cfg, mc)
        self.batcher = Batcher(engine, self.thread, max_seqs=cfg.max_seqs,
                               after_step=self._after_step if self.experts else None,
                               rebuild_chunk=cfg.prefill_chunk_tokens)
        self.prefixes = PrefixHolds(engine, self.thread, self.batcher.gate)
        security = cfg.endpoint.security_for("decode")
        self.secret = security.require_secret()  # keys tenant salts (kvstore.keys)
        self.puller = KVPuller(cfg.endpoint, timeout_s=cfg.pull_timeout_s,
                               use_shm=cfg.use_shm, shm_dir=cfg.shm_dir, security=security,
                               upload=_upload(engine),
                               ipc_device=kv_ipc.device_uuid(engine.device)
                               if cfg.use_ipc and isinstance(getattr(engine, "device", None),
                                                             torch.device) else "")
        self.store = StoreLink(cfg.endpoint.store_address, timeout_s=cfg.endpoint.call_timeout_s,
                               security=security)
        self.cost = CostModel(cfg.cost, block_nbytes=engine.layout.block_nbytes,
                              block_tokens=self.block_tokens)
        self.restorer = Restorer(self.store, self.cost, engine.hit_rule, engine.layout,
                                 pin=engine.device.type == "cuda")
        self.writer = BlockWriter(self._put, retries=cfg.writer.retries,
                                  backoff_s=cfg.writer.backoff_s, max_queue=cfg.writer.max_queue)
        self.stats = DecodeStats()
        # Device memory answer-end gathers may hold until their host copy (off the
        # engine thread) is done: 16 llama-8b-shape answers of 512 tokens.
        self._canon_budget = DeviceBudget(_CANONICAL_BYTES)
        self._ids = itertools.count()
        self._releases: set[asyncio.Task[None]] = set()
        self._service_s = 1.0            # running mean of a Decode call's length (retry-after)

    # -- lifecycle -----------------------------------------------------------

    @grpc_unary
    async def ResetPrefixCache(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        from service.operator import reset_prefix_cache

        return await reset_prefix_cache(self.thread, self.engine)

    async def start(self) -> None:
        if self.cfg.warmup_tokens:
            await self.thread.call(self._warmup, self.cfg.warmup_tokens)
        self.writer.start()
        self.batcher.start()

    async def close(self) -> None:
        await self.batcher.close()
        await self.writer.close(drain_s=self.cfg.endpoint.drain_grace_s)
        await self.puller.close()
        await self.store.close()
        self.thread.close()

    def _warmup(self, n: int) -> None:
        """A short prefill + a few steps: warms kernels, measures this
        instance's prefill speed (for rebuild decisions)."""
        from engine import SamplingParams

        n = min(n, self.model.max_prompt_tokens - 8)
        tokens = [i % min(self.model.vocab_size, 200) + 1 for i in range(n)]
        res = self.engine.prefill("__warmup__", tokens, sampling=SamplingParams(max_tokens=4))
        for _ in range(3):
            self.engine.decode_step(["__warmup__"])
        self.engine.free("__warmup__")
        t0 = time.monotonic()
        if graphs := self.engine.capture_decode_graphs():
            log.info("captured the decode graphs of %d batch sizes in %.1fs", graphs,
                     time.monotonic() - t0)
        self.engine.expert_counts()          # start the MoE counts from zero
        self.cost.observe_prefill(res.computed_tokens, res.compute_s, calibrate=True)

    def load_report(self) -> LoadReport:
        st = self.batcher.stats
        return LoadReport(
            load=self.thread.utilization(), queue=st.waiting, tokens_in_flight=st.tokens_in_flight,
            expert_imbalance=self.experts.current if self.experts else None,
            capacity=float(self.cfg.engine.num_blocks),
            kv_free_tokens=self.batcher.gate.unreserved * self.block_tokens,
            kv_capacity_tokens=self.batcher.gate.capacity * self.block_tokens)

    def metric_sources(self) -> dict[str, Source]:
        sources: dict[str, Source] = {
            "decode": lambda: self.stats, "batch": lambda: self.batcher.stats,
            "kv": self.batcher.kv_stats,
            "writer": lambda: self.writer.stats, "store": lambda: self.store.stats,
            "restore": lambda: self.restorer.stats, "memory": self.engine.memory,
            "engine": self.engine.shared_stats}
        if self.experts is not None:
            sources["experts"] = self._expert_snapshot
        return sources

    def _expert_snapshot(self) -> ExpertSnapshot:
        assert self.experts is not None
        counts = {f"L{li}/E{e}": c for li, row in enumerate(self.experts.per_expert())
                  for e, c in enumerate(row)}
        return ExpertSnapshot(self.experts.current, counts)

    # -- Decode ----------------------------------------------------------------

    @grpc_stream
    async def Decode(self, request: decode_pb2.DecodeRequest,
                     context: grpc.aio.ServicerContext) -> AsyncIterator[decode_pb2.DecodeEvent]:
        t0 = time.monotonic()
        handle = request.handle
        chk = self._check(handle, request)
        kv_blocks = self._kv_blocks(chk)
        self._admit()
        try:
            # Closed with this call (client gone), not whenever it is collected.
            events_of = (functools.partial(self._local, request.local_tail_tokens)
                         if request.local_tail_tokens else
                         functools.partial(self._decode, handle,
                                           budget_s=context.time_remaining()))
            async with contextlib.aclosing(events_of(chk, kv_blocks, t0)) as events:
                async for ev in events:
                    yield ev
        finally:
            self.stats.in_service -= 1
            self._service_s += 0.2 * (time.monotonic() - t0 - self._service_s)

    def _admit(self) -> None:
        """Take the call, or refuse it before any work when pulling, waiting and
        decoding calls already fill ``max_seqs + max_waiting``."""
        room = self.cfg.max_seqs + self.cfg.max_waiting
        if self.stats.in_service >= room:
            self.stats.busy_rejections_total += 1
            over = self.stats.in_service - room + 1
            wait = min(30.0, max(0.05, self._service_s * over / self.cfg.max_seqs))
            raise Overloaded(f"decode queue full: {self.stats.in_service} requests taken of "
                             f"{room}; retry in {wait:.2f}s", retry_after_s=wait)
        self.stats.in_service += 1

    def _kv_blocks(self, chk: _Checked) -> int:
        """The KV blocks the sequence may hold here (reserved before it joins the
        batch); refused at once, before any work, when the whole pool is smaller:
        no wait would ever make room (INVALID_ARGUMENT: the router answers 400
        instead of trying again)."""
        need = self.engine.kv_blocks_for(len(chk.tokens), chk.sampling.max_tokens,
                                         canonical=self.cfg.canonical_write)
        try:
            self.batcher.gate.check(need)
        except NeverFits:
            self.stats.kv_too_large_total += 1
            raise InvalidRequest(
                f"prompt of {len(chk.tokens)} tokens + max_tokens {chk.sampling.max_tokens} "
                f"needs {need} KV blocks of {self.block_tokens} tokens; this decode "
                f"instance's KV pool holds {self.batcher.gate.capacity} blocks "
                f"({self.batcher.gate.capacity * self.block_tokens} tokens): lower max_tokens "
                "or shorten the prompt") from None
        return need

    async def _local(self, max_tail: int, chk: _Checked, kv_blocks: int,
                     t0: float) -> AsyncIterator[decode_pb2.DecodeEvent]:
        """A prompt with no prefill: its leading blocks from this instance's G1
        (pinned first, so nothing evicts them before the sequence takes them),
        at most ``max_tail`` tokens (and ``local_tail_max_tokens``) computed
        here in chunks between decode steps, the first token sampled here."""
        keys = self._keys(chk)
        n = len(chk.tokens)
        cap = min(max_tail, self.cfg.local_tail_max_tokens)
        hold = await self.prefixes.hold(keys, n)
        try:
            # What admit will reuse (the hit rule's reserve and, with kernels that
            # are not batch-invariant, the chunk cut applied), read with the pins held.
            reuse = self.engine.g1_admission(keys, n).usable_tokens if hold is not None else 0
            # Holding none of a long prompt (the router's record is stale: a reset, an
            # eviction), prefill restores what the warehouse has instead of computing
            # it all here; a short one costs about a step here, and less than the hop.
            cold_cap = min(cap, self.cfg.local_cold_max_tokens)
            if n - reuse > cap or (reuse == 0 and n > cold_cap):
                self.stats.local_declined_total += 1
                raise PreconditionFailed(
                    f"this decode instance holds {reuse} of the prompt's {n} tokens; the "
                    f"{n - reuse} left exceed the {cap} it computes without a prefill"
                    if reuse else f"this decode instance holds none of the prompt; it computes "
                    f"a prompt without a prefill only when it holds some or when it has at "
                    f"most {cold_cap} tokens")
            if reuse == 0:
                self.stats.local_colds_total += 1
            self.stats.local_tails_total += 1
            self._source("local")
            tracing.annotate(path="local", g1_tokens=reuse)
            admitted: list[int] = []

            def admit(seq_id: str) -> None:
                try:
                    adm = self.engine.admit(seq_id, chk.tokens, sampling=chk.sampling,
                                            block_keys=keys, share_scope=chk.ctx.tenant)
                finally:
                    # The sequence holds its own references now. Pins kept to the end
                    # would outlive the gate's reservation (given back when the
                    # sequence is freed, before this call ends): blocks neither
                    # reserved nor evictable, and the next admitted sequence found
                    # the pool short (seen on the cc50 replay).
                    if hold is not None:
                        self.prefixes.drop_now(hold)
                self.stats.local_tail_tokens_total += adm.to_compute
                self.stats.local_cached_tokens_total += adm.g1_tokens
                admitted.append(adm.g1_tokens)

            handle = prefill_pb2.KVHandle(prompt_ids=chk.tokens)
            async with contextlib.aclosing(self._generate(
                    handle, chk, kv_blocks, t0, TextStream(chk.sampling.stop), None, admit,
                    hold, prompt_keys=keys, cached=admitted)) as events:
                async for out in events:
                    yield out
        finally:
            if hold is not None:
                self.prefixes.release(hold)

    async def _decode(self, handle: prefill_pb2.KVHandle, chk: _Checked, kv_blocks: int,
                      t0: float, *, budget_s: float | None
                      ) -> AsyncIterator[decode_pb2.DecodeEvent]:
        stream = TextStream(chk.sampling.stop)
        early = self._early(handle, chk)
        try:
            if early is not None:
                self.stats.early_first_total += 1
                yield self._event(decode_pb2.DecodeEvent(
                    token_ids=[early.token], text=stream.delta(early.text, False),
                    t_s=time.monotonic() - t0))
            keys = self._keys(chk)
            hold = None if chk.stale else await self.prefixes.hold(keys, len(chk.tokens))
            try:
                with tracing.span("handoff", prefill=handle.prefill_address):
                    make_live = await self._obtain_kv(handle, chk, budget_s, hold, keys)
            except BaseException:
                if hold is not None:
                    self.prefixes.release(hold)
                raise
        except BaseException:
            # The caller left (or the rebuild failed) before the KV was here: free
            # the prefill's buffer now rather than when it needs the room.
            self._release_later(handle)
            raise
        try:
            async with contextlib.aclosing(self._generate(handle, chk, kv_blocks, t0, stream,
                                                          early, make_live, hold)) as events:
                async for out in events:
                    yield out
        finally:
            if hold is not None:
                self.prefixes.release(hold)

    async def _generate(self, handle: prefill_pb2.KVHandle, chk: _Checked, kv_blocks: int,
                        t0: float, stream: TextStream, early: EarlyFirst | None,
                        make_live: Callable[[str], None], hold: PrefixHold | None, *,
                        prompt_keys: list[bytes] | None = None,
                        cached: list[int] | None = None
                        ) -> AsyncIterator[decode_pb2.DecodeEvent]:
        """``prompt_keys``: the prompt's chain keys when the handle has none (no
        prefill wrote them); ``cached``: filled by ``make_live`` with the tokens
        reused when the handle does not say (a short tail computed here)."""
        seq_id = f"{chk.ctx.request_id}#{next(self._ids)}"
        written: asyncio.Event | None = None
        on_finish = None
        if self.cfg.canonical_write:
            written = asyncio.Event()
            on_finish = self._canonical_writer(
                chk.ctx, written, list(handle.block_keys) if prompt_keys is None else prompt_keys,
                prompt_written=prompt_keys is None and bool(handle.written_tiers), reused=cached)
        t_decode = tracing.now()
        async for ev in self.batcher.generate(
                seq_id, functools.partial(make_live, seq_id), prompt_tokens=len(chk.tokens),
                kv_blocks=kv_blocks, held_blocks=hold.hand_over() if hold is not None else 0,
                stop=chk.sampling.stop, on_finish=on_finish, t0=t0,
                stream=stream, first_shown=early is not None):
            if ev.finish_reason == "error":
                raise RuntimeError("the decode step failed; see the decode instance's log")
            out = self._event(decode_pb2.DecodeEvent(
                token_ids=ev.token_ids, text=ev.text, t_s=ev.t_s, finished=ev.finished,
                finish_reason=ev.finish_reason))
            if ev.finished:
                if written is not None:
                    await self._await_canonical(written, chk.ctx)
                out.usage.CopyFrom(decode_pb2.Usage(
                    prompt_tokens=len(chk.tokens), completion_tokens=ev.completion_tokens,
                    cached_tokens=cached[0] if cached else handle.cached_tokens))
                self._count(ev.finish_reason)
                tracing.record("decode", t_decode, tracing.now(), prompt_tokens=len(chk.tokens),
                               completion_tokens=ev.completion_tokens,
                               finish_reason=ev.finish_reason)
            yield out

    def _event(self, out: decode_pb2.DecodeEvent) -> decode_pb2.DecodeEvent:
        if self.experts is not None:
            out.expert_imbalance = self.experts.current
        return out

    def _early(self, handle: prefill_pb2.KVHandle, chk: _Checked) -> EarlyFirst | None:
        """The first event before the KV: nothing after it fails the request for
        want of KV, since a failed pull ends in a rebuild (from the warehouse where
        there is one, else by recomputing the prompt here)."""
        if not self.cfg.early_first_token:
            return None
        return early_first(self.engine, len(chk.tokens), handle.first_token, chk.sampling)

    def _check(self, handle: prefill_pb2.KVHandle, request: decode_pb2.DecodeRequest) -> _Checked:
        fp = handle.ctx.model_fingerprint
        if fp and fp != self.model.fingerprint_hex:
            raise PreconditionFailed(
                f"handle is for model fingerprint {fp[:64]!r}; this decode instance serves "
                f"{self.model.name} ({self.model.fingerprint_hex})")
        if handle.layout and handle.layout != self.model.layout:
            raise PreconditionFailed(f"handle KV layout {handle.layout!r} differs from this "
                                     f"instance's {self.model.layout!r}")
        if not (math.isfinite(handle.expires_at) and handle.expires_at >= 0):
            raise InvalidRequest(f"handle.expires_at must be a finite time >= 0 (0 = never), "
                                 f"got {handle.expires_at}")
        # A stale handle is finished work all the same: its KV is rebuilt, not refused.
        stale = bool(handle.expires_at) and handle.expires_at <= time.time()
        tokens = list(handle.prompt_ids)
        check_tokens(tokens, self.model)
        if handle.first_token >= self.model.vocab_size:
            raise InvalidRequest(f"first_token {handle.first_token} is outside the vocabulary")
        if not request.HasField("sampling"):
            raise InvalidRequest("sampling is required (at least sampling.max_tokens >= 1)")
        sampling = sampling_from_proto(request.sampling, require_max_tokens=True)
        ctx = RequestCtx(request_id=handle.ctx.request_id or f"decode-{next(self._ids)}",
                         tenant=handle.ctx.tenant or "default",
                         traffic_class=handle.ctx.traffic_class,
                         model_fingerprint=self.model.fingerprint_hex)
        return _Checked(ctx, tokens, sampling, stale)

    def _keys(self, chk: _Checked) -> list[bytes]:
        """Chain keys of the prompt's full blocks, computed here (tenant-salted),
        never taken from the handle: they name the KV decode's G1 serves."""
        return chain_keys(chk.tokens, block_tokens=self.block_tokens, tenant=chk.ctx.tenant,
                          fingerprint=self.engine.fingerprint, secret=self.secret)

    async def _obtain_kv(self, handle: prefill_pb2.KVHandle, chk: _Checked,
                         budget_s: float | None, hold: PrefixHold | None,
                         keys: list[bytes]) -> Callable[[str], None]:
        """A function that makes the sequence live on the engine thread: the
        pulled KV once every piece verified (only the tokens after ``hold``,
        the prefix decode's own G1 holds), else a rebuild (never an error for
        KV that is gone, late or wrong: the request was already accepted)."""
        if chk.stale:
            self._rebuilt("stale_handle")
            self._release_later(handle)
            return await self._rebuild(handle, chk, keys)
        first = 0 if hold is None else hold.tokens(self.block_tokens)
        try:
            pulled = await self.puller.pull(handle, self.shape, budget_s=budget_s,
                                            first=first)
        except KVIntegrityError as exc:
            self.stats.kv_integrity_failures_total += 1
            log.warning("hand-off of %s from %s failed verification (%s); recomputing",
                        chk.ctx.request_id, handle.prefill_address, exc)
            self._rebuilt("integrity")
            self._release_later(handle)
            if hold is not None:
                self.prefixes.release(hold)
            return await self._rebuild(handle, chk, keys)
        except (TimeoutError, grpc.RpcError, ValueError, OSError) as exc:
            gone = (isinstance(exc, grpc.aio.AioRpcError)
                    and exc.code() == grpc.StatusCode.FAILED_PRECONDITION)
            log.info("pull of %s from %s failed (%s); rebuilding", chk.ctx.request_id,
                     handle.prefill_address, exc)
            self._rebuilt("gone" if gone else "pull_failed")
            self._release_later(handle)
            if hold is not None:
                self.prefixes.release(hold)
            t = time.monotonic()
            rebuilt = await self._rebuild(handle, chk, keys)
            self.stats.handoff_seconds["warehouse"].observe(time.monotonic() - t)
            tracing.annotate(path="warehouse")
            return rebuilt
        self._release_later(handle)
        self._source(pulled.path)
        self.stats.pull_bytes_total += pulled.nbytes
        self.stats.pull_seconds_total += pulled.seconds
        self.stats.pull_place_seconds_total += pulled.place_seconds
        self.stats.pulls_to_device_total += pulled.kv.device.type != "cpu"
        self.stats.g1_prefix_tokens_total += first
        self.stats.handoff_seconds[pulled.path].observe(pulled.seconds)
        tracing.annotate(path=pulled.path, bytes=pulled.nbytes, g1_tokens=first)

        # Held only until adopt copied it: the sequence lives on in the KV cache,
        # and the pulled tensor (a /dev/shm mapping) need not live as long.
        held = [pulled.kv]

        def adopt(seq_id: str) -> None:
            self.engine.adopt(seq_id, chk.tokens, held.pop(), handle.first_token, chk.sampling,
                              prefix=hold.blocks if hold is not None else (), block_keys=keys)
            if hold is not None:
                hold.adopted = True
            # Its prompt blocks are G1 hits from now on, not only once it ends: an agent
            # resending the same context a few seconds later (the cc50 replay sends a
            # 5.5k-token context four times within 10 s) pulls only its own tail.
            self.engine.publish(seq_id)

        return adopt

    def _release_later(self, handle: prefill_pb2.KVHandle) -> None:
        task = asyncio.get_running_loop().create_task(self.puller.release(handle))
        self._releases.add(task)                 # keep a reference until it is done
        task.add_done_callback(self._released)

    def _released(self, task: asyncio.Task[None]) -> None:
        """Best effort, but never an unretrieved exception: log what went wrong."""
        self._releases.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.warning("release of a prefill buffer failed: %r", task.exception())

    async def _rebuild(self, handle: prefill_pb2.KVHandle, chk: _Checked,
                       keys: list[bytes]) -> Callable[[str], None]:
        """Restore the stored blocks (``keys``: the prompt's, ``_keys``) from the
        warehouse and recompute the tail."""
        self._source("warehouse")
        restore = await self.restorer.restore(keys, prompt_tokens=len(chk.tokens), g1_blocks=0,
                                              ctx=chk.ctx)

        def rebuild(seq_id: str) -> None:
            # Admitted only: the batcher computes the prompt in chunks between decode
            # steps; the answer continues from the handle's first token, not a resample.
            adm = self.engine.admit(seq_id, chk.tokens, sampling=chk.sampling,
                                    restored=restore.blocks,
                                    max_restore_tokens=restore.usable_tokens,
                                    restored_start_block=0, first_token=handle.first_token,
                                    share_scope=chk.ctx.tenant)
            self.stats.rebuilt_tokens_total += adm.to_compute

        return rebuild

    # -- after a sequence --------------------------------------------------------

    def _canonical_writer(self, ctx: RequestCtx, written: asyncio.Event,
                          prompt_keys: list[bytes], *, prompt_written: bool,
                          reused: list[int] | None = None) -> Callable[[Finished], Any]:
        """The finish hook: compute the canonical blocks, put them (acknowledged
        by the store, so they are in the index), then set ``written``, which the
        final event waits for.

        ``prompt_written``: prefill's write-through carries the prompt blocks
        the warehouse lacked (the handle names where). It runs behind prefill's
        reply and may not have landed yet; putting those blocks again here made
        every answer under load wait for its whole prompt's bytes (up to 10 s
        per answer on the H200, docs/benchmarks-history.md). So only the blocks
        after the prompt are put; a next turn sent at once finds the prompt's
        blocks in the G1 that computed them and the rest in the warehouse
        (service.restore looks past a G1 hit). Without that promise (no
        write-through, or a tail computed here), the leading prompt blocks the
        warehouse lacks are put here too, except those this instance's G1
        supplied (``reused``: tokens, filled at admission): they have a writer
        already, the write-through that brought them or an earlier answer's put."""
        async def write(done: Finished) -> None:
            t0 = time.monotonic()
            try:
                if prompt_written:
                    stored = len(prompt_keys)
                else:
                    stored = await self._stored_prefix(prompt_keys, ctx)
                    if reused:
                        stored = max(stored, reused[0] // self.block_tokens)
                try:
                    first, copy, keys = await self.thread.call(self._canonical,
                                                               done.seq_id, stored, ctx.tenant)
                finally:
                    self.batcher.release_kv(done.seq_id)   # freed: the next one may join
                if copy is None:
                    return
                # The copy to the host runs off the engine thread (the steps go on).
                blocks = await asyncio.to_thread(copy.wait)
                n = int(blocks.shape[0])
                self.stats.canonical_blocks_total += n
                await self.writer.write_now(keys[first:first + n], blocks,
                                            layout=self.engine.layout.name,
                                            token_count=self.block_tokens, ctx=ctx)
            finally:
                self.stats.canonical_seconds_total += time.monotonic() - t0
                written.set()

        return write

    async def _await_canonical(self, written: asyncio.Event, ctx: RequestCtx) -> None:
        """Hold the final event until the canonical blocks are stored: the
        next turn, sent the moment this one ends, must find them in the index."""
        if not self.cfg.canonical_wait_s or not self.store.stats.available:
            return                      # a store that is down cannot serve the next turn
        try:
            await asyncio.wait_for(written.wait(), self.cfg.canonical_wait_s)
        except TimeoutError:
            self.stats.canonical_late_total += 1
            log.warning("canonical blocks of %s not stored within %.1fs; answering anyway",
                        ctx.request_id, self.cfg.canonical_wait_s)

    async def _stored_prefix(self, keys: list[bytes], ctx: RequestCtx) -> int:
        """Leading ``keys`` the warehouse holds; all of them when it does not
        answer (the put that follows would fail too)."""
        if not keys or not self.store.enabled:
            return len(keys)
        res = await self.store.lookup(keys, prompt_tokens=len(keys) * self.block_tokens,
                                      ctx=ctx, touch=False)
        return len(keys) if res is None else res.matched_blocks

    def _canonical(self, seq_id: str, stored: int,
                   tenant: str) -> tuple[int, HostCopy | None, list[bytes]]:
        """Engine thread: the canonical blocks of prompt + output (from block
        ``stored`` on, when the warehouse lacks prompt blocks) gathered on the
        device, their copy to the host started (``HostCopy``: waited for by
        the caller, off this thread), and the chain keys of all its full
        blocks; then free it, keeping those blocks in G1 under them (the
        session's next turn pulls only what follows). The gather is queued on
        this thread's stream before anything that could reuse the blocks."""
        t0 = time.perf_counter()
        keys: list[bytes] | None = None         # None: the prompt's keys (adopt)
        try:
            if not self.store.enabled:
                return 0, None, []
            first, blocks = self.engine.canonical_blocks(seq_id, on_device=True)
            keys = chain_keys(self.engine.seq_tokens(seq_id), block_tokens=self.block_tokens,
                              tenant=tenant, fingerprint=self.engine.fingerprint,
                              secret=self.secret)
            if stored < first:
                # The prompt's blocks arrived from prefill's chunked path: canonical as held.
                head = self.engine.export_blocks(seq_id, stored, first - stored, on_device=True)
                first, blocks = stored, torch.cat([head, blocks.to(head.device)])
            if blocks.shape[0] == 0:
                return first, None, keys
            return first, HostCopy.within(blocks, self._canon_budget), keys
        finally:
            self.engine.free(seq_id, keep_keys=keys)
            self.stats.canonical_engine_seconds_total += time.perf_counter() - t0

    async def _put(self, job: WriteJob) -> PutResult:
        return await self.store.put(job.keys, job.blocks, layout=job.layout,
                                    token_count=job.token_count, ctx=job.ctx)

    def _after_step(self) -> None:
        assert self.experts is not None
        self.experts.add(self.engine.expert_counts())
        self.stats.expert_imbalance = self.experts.current

    def _rebuilt(self, why: str) -> None:
        self.stats.rebuilds_total[why] = self.stats.rebuilds_total.get(why, 0) + 1

    def _source(self, name: str) -> None:
        self.stats.kv_sources_total[name] = self.stats.kv_sources_total.get(name, 0) + 1

    def _count(self, reason: str) -> None:
        self.stats.requests_total[reason] = self.stats.requests_total.get(reason, 0) + 1


def _expert_load(cfg: DecodeConfig, mc: Any) -> ExpertLoad | None:
    if mc.moe is None:
        return None
    n_layers, n_experts = mc.num_layers, mc.moe.n_experts
    auto = cfg.expert_plan == "auto"
    placement = (ExpertPlacement.load(cfg.expert_plan, n_layers, n_experts)
                 if cfg.expert_plan and not auto
                 else ExpertPlacement.contiguous(n_layers, n_experts, cfg.ep_ranks))
    return ExpertLoad(n_layers, n_experts, placement, window_steps=cfg.expert_window_steps,
                      replan_steps=cfg.expert_replan_steps if auto else 0,
                      redundant=cfg.ep_redundant)


# Pulled prompts on the device between their pull and their adopt, outside the
# engine's pool: 2 GiB is 8 llama-8b-shape prompts of 2,048 tokens, plenty at
# DMA speed; past it a pull lands on the host and its adopt uploads it.
_UPLOAD_BYTES = 2 << 30
_CANONICAL_BYTES = 1 << 30


def _upload(engine: Any) -> Upload | None:
    """On CUDA, same-host pulls go straight to the engine's device."""
    device = getattr(engine, "device", None)
    if not isinstance(device, torch.device) or device.type != "cuda":
        return None
    return Upload(device, PinnedChunks(sets=4, pin=True), DeviceBudget(_UPLOAD_BYTES))
