"""Issue 11: token identity through the warehouse, across vLLM processes.

Server A computes 20 prompts cold (greedy, 32 tokens) and its connector writes
their blocks to the kvstore; server B, a fresh vLLM process that never saw
them, answers the same prompts restoring the prefix from the warehouse: same
tokens, and the cached tokens it reports are exactly the hit rule's
floor_to_block(min(stored, L - 1)). P/D through the warehouse: prompts
prefilled on A (one output token) and decoded on B equal a monolithic run.
"""

from __future__ import annotations

import pytest

from tests.connectors.stack import (
    BLOCK,
    complete,
    hit_rule,
    prompts,
    stats,
    wait_for,
)

N_PROMPTS = 20
# The fixtures start vLLM servers (~40 s each in CI, minutes on a loaded 2-core box).
pytestmark = pytest.mark.timeout(1500)


def test_fresh_process_restores_from_the_warehouse_token_for_token(vllm_stack, vllm_servers):
    salt = f"ident-{vllm_stack.run}"
    ps = prompts(N_PROMPTS, seed=11)
    pd_salt, mono_salt = f"pd-{vllm_stack.run}", f"mono-{vllm_stack.run}"
    pd = prompts(4, seed=12)
    a = vllm_servers.only("vllm-a")
    before_a = stats(vllm_stack.redis_url, "vllm-a")
    cold = [complete(a.spec.base_url, p, salt=salt) for p in ps]
    assert all(c.cached_tokens == 0 for c in cold), "A must compute these prompts cold"
    # P/D by hand: a monolithic reference (another tenant, so nothing is shared), then
    # the same prompts prefilled on A with one output token; B decodes them below.
    mono = [complete(a.spec.base_url, p, salt=mono_salt) for p in pd]
    for p in pd:
        assert len(complete(a.spec.base_url, p, salt=pd_salt, max_tokens=1).token_ids) == 1
    # A's Puts run off the critical path: wait until every full prompt block is stored.
    want_blocks = sum(len(p) // BLOCK for p in ps + pd + pd)
    wait_for(lambda: stats(vllm_stack.redis_url, "vllm-a").get("saved_blocks", 0)
             - before_a.get("saved_blocks", 0) >= want_blocks, what="A's saves")

    b = vllm_servers.only("vllm-b")        # A stops; B is a fresh process
    before_b = stats(vllm_stack.redis_url, "vllm-b")
    warm = [complete(b.spec.base_url, p, salt=salt) for p in ps]
    for i, (c, w, p) in enumerate(zip(cold, warm, ps, strict=True)):
        assert w.token_ids == c.token_ids, f"prompt {i} ({len(p)} tokens) diverged"
        assert len(w.token_ids) == 32
        assert w.cached_tokens == hit_rule(len(p), len(p) // BLOCK), f"prompt {i}"
    after_b = stats(vllm_stack.redis_url, "vllm-b")
    hit = sum(hit_rule(len(p), len(p) // BLOCK) for p in ps)
    assert after_b.get("hit_tokens", 0) - before_b.get("hit_tokens", 0) == hit
    assert after_b.get("load_errors", 0) == before_b.get("load_errors", 0)
    assert sum(w.cached_tokens for w in warm) == hit > 0

    for p, m in zip(pd, mono, strict=True):   # decode on B == the monolithic run
        d = complete(b.spec.base_url, p, salt=pd_salt)
        assert d.cached_tokens == hit_rule(len(p), len(p) // BLOCK) > 0
        assert d.token_ids == m.token_ids
