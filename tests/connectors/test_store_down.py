"""Issue 11: the warehouse goes down mid-run. vLLM keeps serving (it recomputes),
the degradation is counted, and once the kvstore is back (same port, same G3
directory) warehouse hits return. Runs last: it restarts the session's store."""

from __future__ import annotations

import asyncio

import pytest

from tests.connectors.stack import (
    BLOCK,
    complete,
    hit_rule,
    prompts,
    salt,
    stats,
    store_client,
    wait_count,
    wait_for,
    wait_stored,
)

pytestmark = pytest.mark.timeout(1500)


async def _g3_blocks(address: str) -> int:
    async with store_client(address) as c:
        return next(t.blocks for t in (await c.stats()).tiers if t.tier == "G3")


def test_warehouse_down_vllm_keeps_serving_degradation_counted_hits_return(
        vllm_stack, vllm_servers):
    server = vllm_servers.only("vllm-b")
    store = vllm_stack.store
    tenant = f"down-{vllm_stack.run}"
    old, new = prompts(2, seed=41, lo=450, hi=451)
    want = hit_rule(len(old), len(old) // BLOCK)
    g3 = asyncio.run(_g3_blocks(store.address))
    first = complete(server, old, salt=salt(tenant))
    wait_stored(vllm_stack, [(old, salt(tenant), len(old) // BLOCK)])
    # Its blocks must be on disk (G3 survives the restart below).
    wait_for(lambda: asyncio.run(_g3_blocks(store.address)) - g3 >= len(old) // BLOCK,
             what="G3 write-back")

    store.kill()
    before = stats(vllm_stack.redis_url, "vllm-b")
    down = complete(server, new, salt=salt(tenant))     # served with the store gone
    assert len(down.token_ids) == 32 and down.cached_tokens == 0
    miss = complete(server, old, salt=salt(tenant, "cold1"))  # recomputed: same answer
    assert miss.token_ids == first.token_ids and miss.cached_tokens == 0
    during = wait_count(vllm_stack.redis_url, "vllm-b", before, "lookup_failures", 1)
    assert during.get("degraded", 0) > before.get("degraded", 0)

    store.start()
    tries = iter(range(1000))

    def hit_again() -> bool:                        # a cold vLLM cache each time
        return complete(server, old, salt=salt(tenant, f"t{next(tries)}")).cached_tokens == want

    wait_for(hit_again, timeout_s=180, what="warehouse hits after the restart")
    back = complete(server, old, salt=salt(tenant))   # vLLM's own cache now, same tokens
    assert back.token_ids == first.token_ids
