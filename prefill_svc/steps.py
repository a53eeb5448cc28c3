"""The prefill service's step loop: requests in, batched engine steps out.

One asyncio task drives the engine (vLLM v1's shape): each iteration asks the
scheduler (prefill_svc/scheduler.py) for a plan and runs it as ONE job on the
engine thread — free the prompts whose callers left, admit new ones
(``Engine.admit`` with their G1 hit and restored blocks), compute one step of
every planned prompt (``Engine.prefill_step``: one forward with invariant
kernels), tell the waiting handlers their first tokens at once, then export
the finished prompts' new blocks for the warehouse and publish their full
blocks in G1. A request's warehouse lookup and fetch run while it waits, so
a queued turn does not pay its restore after it is scheduled.

A finished prompt stays **resident**: its sequence is kept live, not copied
out, because decode usually holds most of a returning session already and
pulls only the tail (``PullKVRequest.start_token``). Its first pull claims
it and copies out just those tokens on a worker thread (``materialize``: a
pull never waits behind a step in flight, which on a 2-core CPU host is
seconds), then the engine thread frees it. One not pulled within ``resident_s`` is **demoted** at
the start of the next step job: copied out whole to the host buffer and
freed, as every prompt was before. Whenever the plan cannot admit a ready
request for want of blocks, or an admission finds the pool short, every
resident is demoted first: residents never starve admissions.

A finished prompt's new blocks for the warehouse are only gathered on the
engine thread; their copy to the host runs on a worker thread
(``engine.staging.HostCopy``, as decode's answer-end export): the copy and
its pinned allocation, made on the engine thread, kept every waiting request
out of the engine and the GPU idle meanwhile.

Nothing admitted fails for want of room: a prompt the pool cannot hold yet
waits until running ones finish. Every future a handler awaits is resolved
exactly once or cancelled by its handler (service/aio.py), so no exception
is left unretrieved.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import threading
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

import torch

from common.config import PrefillSection
from engine import EngineInputError, PoolExhaustedError, PrefillResult
from engine.staging import DeviceBudget, HostCopy, PinnedChunks
from kvstore.types import RequestCtx
from prefill_svc.scheduler import Entry, Scheduler, StepPlan
from service.aio import background, settle
from service.engine_thread import EngineThread
from service.errors import Busy, InvalidRequest, UpstreamUnavailable
from service.kv_buffer import HostAlloc, Resident
from service.restore import Restore

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Sampled:
    result: PrefillResult
    queue_s: float                  # submission to admission into the engine


# Device gathers of new blocks that may wait at once for their copy to the host
# (outside the engine's capped pool); past it the copy is made on the engine thread.
_WRITE_DEVICE_BYTES = 2 * 2**30


@dataclass(frozen=True, slots=True)
class Computed:
    resident: bool                  # its sequence is held for decode's pull; False: caller gone
    new_blocks: HostCopy | None     # [n, layers, 2, kv_heads, B, head_dim], blocks write_from..,
                                    # on their way to the host (``wait`` off the engine thread)


@dataclass(slots=True, eq=False)
class Job:
    """One Prefill request inside the service."""

    ctx: RequestCtx
    tokens: list[int]
    sampling: Any                   # engine.SamplingParams
    keys: list[bytes]               # chain keys of the prompt's full blocks
    g1_keys: list[bytes] | None     # keys matched against / published into G1 (None: off)
    write_from: int                 # first block to write through (set once restored)
    first: asyncio.Future[Sampled]
    buffered: asyncio.Future[None]  # resolved once its KV has a buffer entry (or never will have)
    t_submit: float = field(default_factory=time.perf_counter)
    restore: Restore | None = None
    warming: asyncio.Task[None] | None = None   # its lookup and fetch, while it waits
    warm: Callable[[int], Coroutine[Any, Any, Restore]] | None = None  # given G1 blocks held
    planned_reuse: int = 0          # prompt tokens its restore plan reuses (G1 + fetched)
    queue_s: float = 0.0
    kv_seed: int = 0                # keys the hand-off checksums (service.kv_buffer)
    resident: Resident | None = None    # its buffer entry while the engine holds its KV


@dataclass(slots=True)
class _Held:
    """A finished prompt whose sequence the engine keeps for decode's pull."""

    job: Job
    since: float                    # monotonic: when its prompt finished


