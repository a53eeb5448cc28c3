"""Continuous batching over the engine's ``decode_step``.

One asyncio task drives the engine: each iteration takes the active
sequences, runs one ``decode_step`` for all of them on the engine thread,
and hands each sequence its token with the engine's verdict on stopping
(``finish_reason``) and its text so far (``completion_text``). Sequences join
(``adopt`` or a rebuild) and leave between steps; both run on the same FIFO
engine thread, so a join or a free never interleaves with a step. A
cancelled sequence is out of the active set at once (it is never stepped
again) and freed right after the step in flight, if any.

A rebuild (a prompt whose KV must be computed here: ``make_live`` only
*admits* it, ``Engine.admit``) joins as *building*: the same engine-thread job
that runs a decode step then computes one chunk of at most ``rebuild_chunk``
tokens of each building prompt (``Engine.prefill_step``), so a long prompt
delays the decode of others by one chunk per step, never by the whole
prompt; its first event comes when its prompt is complete.

Admission (decode_svc/kv_gate.py) takes a slot and reserves every KV block
the sequence can grow to before it joins; the reservation goes back when
the engine free of the sequence is submitted (the engine thread is FIFO, so
a sequence admitted after that joins after the free).

Batch invariance (docs/architecture.md#batch-invariance) is the engine's: a
sequence's tokens do not depend on who else is here.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from decode_svc.kv_gate import KVGate
from decode_svc.stopping import TextStream
from service.engine_thread import EngineThread
from service.metrics import Hist
from telemetry import tracing

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class TokenEvent:
    token_ids: tuple[int, ...]
    text: str
    t_s: float                      # seconds since the request arrived
    finished: bool = False
    finish_reason: str = ""
    completion_tokens: int = 0


@dataclass(frozen=True, slots=True)
class Finished:
    """A sequence that ran to its end, still live in the engine until the
    finish hook (the canonical write) frees it."""

    seq_id: str
    completion_tokens: int
    finish_reason: str


FinishHook = Callable[[Finished], Awaitable[None]]
FORWARD_BUCKETS = (0.002, 0.003, 0.004, 0.005, 0.006, 0.007, 0.008, 0.009, 0.010, 0.012,
                   0.014, 0.016, 0.020, 0.025, 0.030, 0.040, 0.060, 0.100, 0.250)
StepHook = Callable[[], None]       # runs on the engine thread right after each step


class _Out(NamedTuple):
    """One sequence after a step, read on the engine thread."""

    token: int
    text: str                       # the completion so far (engine rules)
    reason: str                     # "" while it goes on


@dataclass(slots=True)
class _Parts:
    """Where one step's time went, measured on the engine thread."""

    wait_s: float = 0.0             # from the loop's call until the job started
    wait_jobs_s: float = 0.0        # of it, other engine jobs running (the rest: the hop)
    forward_s: float = 0.0
    sample_s: float = 0.0
    read_s: float = 0.0
    chunk_s: float = 0.0


@dataclass(slots=True)
class _Seq:
    seq_id: str
    prompt_tokens: int
    stream: TextStream
    t0: float
    on_finish: FinishHook | None
    first_shown: bool = False       # its first token's event went out before the KV was here
    events: asyncio.Queue[TokenEvent] = field(default_factory=asyncio.Queue)
    n: int = 0                      # tokens generated so far
    done: bool = False


@dataclass(slots=True)
class BatcherStats:
    active: int = 0
    waiting: int = 0
    building: int = 0               # rebuilds whose prompt is being computed between steps
    tokens_in_flight: int = 0       # prompt + generated tokens of active and building sequences
    rebuild_chunks_total: int = 0   # prompt chunks computed between decode steps
    steps_total: int = 0
    tokens_total: int = 0
    cancelled_total: int = 0
    finished_total: dict[str, int] = field(default_factory=dict)
    queue_seconds: Hist = field(default_factory=Hist)   # waiting for a slot and KV blocks
    # One step as the batch sees it (the loop's call to its tokens' events queued),
    # then its parts, summed over steps (per-step means: divide by steps_total). What
    # is left of step_seconds after the parts is the event loop's and the thread hops'.
    step_seconds: Hist = field(default_factory=Hist)
    step_rows_total: int = 0                # rows stepped (mean batch: / steps_total)
    # The forwards one by one, in ms-wide buckets: a mean can hide that some steps
    # ran beside another process's kernels on a shared GPU (prefill's) and some not.
    forward_seconds: Hist = field(default_factory=lambda: Hist(FORWARD_BUCKETS))
    step_wait_seconds_total: float = 0.0    # queued behind other engine jobs (adopt, free,
    #                                         canonical blocks, restores) and the thread hop
    step_wait_jobs_seconds_total: float = 0.0  # of it, other jobs' run time (the rest: the
    #                                         hop and the GIL, e.g. a busy event loop)
    step_forward_seconds_total: float = 0.0  # the forwards (device time on CUDA)
    step_sample_seconds_total: float = 0.0  # the rest of decode_step: inputs, sampling, copies
    step_read_seconds_total: float = 0.0    # each sequence's text and finish verdict
    step_chunk_seconds_total: float = 0.0   # prompt chunks computed after the step


