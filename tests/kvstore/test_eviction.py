"""Eviction policies: each one's order on small exact cases, the capacity
invariant for all of them, and Belady as the ceiling (property test)."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from common.traces import Trace, TraceRequest
from kvstore.eviction import CapacityCache, make_policy, policy_names
from studies.sim import Future, replay_cache
from tests.kvstore.simtrace import random_prefix_trace

ONLINE = [p for p in policy_names() if p != "belady"]


def test_registry_names_every_policy() -> None:
    assert {"lru", "fifo", "prefix_lru", "s3fifo", "hit_density", "belady"} <= set(policy_names())
    with pytest.raises(ValueError, match="choose one of"):
        make_policy("fifo-ish")


def _cache(policy: str, blocks: int) -> CapacityCache:
    return CapacityCache(blocks * 10, make_policy(policy))


def test_lru_evicts_least_recent() -> None:
    c = _cache("lru", 2)
    c.put("a", 10, 0)
    c.put("b", 10, 1)
    c.hit("a", 2)
    assert c.put("c", 10, 3).evicted == ["b"]


def test_prefix_lru_evicts_deepest_of_one_request_first() -> None:
    c = _cache("prefix_lru", 4)
    for k in ("root", "mid", "leaf"):          # one request, root first, same instant
        c.put(k, 10, 5.0)
    c.put("x", 10, 6.0)
    assert c.put("y", 10, 7.0).evicted == ["leaf"]
    assert c.put("z", 10, 8.0).evicted == ["mid"]
    c.hit("root", 9.0)
    assert c.put("w", 10, 10.0).evicted == ["x"]


def test_s3fifo_drops_one_hit_wonders_before_reused_keys() -> None:
    c = _cache("s3fifo", 10)
    for i in range(10):
        c.put(i, 10, i)
    for i in (0, 1, 2):
        c.hit(i, 20)                           # reused while on probation
    evicted = [k for j in range(7) for k in c.put(100 + j, 10, 30 + j).evicted]
    assert not {0, 1, 2} & set(evicted)
    assert len(evicted) == 7
    # A key back from the ghost goes straight to main and survives a new wave.
    c.put(evicted[0], 10, 50)
    wave = [k for j in range(5) for k in c.put(200 + j, 10, 60 + j).evicted]
    assert evicted[0] not in wave


def test_fifo_ignores_uses() -> None:
    c = _cache("fifo", 2)
    c.put("a", 10, 0)
    c.put("b", 10, 1)
    c.hit("a", 2)                              # LRU would now evict b
    assert c.put("c", 10, 3).evicted == ["a"]


def _agent_vs_chat(policy: str) -> tuple[int, int]:
    """10 agent blocks reused every 20 s; 2 chat blocks a second, never reused;
    room for 15 blocks. Returns (agent hits, agent blocks resident at the end)."""
    c = CapacityCache(15 * 10, make_policy(policy))
    hits, n = 0, 0
    for second in range(400):
        if second % 20 == 0:
            for k in range(10):
                hits += c.hit(("agent", k), second)
                c.put(("agent", k), 10, second, "agent")
        for _ in range(2):
            c.put(("chat", n), 10, second + 0.5, "chat")
            n += 1
    return hits, sum(1 for k in c.sizes if k[0] == "agent")


def test_hit_density_keeps_the_class_that_gets_reused() -> None:
    # LRU sees 40 newer chat blocks between agent turns and loses every agent
    # block; hit density learns that chat blocks never come back.
    assert _agent_vs_chat("lru") == (0, 0)
    hits, resident = _agent_vs_chat("hit_density")
    assert resident == 10 and hits >= 100          # of 190 possible after the first round


def test_belady_evicts_farthest_and_bypasses() -> None:
    p = make_policy("belady")
    c = CapacityCache(20, p)
    for key, nxt in (("a", 5.0), ("b", 9.0)):
        p.next_use(key, nxt)
        c.put(key, 10, 0)
    p.next_use("c", 7.0)
    assert c.put("c", 10, 1).evicted == ["b"]
    p.next_use("d", None)                      # never used again: kept out
    assert not c.put("d", 10, 2).stored and set(c.sizes) == {"a", "c"}


@pytest.mark.parametrize("policy", policy_names())
def test_capacity_invariant_under_random_use(policy: str) -> None:
    tr = random_prefix_trace(7, sessions=20)
    fut = Future.of(tr)
    cap = 12 * tr.block_tokens
    st = replay_cache(tr, policy=policy, capacity_tokens=cap, kv_bytes_per_token=1, future=fut)
    assert st.bytes_peak <= cap
    assert 0.0 <= st.hit_rate <= replay_cache(tr, kv_bytes_per_token=1).hit_rate


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 10**6), cap_blocks=st.integers(1, 30),
       ttl=st.sampled_from([math.inf, 15.0, 60.0]), two_classes=st.booleans(),
       engine=st.sampled_from(["auto", "python"]))
def test_belady_is_at_least_every_policy(seed: int, cap_blocks: int, ttl: float,
                                         two_classes: bool, engine: str) -> None:
    tr = random_prefix_trace(seed, sessions=10, think_s=20.0,
                             classes=("chat", "agent") if two_classes else ("chat",))
    fut = Future.of(tr)
    cap = cap_blocks * tr.block_tokens
    best = replay_cache(tr, policy="belady", capacity_tokens=cap, ttl_s=ttl, future=fut,
                        engine=engine)
    for policy in ONLINE:
        other = replay_cache(tr, policy=policy, capacity_tokens=cap, ttl_s=ttl, engine=engine)
        assert other.hit_rate <= best.hit_rate + 1e-12, policy
        assert other.per_class == {} or sum(c.hit_blocks for c in other.per_class.values()) <= \
            sum(c.hit_blocks for c in best.per_class.values()), policy


def _hot_and_one_offs() -> Trace:
    """A session returning every 10 s with the same 4-block chain, and between
    its turns a new one-off session of 4 blocks; room for 4 blocks."""
    reqs = []
    for k in range(100):
        reqs.append(TraceRequest(t=10.0 * k, session="hot", hash_ids=(1, 2, 3, 4),
                                 input_length=16, output_length=1, traffic_class="chat"))
        reqs.append(TraceRequest(t=10.0 * k + 5, session=f"once{k}",
                                 hash_ids=tuple(range(100 + 4 * k, 104 + 4 * k)),
                                 input_length=16, output_length=1, traffic_class="chat"))
    return Trace(name="hot", block_tokens=4, requests=tuple(reqs), arrival_note="hand-built")


def test_session_density_keeps_the_returning_session() -> None:
    tr = _hot_and_one_offs()
    lru = replay_cache(tr, policy="lru", capacity_tokens=16, kv_bytes_per_token=1)
    sd = replay_cache(tr, policy="session_density", capacity_tokens=16, kv_bytes_per_token=1)
    best = replay_cache(tr, policy="belady", capacity_tokens=16, kv_bytes_per_token=1)
    assert lru.per_class["chat"].hit_blocks == 0          # each one-off evicts the hot chain
    assert sd.per_class["chat"].hit_blocks >= 4 * 80      # of 4 * 99 possible
    assert sd.hit_rate <= best.hit_rate


def test_session_density_without_sessions_still_evicts() -> None:
    c = _cache("session_density", 3)
    for k in range(10):                        # no begin_request: each key its own session
        c.put(k, 10, float(k))
    assert len(c) == 3 and c.used_bytes == 30
