"""A request's restore plan goes stale while it waits: it arrived with its prefix
in G1 (so it planned no fetch), then another prompt's room evicted those blocks
before it was admitted. The prefill service looks it up and fetches again from
what G1 holds now, so the evicted blocks come from the warehouse instead of
being recomputed (an agent's resends of two long sessions alternating in a G1
that held one of them were each recomputed cold)."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

from common.config import PrefillSection
from engine import Engine, EngineConfig, SamplingParams
from prefill_svc.config import PrefillConfig
from proto import prefill_pb2
from service.config import CostConfig, Endpoint, EngineSpec
from tests.prefill_svc import procs
from tests.prefill_svc.inproc import Serving, serve_prefill
from tests.prefill_svc.test_scheduling import _until

B = 16
POOL = 12                     # blocks: A's 6 and B's 10 do not fit together
SPEC = EngineSpec(model="tiny-dense", block_tokens=B, num_blocks=POOL)


def serving(store_address: str) -> Serving:
    return serve_prefill(PrefillConfig(
        engine=SPEC, endpoint=Endpoint(port=0, store_address=store_address),
        scheduler=PrefillSection(policy="fcfs", step_tokens=B, solo_step_tokens=0),
        cost=CostConfig(fetch_policy="always"), warmup_tokens=0))


def test_blocks_evicted_while_waiting_are_fetched_not_recomputed(redis_url: str,
                                                                 tmp_path: Path) -> None:
    config = procs.write_config(tmp_path / "kvserve.toml", block_tokens=B)
    store = procs.store(config, redis_url, tmp_path)
    procs.start_all(store)
    a = [(i * 7) % 250 + 1 for i in range(6 * B + 5)]          # 6 full blocks
    a2 = [*a, 9, 9, 9]                                         # its resend
    b = [(i * 11) % 250 + 3 for i in range(10 * B)]            # 10 blocks, cold
    ref = Engine(EngineConfig(model="tiny-dense", block_tokens=B, num_blocks=256))
    want = ref.generate(a2, SamplingParams(max_tokens=1)).tokens[0]

    async def body() -> None:
        async with serving(store.address) as (stub, svc):
            first = await stub.Prefill(prefill_pb2.PrefillRequest(token_ids=a), timeout=60)
            assert first.cached_tokens == 0
            await _until(lambda: svc.writer.stats.stored_blocks_total >= 6,
                         "A's blocks written to the warehouse")
            assert svc.engine.g1_match(list(first.block_keys)) == 6
            # Hold the engine thread while B, then A's resend arrive: B is admitted
            # first (first come first served, one block per step) and its blocks
            # evict A's from the 12-block pool; the resend planned no fetch (its 6
            # blocks were in G1 when it arrived).
            gate = threading.Event()
            svc.thread.submit(gate.wait, 60)
            try:
                cb = asyncio.ensure_future(stub.Prefill(prefill_pb2.PrefillRequest(
                    token_ids=b, ctx={"request_id": "b"}), timeout=60))
                await _until(lambda: svc.steps.sched.queue == 1, "B queued")
                ca = asyncio.ensure_future(stub.Prefill(prefill_pb2.PrefillRequest(
                    token_ids=a2, ctx={"request_id": "a2"}), timeout=60))
                await _until(lambda: svc.steps.sched.queue == 2, "the resend queued")
                await _until(lambda: all(e.ready for e in svc.steps.sched.waiting.values()),
                             "both warmed")
            finally:
                gate.set()
            hb, ha = await cb, await ca
            assert hb.cached_tokens == 0
            assert ha.first_token == want
            assert ha.cached_tokens == 6 * B, (ha.cached_tokens, ha.fetch_decision)
            assert svc.stats.rewarmed_total >= 1

    try:
        asyncio.run(asyncio.wait_for(body(), 120))
    finally:
        store.kill()