@dataclass(frozen=True, slots=True)
class KVStats:
    capacity_blocks: int            # what the pool can hand out with no sequence live
    reserved_blocks: int            # promised to admitted sequences (prompt + max_tokens)
    unreserved_blocks: int          # capacity - reserved: what the next sequence may take
    pool_free_blocks: int           # the pool's free + evictable (G1) blocks right now
    waiting: int                    # sequences queued for a slot or blocks
    waits_total: int                # sequences that waited for blocks while a slot was free


class Batcher:
    def __init__(self, engine: Any, thread: EngineThread, *, max_seqs: int,
                 after_step: StepHook | None = None, rebuild_chunk: int = 128,
                 kv_blocks: int | None = None) -> None:
        """``kv_blocks``: the pool's capacity for sequences (default: what it
        can hand out now, read before any sequence of this batcher is live)."""
        if rebuild_chunk < 1:
            raise ValueError(f"rebuild_chunk must be >= 1, got {rebuild_chunk}")
        self._engine = engine
        self._thread = thread
        self.gate = KVGate(slots=max_seqs,
                           blocks=engine.free_blocks if kv_blocks is None else kv_blocks)
        self._held: dict[str, int] = {}     # seq id -> blocks reserved, until its free
        self._after_step = after_step
        self._rebuild_chunk = rebuild_chunk
        self._active: dict[str, _Seq] = {}
        self._building: dict[str, _Seq] = {}
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._finishing: set[asyncio.Task[None]] = set()
        self._waiting = 0
        self.stats = BatcherStats()

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._loop(), name="batcher")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        for seq_id in list(self._active):
            self.cancel(seq_id)
        if self._finishing:
            await asyncio.gather(*self._finishing, return_exceptions=True)

    async def generate(self, seq_id: str, make_live: Callable[[], None], *, prompt_tokens: int,
                       kv_blocks: int, held_blocks: int = 0, stop: tuple[str, ...] = (),
                       on_finish: FinishHook | None = None,
                       t0: float | None = None, stream: TextStream | None = None,
                       first_shown: bool = False) -> AsyncIterator[TokenEvent]:
        """Make the sequence live (``make_live`` runs on the engine thread: an
        ``adopt`` of pulled KV, or a rebuild), then stream its tokens; the first
        event carries the token prefill sampled. Leaving the iterator early
        (client gone) frees the sequence at once. ``on_finish`` gets a
        sequence that ran to its end, still live, and must free it (then
        ``release_kv``; the reservation goes back when it returns otherwise).

        ``kv_blocks``: every block the sequence may hold (``Engine.kv_blocks_for``);
        it waits until a slot and that many unreserved blocks are free, and
        ``KVGate.check`` raises ``NeverFits`` at once when the pool is too small.

        ``first_shown``: the caller already sent the first token's event
        (decode_svc.first_event) through ``stream``; it is then not sent again
        unless it turned out to end the sequence.

        ``held_blocks``: of ``kv_blocks``, those the caller reserved already
        (``KVGate.reserve_now``: its G1 prefix, pinned); this call owns that
        reservation from now on, whatever happens."""
        t0 = time.monotonic() if t0 is None else t0
        self._waiting += 1
        waited = tracing.now()
        try:
            await self.gate.acquire(kv_blocks, held=held_blocks)
        finally:
            self._waiting -= 1
        self._held[seq_id] = kv_blocks
        self.stats.queue_seconds.observe(tracing.now() - waited)
        tracing.record("queue", waited, tracing.now(), stage="decode")
        seq: _Seq | None = None
        try:
            try:
                first = await self._thread.call(self._join, seq_id, make_live)
            except asyncio.CancelledError:
                self._submit_free(seq_id)
                raise
            seq = _Seq(seq_id, prompt_tokens, TextStream(stop) if stream is None else stream,
                       t0, on_finish, first_shown)
            if first is None:                # a rebuild: its prompt goes in chunks
                self._building[seq_id] = seq
                self._wake.set()
            else:
                self._accept(seq, first, shown=first_shown)
                if not seq.done:
                    self._active[seq_id] = seq
                    self._wake.set()
            while True:
                ev = await seq.events.get()
                yield ev
                if ev.finished:
                    return
        finally:
            if seq is None or not seq.done:
                self.cancel(seq_id)
            self.gate.release_slot()

    def cancel(self, seq_id: str) -> None:
        """The client went away: never step it again, free it after the step in flight."""
        seq = self._active.pop(seq_id, None) or self._building.pop(seq_id, None)
        if seq is not None and not seq.done:
            seq.done = True
            self.stats.cancelled_total += 1
        self._submit_free(seq_id)
        self._update_gauges()            # out of the active set now, not after the step

    def kv_stats(self) -> KVStats:
        """For /metrics, read on the scrape thread: plain ints, nothing iterated
        (the pool's free count is len() of its lists, which a step cannot tear)."""
        g = self.gate
        return KVStats(g.capacity, g.reserved, g.unreserved, self._engine.free_blocks,
                       g.waiting, g.waits_for_blocks_total)

    def release_kv(self, seq_id: str) -> None:
        """The sequence's engine free has been submitted (or has run): its
        reserved blocks go to the next sequence. Idempotent."""
        blocks = self._held.pop(seq_id, None)
        if blocks is not None:
            self.gate.release_blocks(blocks)

    def _submit_free(self, seq_id: str) -> None:
        self._thread.submit(self._free_quietly, seq_id)
        self.release_kv(seq_id)          # FIFO: whoever joins next runs after the free

    # -- engine thread ---------------------------------------------------------

    def _read(self, seq_id: str, token: int) -> _Out:
        eng = self._engine
        return _Out(token, eng.completion_text(seq_id), eng.finish_reason(seq_id) or "")

    def _join(self, seq_id: str, make_live: Callable[[], None]) -> _Out | None:
        """None: ``make_live`` admitted a prompt still to compute (a rebuild)."""
        make_live()
        if self._engine.prefill_remaining(seq_id):
            return None
        return self._read(seq_id, self._engine.seq_tokens(seq_id)[-1])

    def _step(self, seq_ids: list[str], building: list[str], t_call: float, busy_call: float
              ) -> tuple[dict[str, _Out], dict[str, _Out] | Exception, _Parts]:
        """One decode step, then one chunk of each building prompt; -> the decode
        outputs, the first tokens of the prompts completed (or the chunk's error),
        and where the time went. ``busy_call``: the engine thread's busy seconds
        at ``t_call``; what they grew by before this job started is other jobs'
        time (a job already running at ``t_call`` counts whole, so at most the wait)."""
        t0 = time.perf_counter()
        wait = t0 - t_call
        parts = _Parts(wait_s=wait,
                       wait_jobs_s=min(wait, max(0.0, self._thread.busy_s - busy_call)))
        outs: dict[str, _Out] = {}
        if seq_ids:
            tokens = self._engine.decode_step(seq_ids)
            t1 = time.perf_counter()
            if self._after_step is not None:
                self._after_step()
            outs = {s: self._read(s, t) for s, t in tokens.items()}
            times = getattr(self._engine, "last_step", None)
            parts.forward_s = times.forward_s if times is not None else t1 - t0
            parts.sample_s = (t1 - t0) - parts.forward_s
            parts.read_s = time.perf_counter() - t1
        if not building:
            return outs, {}, parts
        t2 = time.perf_counter()
        try:
            done = self._engine.prefill_step(dict.fromkeys(building, self._rebuild_chunk))
        except Exception as exc:  # fails the rebuilds only, not the decoding sequences
            for seq_id in building:
                self._free_quietly(seq_id)
            return outs, exc, parts
        finally:
            parts.chunk_s = time.perf_counter() - t2
        self.stats.rebuild_chunks_total += len(building)
        return outs, {d.seq_id: self._read(d.seq_id, d.result.first_token) for d in done}, parts

    def _free_quietly(self, seq_id: str) -> None:
        with contextlib.suppress(Exception):
            self._engine.free(seq_id)

    # -- event loop --------------------------------------------------------------

    def _accept(self, seq: _Seq, out: _Out, *, shown: bool = False) -> None:
        seq.n += 1
        self.stats.tokens_total += 1
        finished = bool(out.reason)
        text = seq.stream.delta(out.text, finished)
        if not shown or finished:
            # An already-shown token that ends the sequence still needs its final event.
            seq.events.put_nowait(TokenEvent(() if shown else (out.token,), text,
                                             time.monotonic() - seq.t0, finished, out.reason,
                                             seq.n))
        if finished:
            seq.done = True
            self._active.pop(seq.seq_id, None)
            self.stats.finished_total[out.reason] = self.stats.finished_total.get(out.reason,
                                                                                  0) + 1
            self._finish(seq, out.reason)

    def _finish(self, seq: _Seq, reason: str) -> None:
        if seq.on_finish is None:
            self._submit_free(seq.seq_id)
            return
        done = Finished(seq.seq_id, seq.n, reason)
        task = asyncio.get_running_loop().create_task(self._run_finish(seq.on_finish, done))
        self._finishing.add(task)
        task.add_done_callback(self._finishing.discard)

    async def _run_finish(self, hook: FinishHook, done: Finished) -> None:
        try:
            await hook(done)
        except Exception:  # a failed cache write never fails the request
            log.exception("finish hook of %s failed", done.seq_id)
            self._submit_free(done.seq_id)
        finally:
            if done.seq_id in self._held:  # the hook did not say it freed it (cancelled)
                self._submit_free(done.seq_id)

    async def _loop(self) -> None:
        while True:
            if not self._active and not self._building:
                self._wake.clear()
                await self._wake.wait()
                continue
            ids, building = list(self._active), list(self._building)
            self._update_gauges()
            t_call = time.perf_counter()
            try:
                outs, firsts, parts = await self._thread.call(self._step, ids, building, t_call,
                                                              self._thread.busy_s)
            except Exception:  # fail the batch's sequences, keep serving
                log.exception("decode step failed for %d sequences", len(ids))
                self._fail(ids)
                continue
            for seq_id in ids:
                seq = self._active.get(seq_id)
                if seq is None or seq.done:
                    continue           # cancelled while the step ran
                self._accept(seq, outs[seq_id])
            if isinstance(firsts, Exception):
                log.error("rebuild chunk failed for %d prompts: %r", len(building), firsts)
                self._fail(building)
                firsts = {}
            for seq_id, out in firsts.items():
                seq = self._building.pop(seq_id, None)
                if seq is None or seq.done:
                    continue           # cancelled while the chunk ran: freed after it
                self._accept(seq, out, shown=seq.first_shown)
                if not seq.done:
                    self._active[seq_id] = seq
            if ids:                    # the step through its tokens' events
                self._account(len(ids), time.perf_counter() - t_call, parts)
            else:                      # chunks alone (a tail computed with nothing decoding)
                self.stats.step_chunk_seconds_total += parts.chunk_s
            self._update_gauges()

    def _account(self, rows: int, step_s: float, p: _Parts) -> None:
        st = self.stats
        st.steps_total += 1
        st.step_rows_total += rows
        st.step_seconds.observe(step_s)
        st.step_wait_seconds_total += p.wait_s
        st.step_wait_jobs_seconds_total += p.wait_jobs_s
        st.step_forward_seconds_total += p.forward_s
        st.forward_seconds.observe(p.forward_s)
        st.step_sample_seconds_total += p.sample_s
        st.step_read_seconds_total += p.read_s
        st.step_chunk_seconds_total += p.chunk_s
        if log.isEnabledFor(logging.DEBUG):
            log.debug("step of %d rows: %.2f ms (wait %.2f, forward %.2f, sample %.2f, "
                      "read %.2f, chunk %.2f)", rows, step_s * 1e3, p.wait_s * 1e3,
                      p.forward_s * 1e3, p.sample_s * 1e3, p.read_s * 1e3, p.chunk_s * 1e3)

    def _fail(self, seq_ids: list[str]) -> None:
        for seq_id in seq_ids:
            seq = self._active.get(seq_id) or self._building.get(seq_id)
            if seq is not None:
                seq.events.put_nowait(TokenEvent((), "", time.monotonic() - seq.t0,
                                                 True, "error", seq.n))
                self.cancel(seq_id)

    def _update_gauges(self) -> None:
        self.stats.active = len(self._active)
        self.stats.building = len(self._building)
        self.stats.waiting = self._waiting
        self.stats.tokens_in_flight = sum(s.prompt_tokens + s.n for s in (
            *self._active.values(), *self._building.values()))
