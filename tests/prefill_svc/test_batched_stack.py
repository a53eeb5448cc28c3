"""16 prompts arriving together at real processes (kvstore, prefill, decode on
real Redis and gRPC): the prefill service batches them into shared steps, and
their first tokens, decoded tokens and the blocks written to the warehouse
are identical to 16 single runs of the engine."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from engine import Engine, EngineConfig, SamplingParams
from kvstore.client import KVStoreClient
from kvstore.redis_server import EmbeddedRedis
from kvstore.types import RequestCtx
from tests.decode_svc.stack import Stack, decode, keys_of, prefill, prompt, wait_stored
from tests.prefill_svc import procs

B = procs.BLOCK
N = 16
STEP = 96


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    base = tmp_path_factory.mktemp("batched")
    with EmbeddedRedis() as redis:
        config = procs.write_config(base / "kvserve.toml")
        store = procs.store(config, redis.url, base)
        store.start()
        pre = procs.engine_service("prefill", config, redis.url, base,
                                   store_address=store.address,
                                   extra=("--step-tokens", str(STEP), "--max-running", str(N)))
        dec = procs.engine_service("decode", config, redis.url, base,
                                   store_address=store.address)
        procs.start_all(pre, dec)
        store.wait_ready()
        ref = Engine(EngineConfig(model="tiny-dense", block_tokens=B, num_blocks=1024))
        s = Stack(redis.url, config, base, store, pre, dec, ref)
        try:
            yield s
        finally:
            s.close()
            for p in (dec, pre, store):
                p.stop()


def _stored(address: str, keys: list[bytes], like: torch.Tensor) -> torch.Tensor:
    async def get() -> torch.Tensor:
        out = torch.empty_like(like)
        async with KVStoreClient(address, timeout_s=10.0, use_shm=False) as c:
            got = await c.get(keys, ctx=RequestCtx(tenant="default"), out=out)
        assert got.hit_prefix == len(keys)
        return out

    return asyncio.run(get())


def test_sixteen_prompts_together_equal_sixteen_single_runs(stack: Stack) -> None:
    ref = stack.ref
    prompts = [prompt(300 + i, 100 + 29 * i) for i in range(N)]   # 100 .. 535 tokens
    singles, blocks = [], []
    for p in prompts:
        singles.append(ref.generate(p, SamplingParams(max_tokens=8)).tokens)
        ref.prefill("one", p)
        blocks.append(ref.export_blocks("one").clone())
        ref.free("one")
    m0 = stack.prefill.metrics()
    with ThreadPoolExecutor(N) as pool:
        handles = list(pool.map(lambda p: prefill(stack.prefill_stub(), p, max_tokens=8),
                                prompts))
        assert [h.first_token for h in handles] == [s[0] for s in singles]
        m1 = stack.prefill.metrics()
        steps, chunks = (m1[f"kvserve_prefill_prefill_{k}_total"]
                         - m0[f"kvserve_prefill_prefill_{k}_total"] for k in ("steps", "chunks"))
        assert 0 < steps < chunks, (steps, chunks)      # prompts shared their steps
        # The write-through of every prompt's full blocks: the single run's bits.
        for p, want in zip(prompts, blocks, strict=True):
            keys = keys_of(ref, p)
            assert wait_stored(stack.store.address, keys, len(keys), len(p)) == len(keys)
            assert torch.equal(_stored(stack.store.address, keys, want), want)
        outs = list(pool.map(lambda h: decode(stack.decode_stub(), h, max_tokens=8), handles))
    for p, out, want in zip(prompts, outs, singles, strict=True):
        assert out.tokens == want, f"prompt of {len(p)} tokens"