@dataclass(slots=True)
class _Outcome:
    """What one engine-thread step did, applied on the loop afterwards."""

    admitted: dict[str, int] = field(default_factory=dict)      # id -> tokens left after admit
    admitted_at: dict[str, float] = field(default_factory=dict)  # id -> monotonic, at admission
    deferred: list[Entry] = field(default_factory=list)         # pool full at admission
    failed: list[tuple[Entry, BaseException]] = field(default_factory=list)
    stopped: list[Entry] = field(default_factory=list)          # freed: caller gone
    remaining: dict[str, int] = field(default_factory=dict)     # id -> tokens left after step
    done: list[tuple[Entry, Computed | BaseException]] = field(default_factory=list)
    tokens: int = 0
    seconds: float = 0.0


Ready = Callable[[Job, Computed], None]     # a finished prompt: register its entry, write through
Demoted = Callable[[Job, torch.Tensor | BaseException], None]     # its whole KV, on the host


class StepLoop:
    def __init__(self, engine: Any, thread: EngineThread, cfg: PrefillSection, stats: Any, *,
                 tokens_per_s: float, on_computed: Ready, on_demoted: Demoted,
                 observe: Callable[[int, float], float]) -> None:
        self._engine = engine
        self._thread = thread
        self.sched = Scheduler(cfg, tokens_per_s)
        self._stats = stats
        self._on_computed = on_computed
        self._on_demoted = on_demoted   # called on the loop, in order with the engine's jobs
        self._resident_s = cfg.resident_s
        # Written on the engine thread only (the loop reads its size).
        self._held: dict[str, _Held] = {}
        # A pull claims a resident from the event loop while the engine thread
        # demotes or frees residents: whoever takes it first owns it.
        self._held_lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closed = False
        self._observe = observe         # (tokens, seconds) of a step -> measured tokens/s
        self._block_tokens: int = engine.layout.block_tokens
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._warming: set[asyncio.Task[Any]] = set()
        self._pool_seen: tuple[int, int, int] = (-1, -1, -1)   # G1 when waiting ones were sized
        self.jobs: dict[str, Job] = {}      # request id -> job, until its KV is buffered
        # The copy-outs' pinned chunks (CUDA): a few copies at once run at DMA
        # speed, more would only share the link.
        on_cuda = getattr(getattr(engine, "device", None), "type", "cpu") == "cuda"
        self._chunks = PinnedChunks(sets=4, pin=True) if on_cuda else None
        self._write_budget = DeviceBudget(_WRITE_DEVICE_BYTES)
        # Set while a step that completes prompts runs, on a CPU engine (see
        # yield_to_finishing); the device copies by DMA beside its compute.
        self._copy_yield_s = 0.0 if on_cuda else cfg.copy_yield_s
        self._finishing: asyncio.Future[None] | None = None

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._task = self._loop.create_task(self._drive(), name="prefill-steps")

    async def close(self) -> None:
        self._closed = True
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        for t in list(self._warming):
            t.cancel()
        gone = UpstreamUnavailable("the prefill service is shutting down")
        for e in [*self.sched.waiting.values(), *self.sched.running.values()]:
            self._fail(e, gone)
        await self._thread.call(self._free_held)

    # -- requests (event loop) ------------------------------------------------------

    def check_count(self) -> None:
        """Refuse before any work when the waiting queue is full."""
        if (busy := self.sched.check_count()) is not None:
            self._stats.refused_total += 1
            raise Busy(busy.reason, busy.retry_after_ms)

    def submit(self, job: Job, *, g1_blocks: int,
               warm: Callable[[int], Coroutine[Any, Any, Restore]]) -> Entry:
        """Queue ``job`` (``g1_blocks``: its G1 hit as far as known now) and start
        ``warm(g1_blocks)`` (its warehouse lookup and fetch) while it waits."""
        cached_tokens = self._engine.hit_rule.usable_tokens(g1_blocks * self._block_tokens,
                                                            len(job.tokens))
        job.warm = warm
        coro = warm(g1_blocks)
        L, B = len(job.tokens), self._block_tokens
        need, pool = -(-L // B), self._engine.blocks.num_blocks
        if need > pool:
            coro.close()
            raise InvalidRequest(f"a prompt of {L} tokens needs {need} KV blocks; this "
                                 f"instance's pool has {pool}")
        if (busy := self.sched.check_tokens(L - cached_tokens)) is not None:
            coro.close()
            self._stats.refused_total += 1
            raise Busy(busy.reason, busy.retry_after_ms)
        rid = job.ctx.request_id
        if rid in self.jobs:
            coro.close()
            raise EngineInputError(f"request id {rid!r} is already being prefilled")
        e = Entry(rid, L, time.monotonic(), max(1, L - cached_tokens), -(-L // B), job,
                  keys=tuple(job.keys), block_tokens=B)
        self.sched.add(e)
        self.jobs[rid] = job
        job.warming = background(self._warm(e, coro), self._warming, f"warm-{rid}")
        self._gauges()
        return e

    def cancel(self, e: Entry) -> None:
        """The caller went away: out of the queue now, or freed before the next step."""
        e.cancelled = True
        job: Job = e.payload
        job.first.cancel()
        if not e.running:
            self.sched.drop(e)
            if job.warming is not None:
                job.warming.cancel()
            self._release(job)
        self._stats.cancelled_total += 1
        self._wake.set()
        self._gauges()

    async def _warm(self, e: Entry, warm: Coroutine[Any, Any, Restore]) -> None:
        job: Job = e.payload
        try:
            restore = await warm
        except Exception as exc:
            if not e.cancelled:
                self.sched.drop(e)
                self._fail(e, exc)
            return
        if e.cancelled:
            return
        job.restore = restore
        B = self._block_tokens
        job.planned_reuse = min(restore.usable_tokens,
                                (restore.start_block + restore.n_blocks) * B)
        self.sched.mark_ready(e, len(job.tokens) - job.planned_reuse,
                              -(-len(job.tokens) // B) - restore.start_block)
        e.charge(time.monotonic(), "engine")    # its lookup and fetch were its wait so far
        self._pool_seen = (-1, -1, -1)      # size it against G1 as it is now
        self._gauges()
        self._wake.set()

    # -- the loop ------------------------------------------------------------------------

    def _refresh_waiting(self) -> None:
        """Size every ready request against G1 as it is now, whenever G1 changed.

        - G1 grew (a prompt sharing its prefix finished while it waited): it
          needs only its new blocks and has only its tail to compute. Sized as
          planned on arrival, a resent agent context claimed its whole length,
          did not fit beside the others, and stopped admissions for everything
          queued behind it, one resend per step.
        - G1 lost blocks its restore plan starts after (another prompt's room
          evicted them): that plan would recompute the whole prompt from the
          first gap, since fetched blocks only follow a complete G1 run. It is
          looked up and fetched again from what G1 holds now (the warehouse has
          the evicted blocks; two long sessions alternating in a G1 that holds
          one of them were each recomputed cold, 27 s apiece)."""
        pool = self._engine.blocks
        seen = (pool.cached_total, pool.evicted_total, pool.num_free)
        if seen == self._pool_seen:
            return
        self._pool_seen = seen
        for e in self.sched.waiting.values():
            job: Job = e.payload
            r = job.restore
            if not e.ready or e.cancelled or r is None:
                continue
            L = len(job.tokens)
            g1 = self._engine.g1_admission(job.g1_keys or (), L)
            if g1.held_blocks < r.start_block and job.warm is not None:
                self.sched.unready(e)
                e.charge(time.monotonic(), "warm")
                job.restore = None
                self._stats.rewarmed_total += 1
                job.warming = background(self._warm(e, job.warm(g1.held_blocks)),
                                         self._warming, f"rewarm-{e.request_id}")
                continue
            reuse = max(g1.usable_tokens,
                        job.planned_reuse if g1.held_blocks >= r.start_block else 0)
            self.sched.mark_ready(e, L - reuse, g1.fresh_blocks, g1.idle_blocks)

    async def _drive(self) -> None:
        while True:
            self._refresh_waiting()
            plan = (self.sched.plan(self._engine.free_blocks, time.monotonic())
                    if self.sched.has_work else None)
            if plan is not None:
                self._account(plan)
            if plan is not None and plan.starved and self._held:
                # Residents hold blocks a ready request needs: out to the host, plan again.
                await self._thread.call(self._demote_all)
                continue
            if plan is None or not (plan.budgets or plan.stop):
                self._wake.clear()
                await self._wake.wait()
                continue
            entries = {e.request_id: e for e in (*plan.admit, *self.sched.running.values())}
            loop = asyncio.get_running_loop()
            if self._copy_yield_s > 0 and any(b >= entries[rid].remaining
                                              for rid, b in plan.budgets.items()):
                self._finishing = loop.create_future()
            try:
                out = await self._thread.call(self._step, plan, entries, loop)
            finally:
                if self._finishing is not None:
                    self._finishing.set_result(None)
                    self._finishing = None
            self._apply(out, entries)

    @property
    def finishing(self) -> bool:
        """A step that completes prompts is in flight (and copies wait for it)."""
        return self._finishing is not None

    async def yield_to_finishing(self) -> None:
        """Wait (at most ``copy_yield_s``) for the step in flight to end when it
        completes prompts, i.e. sends first tokens.

        A finished prompt's bulk copies (decode's pull, the write-through) move
        its whole KV several times over: a 5.5k-token context is 256 MB per pass,
        copied out, written to the hand-off file, checksummed, read and placed by
        decode, sent to the warehouse. On a CPU they share the cores and the
        memory bandwidth with the step, and the step that usually follows a
        long prompt is its resends' tails: two 64-token tails over its 5.5k
        keys took 1.3-1.4 s beside those copies against 0.55-0.65 s alone.
        Only a step that sends first tokens is waited for, and only the one in
        flight, so a stream of long prompts' middle steps never holds a pull."""
        await asyncio.sleep(0)          # the loop may be starting that step now
        fut = self._finishing
        if fut is None:
            return
        t0 = time.perf_counter()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.shield(fut), self._copy_yield_s)
        self._stats.copy_yield_seconds_total += time.perf_counter() - t0

    def _account(self, plan: StepPlan) -> None:
        """Each waiting request's time so far to its reason; the plan's from now."""
        now, admit = time.monotonic(), {e.request_id for e in plan.admit}
        for e in self.sched.waiting.values():
            if e.ready and not e.cancelled:
                rid = e.request_id
                e.charge(now, "engine" if rid in admit else plan.blocked.get(rid, "engine"))

    def _apply(self, out: _Outcome, entries: dict[str, Entry]) -> None:
        s = self.sched
        for e in out.stopped:
            s.drop(e)
            self._stats.stopped_total += 1
            self._release(e.payload)
        for e, exc in out.failed:
            s.drop(e)
            self._fail(e, exc)
        split = self._stats.queue_split_seconds_total
        for rid, left in out.admitted.items():
            e = entries[rid]
            e.charge(out.admitted_at[rid], "")
            for why, secs in e.waits.items():
                split[why] = split.get(why, 0.0) + secs
            s.admitted(e, left)
            self._stats.admitted_total += 1
            self._stats.queue_wait_s_total += e.payload.queue_s
        for e in out.deferred:
            e.charge(time.monotonic(), "pool")

            if not s.running and not out.admitted:
                s.drop(e)   # the whole pool is free and still too small: it never fits
                self._fail(e, InvalidRequest(f"request {e.request_id!r} does not fit in this "
                                             "instance's KV pool"))
        for rid, left in out.remaining.items():
            s.progressed(entries[rid], left)
        for e, res in out.done:
            s.drop(e)
            if isinstance(res, Computed):
                if res.resident:
                    try:
                        self._on_computed(e.payload, res)
                    except Exception as exc:  # the handle is out: its pull reports the loss
                        log.warning("KV of prefilled request %s not buffered: %s",
                                    e.request_id, exc)
                        self.release_held(e.payload)
            else:
                log.warning("KV of prefilled request %s not copied out: %s", e.request_id, res)
            self._release(e.payload)
        if out.tokens:
            log.debug("step: %d prompts, %d tokens in %.3fs; %d admitted, %d done, %d waiting",
                      len(out.remaining), out.tokens, out.seconds, len(out.admitted),
                      len(out.done), s.queue)
            self._stats.steps_total += 1
            self._stats.step_tokens_total += out.tokens
            self._stats.step_seconds_total += out.seconds
            s.tokens_per_s = self._observe(out.tokens, out.seconds)
        self._gauges()

    # -- the engine thread -----------------------------------------------------------------

    def _step(self, plan: StepPlan, entries: dict[str, Entry],
              loop: asyncio.AbstractEventLoop) -> _Outcome:
        eng, out = self._engine, _Outcome()
        self._demote_aged()
        for e in plan.stop:
            self._free(e.request_id)
            out.stopped.append(e)
        for e in plan.admit:
            if e.cancelled:
                continue
            try:
                adm = self._admit(e)
            except PoolExhaustedError:
                out.deferred.append(e)
                continue
            except Exception as exc:
                out.failed.append((e, exc))
                continue
            e.payload.queue_s = time.perf_counter() - e.payload.t_submit
            out.admitted_at[e.request_id] = time.monotonic()
            out.admitted[e.request_id] = adm.to_compute
        live: dict[str, int] = {}
        for rid, budget in plan.budgets.items():
            e = entries[rid]
            if not (e.running or rid in out.admitted):
                continue                     # its admission was deferred or failed
            if e.cancelled:
                self._free(rid)
                out.stopped.append(e)
            else:
                live[rid] = budget
        before = {rid: eng.prefill_remaining(rid) for rid in live}
        t0 = time.perf_counter()
        try:
            done = eng.prefill_step(live)
        except Exception as exc:
            log.exception("prefill step of %d prompts failed", len(live))
            for rid in live:
                self._free(rid)
                out.failed.append((entries[rid], exc))
            return out
        out.seconds = time.perf_counter() - t0
        self._stats.chunks_total += len(live)
        for d in done:
            job = entries[d.seq_id].payload
            loop.call_soon_threadsafe(self._sampled, job, Sampled(d.result, job.queue_s))
        finished = {d.seq_id for d in done}
        for rid in live:
            out.remaining[rid] = 0 if rid in finished else eng.prefill_remaining(rid)
            out.tokens += before[rid] - out.remaining[rid]
        for d in done:
            out.done.append((entries[d.seq_id], self._finish(entries[d.seq_id])))
        return out

    def _admit(self, e: Entry) -> Any:
        """Admit ``e``; a resident of the same id (a resend) and, when the pool
        is short, every resident go to the host first."""
        job: Job = e.payload
        r = job.restore
        assert r is not None, "only warmed requests are admitted"
        if e.request_id in self._held:
            self._demote(e.request_id)
        admit = functools.partial(self._engine.admit, e.request_id, job.tokens,
                                  sampling=job.sampling, block_keys=job.g1_keys,
                                  restored=r.blocks, max_restore_tokens=r.usable_tokens,
                                  restored_start_block=r.start_block,
                                  share_scope=job.ctx.tenant)
        try:
            return admit()
        except PoolExhaustedError:
            if not self._held:
                raise
        self._demote_all()
        return admit()

    def _finish(self, e: Entry) -> Computed | BaseException:
        """A finished prompt: its new blocks for the warehouse, its full blocks
        into G1 now (a resend admitted before decode pulls finds them), its
        sequence kept for decode's pull (freed at once if its caller left)."""
        eng, job = self._engine, e.payload
        rid, L, B = e.request_id, len(job.tokens), self._block_tokens
        t0 = time.perf_counter()
        try:
            n_full = L // B
            new = (self._export_new(rid, job.write_from, n_full - job.write_from)
                   if n_full > job.write_from else None)
            if not e.cancelled:
                eng.publish(rid, job.g1_keys)
        except Exception as exc:
            self._free(rid, job.g1_keys)
            return exc
        finally:
            self._stats.finish_seconds_total += time.perf_counter() - t0
        if e.cancelled:
            self._free(rid, job.g1_keys)
            return Computed(False, new)
        # Held only to be copied out of the pool: its mirror (1.5x its prompt's KV,
        # outside the pool) would stay allocated for every resident prompt at once.
        eng.release_mirror(rid)
        self._hold(rid, _Held(job, time.monotonic()))
        return Computed(True, new)

    def _export_new(self, rid: str, first: int, n: int) -> HostCopy:
        """Blocks [first, first + n) of ``rid`` gathered on the device, queued on
        this thread's stream before anything that could reuse them, and their
        copy to the host started; past the device budget copied here as before."""
        blocks = self._engine.export_blocks(rid, first, n, on_device=True)
        return HostCopy.within(blocks, self._write_budget)

    # -- residents (engine thread, but for the two entry points) -----------------------

    @property
    def resident_ids(self) -> list[str]:
        """Finished prompts the engine holds for their pull (a copy: read anywhere)."""
        with self._held_lock:
            return list(self._held)

    async def materialize(self, job: Job, start: int, alloc: HostAlloc | None = None,
                          on_device: bool = False) -> torch.Tensor | None:
        """Decode's first pull: tokens [start, L) of ``job``'s resident prompt to
        the host (into a tensor from ``alloc``: the buffer's hand-off file), or
        with ``on_device`` to one contiguous device tensor (a same-GPU pull; the
        host when the device is full), then it is freed. None when it is no
        longer resident (it was demoted: its whole KV reached ``on_demoted`` first).

        The copy runs on a worker thread, not behind the engine thread's step in
        flight: the claimed sequence is finished and still live, so no step
        writes or reuses its blocks until the free that follows the copy."""
        rid = job.ctx.request_id
        await self.yield_to_finishing()
        if self._take(rid, job) is None:
            return None
        try:
            t0 = time.perf_counter()
            kv = await asyncio.to_thread(self._copy_out, rid, start, len(job.tokens), alloc,
                                         on_device)
            self._stats.handoff_copy_seconds_total += time.perf_counter() - t0
        finally:
            self._thread.submit(self._free, rid, job.g1_keys)
        self._stats.handoff_materialized_total += 1
        self._stats.handoff_bytes_total += kv.numel() * kv.element_size()
        return kv

    def _copy_out(self, rid: str, start: int, end: int,
                  alloc: HostAlloc | None, on_device: bool = False) -> torch.Tensor:
        """One copy of the tokens into ``alloc``'s tensor: on CUDA by DMA through
        pinned chunks on a side stream (not behind the step in flight on the
        default stream; run 7 copied to fresh pageable memory, then wrote it).
        ``on_device``: a device gather on a side stream instead (no host at all)."""
        if on_device and self._chunks is not None:
            try:
                return self._engine.export_tokens(rid, start, end, on_device=True)
            except torch.OutOfMemoryError:
                log.warning("no device memory for a same-GPU hand-off of %s; via the host",
                            rid)
        if alloc is None or self._chunks is None:
            # The CPU keeps its plain copy (the file is written at the pull): on the
            # cc50 replay (2 cores) a copy-out into the mapped file took 1.87 s, a
            # plain one 1.18 s, with the prefill step competing for the same cores.
            return self._engine.export_tokens(rid, start, end)
        L, _, H, _, D = self._engine.layout.block_shape
        out = alloc((L, 2, H, end - start, D), self._engine.dtype)
        return self._engine.export_tokens(rid, start, end, out=out, chunks=self._chunks)

    def release_held(self, job: Job) -> None:
        """Its entry went unread (released, dropped, replaced): free the sequence.
        Never raises (a buffer drop calls it)."""
        if not self._closed:
            with contextlib.suppress(RuntimeError):     # the thread already shut down
                self._thread.submit(self._unhold, job)

    def _unhold(self, job: Job) -> None:
        rid = job.ctx.request_id
        if self._take(rid, job) is not None:
            self._free(rid, job.g1_keys)

    def _demote_aged(self) -> None:
        now = time.monotonic()
        with self._held_lock:
            aged = [rid for rid, h in self._held.items() if now - h.since >= self._resident_s]
        for rid in aged:
            self._demote(rid)

    def _demote_all(self) -> None:
        for rid in self.resident_ids:
            self._demote(rid)

    def _demote(self, rid: str) -> None:
        """The whole prompt to the host buffer (the hand-off before residents), then free it."""
        held = self._take(rid)
        if held is None:                # a pull claimed it meanwhile
            return
        job = held.job
        result: torch.Tensor | BaseException
        t0 = time.perf_counter()
        try:
            result = self._engine.export_tokens(rid, 0, len(job.tokens))
        except Exception as exc:
            result = exc
        finally:
            self._free(rid, job.g1_keys)
            # On the engine thread: no step runs meanwhile.
            self._stats.demote_seconds_total += time.perf_counter() - t0
        if isinstance(result, torch.Tensor):
            self._stats.handoff_demoted_total += 1
            self._stats.handoff_bytes_total += result.numel() * result.element_size()
        # Queued on the loop now, so it lands before any later engine job's result.
        assert self._loop is not None
        self._loop.call_soon_threadsafe(self._on_demoted, job, result)

    def _free_held(self) -> None:
        """Shutdown: every resident freed unread."""
        for rid in self.resident_ids:
            if (held := self._take(rid)) is not None:
                self._free(rid, held.job.g1_keys)

    def _hold(self, rid: str, held: _Held) -> None:
        with self._held_lock:
            self._held[rid] = held
            self._stats.resident = len(self._held)

    def _take(self, rid: str, job: Job | None = None) -> _Held | None:
        """Claim a resident (of ``job`` when given); None when it is not held."""
        with self._held_lock:
            held = self._held.get(rid)
            if held is None or (job is not None and held.job is not job):
                return None
            del self._held[rid]
            self._stats.resident = len(self._held)
            return held

    def _free(self, rid: str, keep: list[bytes] | None = None) -> None:
        with contextlib.suppress(EngineInputError):
            self._engine.free(rid, keep_keys=keep)

    # -- futures (event loop) -----------------------------------------------------------------

    def _sampled(self, job: Job, s: Sampled) -> None:
        settle(job.first, s)

    def _fail(self, e: Entry, exc: BaseException) -> None:
        job: Job = e.payload
        settle(job.first, exc=exc)
        self._release(job)

    def _release(self, job: Job) -> None:
        settle(job.buffered, None)
        self.jobs.pop(job.ctx.request_id, None)

    def _gauges(self) -> None:
        st, s = self._stats, self.sched
        st.queue_waiting, st.running = s.queue, len(s.running)
        st.in_flight_tokens = s.tokens_in_flight
