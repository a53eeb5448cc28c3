"""Per-tenant accounting and eviction inside one tier (kvstore/eviction/tenants.py):
exact states on tiny sizes. A tenant over its quota only evicts its own blocks; a
full tier takes from the largest holder only while it holds at least what the
putter will; quotas that fit the capacity mean no cross-tenant eviction ever; with
one tenant the order is exactly the plain policy's."""

from __future__ import annotations

import random

import pytest

from kvstore.eviction import CapacityCache, make_policy, policy_names
from kvstore.eviction.tenants import UNATTRIBUTED, TenantCache


def _owners(c: TenantCache) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for key, owner in c.owner.items():
        out.setdefault(owner, []).append(key)
    return {k: sorted(v) for k, v in out.items()}


def test_a_tenant_over_its_quota_evicts_only_its_own_blocks() -> None:
    c = TenantCache(100, "lru")
    c.set_quotas({"a": 30}, None)
    for i in range(5):
        assert c.put(f"b{i}", 10, i, tenant="b").stored
    for i in range(10):                      # a floods far beyond its 30 bytes
        adm = c.put(f"a{i}", 10, 10 + i, tenant="a")
        assert adm.stored
        assert all(k.startswith("a") for k in adm.evicted)
    assert _owners(c) == {"a": ["a7", "a8", "a9"], "b": [f"b{i}" for i in range(5)]}
    assert c.tenant_bytes("a") == 30 and c.used_bytes == 80
    assert not c.put("big", 31, 30, tenant="a").stored          # larger than its quota
    usage = {u.tenant: u for u in c.usage()}
    assert usage["a"].evictions == 7 and usage["b"].evictions == 0
    assert usage["a"].quota_bytes == 30 and usage["b"].quota_bytes is None


def test_a_full_tier_takes_from_the_largest_holder_down_to_the_putters_level() -> None:
    c = TenantCache(100, "lru")
    for i in range(8):
        c.put(f"b{i}", 10, i, tenant="b")                       # b holds 80
    for i in range(2):
        c.put(f"c{i}", 10, 10 + i, tenant="c")                  # c holds 20: full
    for i in range(20):                                          # a floods, no quota
        adm = c.put(f"a{i}", 10, 20 + i, tenant="a")
        assert adm.stored
        # Never from a holder smaller than what a will hold after the put.
        assert all(not k.startswith("c") for k in adm.evicted)
    # b went down to a's level; c, the small one, was never touched; a then ate itself.
    assert c.tenant_bytes("c") == 20
    assert c.tenant_bytes("a") == c.tenant_bytes("b") == 40
    assert _owners(c)["a"] == [f"a{i}" for i in range(16, 20)]   # its own oldest went


def test_quotas_that_fit_the_capacity_mean_no_tenant_ever_evicts_another() -> None:
    rnd = random.Random(7)
    c = TenantCache(120, "lru")
    quotas = {"a": 40, "b": 30, "c": 50}
    c.set_quotas(quotas, None)
    for step in range(3000):
        t = rnd.choice("abc")
        adm = c.put(f"{t}{step}", rnd.choice((5, 10, 15)), step, tenant=t)
        assert all(k.startswith(t) for k in adm.evicted), (t, adm.evicted)
        if rnd.random() < 0.3 and c.owner:                      # hits reorder, evict nothing
            c.hit(rnd.choice(list(c.owner)), step)
        for name, limit in quotas.items():
            assert c.tenant_bytes(name) <= limit


@pytest.mark.parametrize("policy", sorted(set(policy_names()) - {"belady"}))
def test_one_tenant_evicts_exactly_as_the_plain_policy(policy: str) -> None:
    rnd = random.Random(3)
    plain, mine = CapacityCache(200, make_policy(policy)), TenantCache(200, policy)
    for step in range(2000):
        key = rnd.randrange(60)
        size = 10 + key % 3 * 5
        if rnd.random() < 0.5:
            assert plain.hit(key, step) == mine.hit(key, step)
        else:
            a = plain.put(key, size, step, "chat")
            b = mine.put(key, size, step, "chat", tenant="t")
            assert (a.stored, a.evicted) == (b.stored, b.evicted)
    assert plain.sizes == mine.sizes and plain.evictions == mine.evictions


def test_lowering_a_quota_trims_that_tenant_at_once_and_no_limit_escapes_the_default() -> None:
    c = TenantCache(1000, "lru")
    for i in range(6):
        c.put(f"a{i}", 10, i, tenant="a")
        c.put(f"b{i}", 10, i, tenant="b")
    evicted = c.set_quotas({"b": None}, 20)          # default 20; b explicitly unlimited
    assert evicted == ["a0", "a1", "a2", "a3"]
    assert c.tenant_bytes("a") == 20 and c.tenant_bytes("b") == 60
    assert c.quota("new") == 20 and c.quota("b") is None


def test_unattributed_blocks_count_and_move_to_their_tenant_when_read() -> None:
    c = TenantCache(100, "lru")
    c.set_quotas({"a": 20}, None)
    for i in range(3):
        c.put(f"x{i}", 10, i)                        # listed at start: owner unknown
    assert c.tenant_bytes(UNATTRIBUTED) == 30
    c.put("a0", 10, 5, tenant="a")
    assert c.attribute("x0", "a", 6) == []           # a now holds 20: within its quota
    assert c.attribute("x1", "a", 7) == ["a0"]       # a's own oldest makes room
    assert c.tenant_bytes("a") == 20 and c.tenant_bytes(UNATTRIBUTED) == 10
    assert [u.tenant for u in c.usage()] == ["a"]    # the unknown owner is not a tenant row
