"""Write-through of new full blocks to the warehouse, off the reply path.

``submit`` only enqueues (never awaits the store); one background task puts
jobs in order, retrying with backoff. A job whose retries run out, or that
finds the queue full, is dropped and counted: the blocks are simply not
cached, which costs a later recompute and never serves wrong KV. Pairing is
checked at submit (one key per block, block size), the store verifies
checksums, and keys are write-once there, so a retried put cannot corrupt.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

import torch

from kvstore.types import PutResult, RequestCtx

log = logging.getLogger(__name__)

PutFn = Callable[["WriteJob"], Awaitable[PutResult]]


@dataclass(frozen=True, slots=True)
class WriteJob:
    keys: tuple[bytes, ...]
    blocks: torch.Tensor            # [n, layers, 2, kv_heads, block_tokens, head_dim], host
    layout: str
    token_count: int                # tokens per block
    ctx: RequestCtx

    def __post_init__(self) -> None:
        if self.blocks.dim() != 6 or self.blocks.shape[0] != len(self.keys):
            raise ValueError(f"write job pairs {len(self.keys)} keys with blocks of shape "
                             f"{tuple(self.blocks.shape)}")
        if self.blocks.shape[4] != self.token_count:
            raise ValueError(f"blocks hold {self.blocks.shape[4]} tokens each, "
                             f"job says {self.token_count}")

    @property
    def nbytes(self) -> int:
        return self.blocks.numel() * self.blocks.element_size()


@dataclass(slots=True)
class WriterStats:
    jobs_total: int = 0
    stored_blocks_total: int = 0
    skipped_blocks_total: int = 0   # already in the warehouse
    failed_blocks_total: int = 0    # retries exhausted
    dropped_blocks_total: int = 0   # queue full
    retries_total: int = 0
    bytes_total: int = 0
    queued: int = 0


class BlockWriter:
    def __init__(self, put: PutFn, *, retries: int = 3, backoff_s: float = 0.1,
                 max_queue: int = 64) -> None:
        self._put = put
        self._retries = retries
        self._backoff_s = backoff_s
        self._queue: asyncio.Queue[WriteJob] = asyncio.Queue(maxsize=max_queue)
        self._task: asyncio.Task[None] | None = None
        self.stats = WriterStats()

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="block-writer")

    def submit(self, keys: Sequence[bytes], blocks: torch.Tensor, *, layout: str,
               token_count: int, ctx: RequestCtx) -> bool:
        """Queue blocks for the warehouse; False when dropped because the queue is full."""
        if not keys:
            return True
        job = WriteJob(tuple(keys), blocks.detach().to("cpu"), layout, token_count, ctx)
        try:
            self._queue.put_nowait(job)
        except asyncio.QueueFull:
            self.stats.dropped_blocks_total += len(job.keys)
            log.warning("write-through queue full: %d blocks of request %s not cached",
                        len(job.keys), ctx.request_id)
            return False
        self.stats.queued = self._queue.qsize()
        return True

    async def write_now(self, keys: Sequence[bytes], blocks: torch.Tensor, *, layout: str,
                        token_count: int, ctx: RequestCtx) -> None:
        """Put blocks at once (not queued), with the same retries and counters;
        for callers that must know the blocks are in the warehouse before they
        answer (decode's canonical blocks before the final event)."""
        if keys:
            await self._write(WriteJob(tuple(keys), blocks.detach().to("cpu"), layout,
                                       token_count, ctx))

    async def flush(self, timeout_s: float) -> bool:
        """Wait until every queued job is done (True) or the timeout passes."""
        try:
            await asyncio.wait_for(self._queue.join(), timeout_s)
        except TimeoutError:
            return False
        return True

    async def close(self, drain_s: float = 2.0) -> None:
        if self._task is None:
            return
        await self.flush(drain_s)
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        self._task = None

    async def _run(self) -> None:
        while True:
            job = await self._queue.get()
            try:
                await self._write(job)
            finally:
                self._queue.task_done()
                self.stats.queued = self._queue.qsize()

    async def _write(self, job: WriteJob) -> None:
        self.stats.jobs_total += 1
        for attempt in range(self._retries + 1):
            try:
                res = await self._put(job)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # any failure is retried, then counted
                if attempt == self._retries:
                    self.stats.failed_blocks_total += len(job.keys)
                    log.warning("write-through of %d blocks (request %s) failed after %d "
                                "attempts: %s", len(job.keys), job.ctx.request_id, attempt + 1,
                                exc)
                    return
                self.stats.retries_total += 1
                await asyncio.sleep(self._backoff_s * 2**attempt)
                continue
            self.stats.stored_blocks_total += res.stored
            self.stats.skipped_blocks_total += res.skipped
            self.stats.bytes_total += res.bytes
            return
