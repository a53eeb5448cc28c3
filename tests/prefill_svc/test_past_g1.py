"""A session's next turn can arrive before the warehouse holds its previous
prompt (prefill's write-through runs behind the reply) but after decode stored
the answer's blocks (decode puts them before its final event). The prompt's
blocks are then in this prefill's G1 and the answer's in the warehouse, with a
gap at the warehouse's chain head: the restore continues the G1 hit in the
warehouse instead of recomputing the answer (service.restore, ``_past_g1``),
and the first token is the cache-less one."""

from __future__ import annotations

import asyncio
from pathlib import Path

from engine import Engine, EngineConfig, SamplingParams
from kvstore.client import KVStoreClient
from kvstore.keys import chain_keys
from kvstore.types import RequestCtx
from prefill_svc.config import PrefillConfig
from proto import prefill_pb2
from service.config import CostConfig, Endpoint, EngineSpec, WriterConfig
from tests.prefill_svc import procs
from tests.prefill_svc.inproc import serve_prefill
from tests.tls import secret

B = 16
TENANT = "default"


def test_a_g1_hit_continues_in_the_warehouse_past_blocks_it_lacks(redis_url: str,
                                                                  tmp_path: Path) -> None:
    config = procs.write_config(tmp_path / "kvserve.toml", block_tokens=B)
    store = procs.store(config, redis_url, tmp_path)
    procs.start_all(store)
    prompt = [(i * 7) % 250 + 1 for i in range(6 * B)]              # turn 1: 6 blocks
    answer = [(i * 13) % 250 + 2 for i in range(4 * B)]             # its answer: 4 more
    turn2 = [*prompt, *answer, *[(i * 5) % 250 + 3 for i in range(9)]]
    ref = Engine(EngineConfig(model="tiny-dense", block_tokens=B, num_blocks=256))
    want = ref.generate(turn2, SamplingParams(max_tokens=1)).tokens[0]
    ref.prefill("t", turn2, sampling=SamplingParams(max_tokens=1))
    answer_blocks = ref.export_blocks("t", 6, 4).clone()            # what decode would store
    ref.free("t")
    keys = chain_keys(turn2, block_tokens=B, tenant=TENANT, fingerprint=ref.fingerprint,
                      secret=secret())
    ctx = RequestCtx(tenant=TENANT, model_fingerprint=ref.fingerprint_hex)

    async def body() -> None:
        # No write-through: turn 1's prompt never reaches the warehouse, the
        # state a next turn sees while that write-through is still on its way.
        cfg = PrefillConfig(engine=EngineSpec(model="tiny-dense", block_tokens=B,
                                              num_blocks=64),
                            endpoint=Endpoint(port=0, store_address=store.address),
                            cost=CostConfig(fetch_policy="always"),
                            writer=WriterConfig(enabled=False), warmup_tokens=0)
        async with serve_prefill(cfg) as (stub, svc), KVStoreClient(store.address) as c:
            first = await stub.Prefill(prefill_pb2.PrefillRequest(token_ids=prompt), timeout=60)
            assert first.cached_tokens == 0 and not first.written_tiers
            assert svc.engine.g1_match(keys) == 6
            put = await c.put(keys[6:10], answer_blocks, layout=ref.layout.name,
                              token_count=B, ctx=ctx)
            assert put.stored == 4
            head = await c.lookup(keys, prompt_tokens=len(turn2), ctx=ctx, touch=False)
            assert head.matched_blocks == 0                         # the gap

            h = await stub.Prefill(prefill_pb2.PrefillRequest(token_ids=turn2), timeout=60)
            assert h.first_token == want
            assert h.cached_tokens == svc.engine.hit_rule.usable_tokens(10 * B, len(turn2))
            assert h.cached_tokens == 10 * B, (h.cached_tokens, h.fetch_decision)
            assert h.fetch_decision.startswith("fetch"), h.fetch_decision
            assert svc.restorer.stats.past_g1_blocks_total == 4

    try:
        asyncio.run(asyncio.wait_for(body(), 120))
    finally:
        store.kill()
