"""The Prefill service in-process (real gRPC sockets): the handle it returns,
its local prefix cache (G1), and PullKV over shared memory and as a stream."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import grpc
import pytest
import torch

from engine import Engine, SamplingParams
from kvstore.keys import chain_keys
from prefill_svc.config import PrefillConfig
from proto import prefill_pb2, prefill_pb2_grpc
from service.config import Endpoint, EngineSpec
from service.kv_buffer import KVAssembler, KVPiece, KVShape
from tests.prefill_svc.inproc import serve_prefill
from tests.tls import secret

SPEC = EngineSpec(model="tiny-dense", block_tokens=16, num_blocks=256)


@asynccontextmanager
async def serving(**cfg: object) -> AsyncIterator[prefill_pb2_grpc.PrefillStub]:
    config = PrefillConfig(engine=SPEC, endpoint=Endpoint(port=0), **cfg)  # type: ignore[arg-type]
    async with serve_prefill(config) as (stub, _):
        yield stub


def run(fn: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(asyncio.wait_for(fn(), 60))


def _tokens(n: int) -> list[int]:
    return [(i * 5) % 250 + 1 for i in range(n)]


def test_handle_and_local_prefix_cache() -> None:
    ref = Engine(SPEC.engine_config())

    async def body() -> None:
        async with serving() as stub:
            toks = _tokens(70)
            req = prefill_pb2.PrefillRequest(token_ids=toks, ctx={"tenant": "t1"})
            h = await stub.Prefill(req, timeout=30)
            assert list(h.prompt_ids) == toks
            assert list(h.block_keys) == chain_keys(toks, block_tokens=16, tenant="t1",
                                                    fingerprint=ref.fingerprint,
                                                    secret=secret())
            assert h.first_token == ref.generate(toks, SamplingParams(max_tokens=1)).tokens[0]
            assert h.ctx.tenant == "t1" and h.ctx.traffic_class == "chat"
            assert h.ctx.model_fingerprint == ref.fingerprint_hex and h.ctx.request_id
            assert h.layout == ref.layout.name and h.cached_tokens == 0
            assert h.expires_at == 0 and h.kv_seed      # no expiry clock; a checksum seed
            assert h.timings.compute_s > 0 and h.timings.total_s >= h.timings.compute_s
            assert h.fetch_decision == "none"                # no warehouse configured
            # Same prompt again: the engine kept its blocks (G1), up to the hit rule.
            h2 = await stub.Prefill(req, timeout=30)
            assert h2.cached_tokens == 64 and h2.first_token == h.first_token
            # Another tenant never hits them.
            other = prefill_pb2.PrefillRequest(token_ids=toks, ctx={"tenant": "t2"})
            assert (await stub.Prefill(other, timeout=30)).cached_tokens == 0

    run(body)


@pytest.mark.parametrize("use_shm", [True, False])
def test_pull_kv_returns_the_prompt_kv_then_release_frees_it(use_shm: bool) -> None:
    ref = Engine(SPEC.engine_config())
    toks = _tokens(45)
    ref.prefill("x", toks)
    want = ref.export_tokens("x", 0, len(toks))               # [layers, 2, kv_heads, 45, dim]

    async def body() -> None:
        async with serving(chunk_bytes=64 * 1024) as stub:
            h = await stub.Prefill(prefill_pb2.PrefillRequest(token_ids=toks), timeout=30)
            asm = KVAssembler(KVShape.of(want), len(toks), seed=h.kv_seed)
            chunks = [c async for c in stub.PullKV(prefill_pb2.PullKVRequest(
                request_id=h.ctx.request_id, use_shm=use_shm), timeout=30)]
            assert bool(chunks[0].shm_name) == use_shm
            for c in chunks:
                asm.add(KVPiece(c.start_token, c.token_count, c.data, c.shm_name, c.shm_offset,
                                c.size, c.checksum))
            assert torch.equal(asm.done(), want)
            rel = await stub.Release(prefill_pb2.ReleaseRequest(request_id=h.ctx.request_id),
                                     timeout=5)
            assert rel.released
            with pytest.raises(grpc.aio.AioRpcError) as info:
                async for _ in stub.PullKV(prefill_pb2.PullKVRequest(
                        request_id=h.ctx.request_id), timeout=5):
                    pass
            assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert "released" in info.value.details()

    run(body)


def test_kv_nobody_pulls_is_dropped_and_says_so() -> None:
    """No expiry clock for handles decode will take; KV never pulled within
    buffer_ttl_s (its router went away) is dropped, and a late pull says why
    (decode then rebuilds it)."""
    async def body() -> None:
        async with serving(buffer_ttl_s=0.2) as stub:
            h = await stub.Prefill(prefill_pb2.PrefillRequest(token_ids=_tokens(20)), timeout=30)
            await asyncio.sleep(1.5)                 # the buffer is swept every second
            with pytest.raises(grpc.aio.AioRpcError) as info:
                async for _ in stub.PullKV(prefill_pb2.PullKVRequest(
                        request_id=h.ctx.request_id), timeout=5):
                    pass
            assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert "never pulled" in info.value.details()

    run(body)
