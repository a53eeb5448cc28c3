"""Asynchronous durable writes (G2 -> G3/G4) and their bookkeeping.

A put returns once its blocks are in G2 (``ack = "g2"``) or once they are
durable (``ack = "durable"``: the job's ``acked`` future, resolved after the
G3 fsync and its index bit); ``WriteBack`` writes them to the lower tiers in
worker tasks and adds each tier's index bit only after that tier's write has
returned (so an entry never names a torn block).

Invariants shared with the sweeper (kvstore.maintenance):
- a key with a queued or running write is *pending*; the sweeper never
  deletes a pending key's files;
- a key the sweeper is deleting is *sweeping*; a write of that key waits for
  the deletion to finish, so neither undoes the other. Both checks run on the
  event-loop thread without awaiting in between, which makes them atomic.
- queued bytes are bounded (``max_pending_bytes``): puts wait when disks lag.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

from kvstore.blockfile import BlockMeta
from kvstore.index import BlockIndex, IndexRecord
from kvstore.metrics import StoreMetrics
from kvstore.tiers import Tier

log = logging.getLogger(__name__)

WRITE_BATCH = 64                          # durable writes handed to a tier at once
FAILURE_LOG_INTERVAL_S = 60.0


@dataclass(slots=True)
class WriteJob:
    key: bytes
    payload: memoryview
    meta: BlockMeta
    tiers: tuple[str, ...]
    # A durable-ack put waits on this: True once ``ack_tier`` stored the block (fsynced)
    # and its index bit is set, False if that write failed or was refused.
    acked: asyncio.Future[bool] | None = None
    ack_tier: str = ""


class WriteBack:
    def __init__(self, tiers: dict[str, Tier], index: BlockIndex, metrics: StoreMetrics, *,
                 max_pending_bytes: int) -> None:
        self.tiers = tiers
        self.index = index
        self.metrics = metrics
        self.max_pending_bytes = max_pending_bytes
        self._pending: dict[bytes, int] = {}
        self._pending_bytes = 0
        self._space = asyncio.Condition()
        self._queue: asyncio.Queue[WriteJob] = asyncio.Queue()
        self._sweeping: dict[bytes, asyncio.Event] = {}
        self._tasks: list[asyncio.Task[None]] = []
        self.failed_batches = 0
        self._failure_logged_at = -math.inf

    def start(self, workers: int) -> None:
        self._tasks = [asyncio.create_task(self._worker(), name=f"kv-writer-{i}")
                       for i in range(workers)]

    async def flush(self) -> None:
        """Wait until every queued write has landed and been indexed."""
        await self._queue.join()

    async def stop(self, timeout_s: float = 60.0) -> None:
        if self._tasks:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.flush(), timeout=timeout_s)
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks = []
        while not self._queue.empty():          # never leave a durable put waiting
            _resolve(self._queue.get_nowait(), False)

    def is_pending(self, key: bytes) -> bool:
        return key in self._pending

    async def enqueue(self, job: WriteJob) -> None:
        n = job.payload.nbytes
        async with self._space:
            # An oversized job still goes through alone rather than waiting forever.
            limit = self.max_pending_bytes
            await self._space.wait_for(
                lambda: self._pending_bytes == 0 or self._pending_bytes + n <= limit)
            self._pending_bytes += n
        self._pending[job.key] = self._pending.get(job.key, 0) + 1
        self._queue.put_nowait(job)

    # -- the sweeper's side of the handshake -------------------------------------------------
    def begin_sweeping(self, keys: Sequence[bytes]) -> list[bytes]:
        """Claim keys for deletion: returns those not being written."""
        claimed = [k for k in keys if k not in self._pending and k not in self._sweeping]
        for k in claimed:
            self._sweeping[k] = asyncio.Event()
        return claimed

    def end_sweeping(self, keys: Sequence[bytes]) -> None:
        for k in keys:
            ev = self._sweeping.pop(k, None)
            if ev is not None:
                ev.set()

    # -- workers -----------------------------------------------------------------------------
    async def _worker(self) -> None:
        while True:
            jobs = [await self._queue.get()]
            # Drain what is queued: one batch per tier lets the tier group-commit
            # (``put_many``) and the index take one round trip for all of it.
            while len(jobs) < WRITE_BATCH and not self._queue.empty():
                jobs.append(self._queue.get_nowait())
            try:
                await self._write(jobs)
            except Exception:  # one failed batch must not stop the writer
                self.failed_batches += 1
                now = time.monotonic()
                if now - self._failure_logged_at >= FAILURE_LOG_INTERVAL_S:
                    # One traceback per interval: a broken disk must not flood the log.
                    self._failure_logged_at = now
                    log.exception("durable write of %d blocks failed (%d failed batches so "
                                  "far; the next traceback in %.0f s at the earliest)",
                                  len(jobs), self.failed_batches, FAILURE_LOG_INTERVAL_S)
            finally:
                for job in jobs:
                    _resolve(job, False)    # no-op where the write already answered
                    left = self._pending.get(job.key, 1) - 1
                    if left:
                        self._pending[job.key] = left
                    else:
                        self._pending.pop(job.key, None)
                    self._queue.task_done()
                async with self._space:
                    self._pending_bytes -= sum(j.payload.nbytes for j in jobs)
                    self._space.notify_all()

    async def _write(self, jobs: list[WriteJob]) -> None:
        for job in jobs:
            ev = self._sweeping.get(job.key)
            if ev is not None:
                await ev.wait()
        for name, tier in self.tiers.items():
            mine = [j for j in jobs if name in j.tiers]
            if not mine:
                continue
            items = [(j.key, j.payload, j.meta) for j in mine]
            put_many = getattr(tier, "put_many", None)
            if callable(put_many):
                outs = await asyncio.to_thread(put_many, items)
            else:
                outs = await asyncio.to_thread(lambda t=tier, it=items: [t.put(*x) for x in it])
            now = time.time()
            # What is left of each block's TTL: an entry never outlives its class TTL.
            records = [IndexRecord(j.key, j.meta.size, j.meta.traffic_class,
                                   ttl_s=math.ceil(j.meta.expires_at - now),
                                   tenant=j.meta.tenant)
                       for j, out in zip(mine, outs, strict=True)
                       if out.stored and j.meta.expires_at > now]
            await self.index.add(records, tier=name)
            written = [j.meta.size for j, o in zip(mine, outs, strict=True)
                       if o.stored and not o.existed]
            self.metrics.bytes_in.labels(name).inc(sum(written))
            evicted = [m.key for o in outs for m in o.evicted]
            if evicted:
                await self.index.remove(evicted, tier=name)
            for j, out in zip(mine, outs, strict=True):
                if j.ack_tier == name:
                    _resolve(j, out.stored and j.key not in evicted)


def _resolve(job: WriteJob, ok: bool) -> None:
    if job.acked is not None and not job.acked.done():
        job.acked.set_result(ok)
