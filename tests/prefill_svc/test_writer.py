"""The block writer: never blocks the caller, retries, counts what it loses."""

from __future__ import annotations

import asyncio

import pytest
import torch

from kvstore.types import PutResult, RequestCtx
from service.writer import BlockWriter, WriteJob

CTX = RequestCtx(request_id="r")


def _blocks(n: int) -> torch.Tensor:
    return torch.zeros(n, 2, 2, 2, 16, 4)       # [n, layers, 2, kv_heads, B, head_dim]


def test_retries_then_stores_and_gives_up_after_the_last_retry() -> None:
    async def body() -> None:
        attempts: list[int] = []

        async def flaky(job: WriteJob) -> PutResult:
            attempts.append(len(job.keys))
            if len(attempts) in (1, 2, 4, 5, 6):          # job 1: fails twice; job 2: always
                raise ConnectionError("store down")
            return PutResult(len(job.keys), 0, job.nbytes)

        w = BlockWriter(flaky, retries=2, backoff_s=0.001, max_queue=4)
        w.start()
        assert w.submit([b"k" * 16] * 3, _blocks(3), layout="L", token_count=16, ctx=CTX)
        assert w.submit([b"j" * 16] * 2, _blocks(2), layout="L", token_count=16, ctx=CTX)
        assert await w.flush(5.0)
        s = w.stats
        assert (s.stored_blocks_total, s.failed_blocks_total, s.retries_total) == (3, 2, 4)
        assert s.bytes_total == _blocks(3).numel() * 4
        await w.close()

    asyncio.run(body())


def test_full_queue_drops_and_counts_without_waiting() -> None:
    async def body() -> None:
        gate = asyncio.Event()

        async def slow(job: WriteJob) -> PutResult:
            await gate.wait()
            return PutResult(len(job.keys), 0, 0)

        w = BlockWriter(slow, max_queue=1)
        w.start()
        results = [w.submit([bytes([i]) * 16], _blocks(1), layout="L", token_count=16, ctx=CTX)
                   for i in range(4)]
        # one job taken by the worker (after a yield), one queued, the rest dropped
        await asyncio.sleep(0)
        assert results[0] and results.count(False) >= 2
        assert w.stats.dropped_blocks_total == results.count(False)
        gate.set()
        assert await w.flush(5.0)
        await w.close()

    asyncio.run(body())


def test_job_pairs_keys_with_blocks() -> None:
    with pytest.raises(ValueError, match="pairs 2 keys"):
        WriteJob((b"a" * 16, b"b" * 16), _blocks(3), "L", 16, CTX)
    with pytest.raises(ValueError, match="16 tokens"):
        WriteJob((b"a" * 16,), _blocks(1), "L", 8, CTX)
