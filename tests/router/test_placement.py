"""Placement policies and the cluster/prefix views."""

from __future__ import annotations

import time

import numpy as np
import pytest

from common.config import HitRule
from kvstore.events import KVEvent
from kvstore.keys import chain_keys
from kvstore.registry import InstanceInfo
from router.placement import (
    NoCandidateError,
    PlacementRequest,
    Placer,
    PolicyConfig,
    UnknownPolicyError,
    make_router_policy,
    restorable_tokens,
    router_policy_names,
)
from router.view import GLOBAL, CandidateSet, ClusterView, PrefixView, TierCounts

FP = bytes(range(16))


def _inst(iid: str, role: str, *, node: str = "", pending: int = 0, imbalance: float = 1.0,
          heartbeat: float = 0.0) -> InstanceInfo:
    return InstanceInfo(iid, role, f"127.0.0.1:{50000 + len(iid)}", node=node,
                        tokens_in_flight=pending, expert_imbalance=imbalance,
                        last_heartbeat=heartbeat)


def _keys(tokens: list[int]) -> list[bytes]:
    return chain_keys(tokens, block_tokens=64, tenant="t", fingerprint=FP)


# ----------------------------------------------------------- policies on a cluster


def test_cache_expert_aware_sends_decode_to_the_balanced_instance() -> None:
    view = ClusterView()
    view.replace([_inst("dec-a", "decode", pending=4096, imbalance=1.6),
                  _inst("dec-b", "decode", pending=4096, imbalance=1.05)])
    placer = Placer(make_router_policy("cache_expert_aware"))
    for _ in range(4):                          # whatever the rotating tie-break offset
        d = placer.place_decode(view.candidates("decode"), prompt_tokens=500)
        assert d.instance_id == "dec-b"
        assert d.reason == "expert_balance"
        assert d.scores["dec-b"] > d.scores["dec-a"]
    # The imbalance-blind policy cannot tell them apart: it alternates.
    blind = Placer(make_router_policy("cache_aware"))
    chosen = {blind.place_decode(view.candidates("decode"), 500).instance_id for _ in range(4)}
    assert chosen == {"dec-a", "dec-b"}


def test_cache_aware_sends_prefill_to_the_instance_holding_the_prefix() -> None:
    view = ClusterView()
    view.replace([_inst("pre-a", "prefill", node="n1"), _inst("pre-b", "prefill", node="n2")])
    prompt = list(range(1000, 1000 + 640))
    prefixes = PrefixView()
    # pre-b's node stored the prompt's first 8 blocks (a KV event from its kvstore).
    prefixes.apply(KVEvent("1-0", "stored", "n2", "G2", "kvstore-n2", tuple(_keys(prompt)[:8])))
    placer = Placer(make_router_policy("cache_aware"), prefixes)
    for _ in range(4):
        d = placer.place_prefill(view.candidates("prefill"), _keys(prompt), len(prompt))
        assert d.instance_id == "pre-b"
        assert d.reason == "prefix_affinity"
        assert d.restorable_tokens == 8 * 64
        assert d.scores["pre-b"] == pytest.approx(0.9 * 512)     # G2 credit, nothing pending
        assert d.scores["pre-a"] == 0.0


# ----------------------------------------------------------- policies


def test_registry_lists_names_on_error() -> None:
    assert router_policy_names() == ["cache_aware", "cache_expert_aware", "least_load",
                                     "round_robin"]
    with pytest.raises(UnknownPolicyError, match="round_robin"):
        make_router_policy("fastest")


def test_round_robin_and_least_load() -> None:
    view = ClusterView()
    view.replace([_inst(f"p{i}", "prefill", pending=p) for i, p in enumerate([300, 100, 200])])
    cands = view.candidates("prefill")
    rr = make_router_policy("round_robin")
    picks = [rr.choose_prefill(cands, PlacementRequest(10)).instance_id for _ in range(6)]
    assert picks == ["p0", "p1", "p2", "p0", "p1", "p2"]
    ll = make_router_policy("least_load")
    assert ll.choose_prefill(cands, PlacementRequest(10)).instance_id == "p1"
    view.add_pending("p1", 500)                     # router-sent work since the heartbeat
    assert ll.choose_prefill(view.candidates("prefill"), PlacementRequest(10)).instance_id == "p2"


def test_finished_work_leaves_the_pending_count_before_the_next_heartbeat() -> None:
    def pending() -> dict[str, float]:
        c = view.candidates("prefill")
        return dict(zip(c.ids, c.pending_tokens.tolist(), strict=True))

    view = ClusterView()
    t0 = time.time()
    view.replace([_inst("a", "prefill", heartbeat=t0 - 0.5), _inst("b", "prefill",
                                                                   heartbeat=t0 - 0.5)])
    first = view.add_pending("a", 800)              # sent after a's report
    assert pending() == {"a": 800, "b": 0}
    view.done(first)
    assert pending() == {"a": 0, "b": 0}
    # Sent, then a report taken while it ran counts it; finishing takes it off that
    # report, and a later report (taken after it finished) replaces both.
    second = view.add_pending("a", 800)
    view.replace([_inst("a", "prefill", pending=800, heartbeat=time.time()),
                  _inst("b", "prefill", heartbeat=t0 - 0.5)])
    assert pending()["a"] == 800
    view.done(second)
    assert pending()["a"] == 0
    view.replace([_inst("a", "prefill", pending=300, heartbeat=time.time() + 1),
                  _inst("b", "prefill", heartbeat=t0 - 0.5)])
    assert pending()["a"] == 300                    # someone else's work, reported
    view.done(view.add_pending("b", 100))
    view.done(view.add_pending("gone", 100))        # an instance that left: no effect
    assert pending() == {"a": 300, "b": 0}


def test_cache_aware_weighs_affinity_against_load() -> None:
    cands = CandidateSet.of([_inst("a", "prefill", pending=5000), _inst("b", "prefill")])
    pol = make_router_policy("cache_aware")
    hits = np.array([[0, 4096, 0, 0], [0, 0, 0, 0]])
    # 0.9 * 4096 restorable tokens do not pay for 5000 queued tokens ...
    assert pol.choose_prefill(cands, PlacementRequest(8192, hits)).instance_id == "b"
    # ... but do when credited fully (G1) with a lighter queue.
    cands = CandidateSet.of([_inst("a", "prefill", pending=3000), _inst("b", "prefill")])
    hits = np.array([[4096, 0, 0, 0], [0, 0, 0, 0]])
    assert pol.choose_prefill(cands, PlacementRequest(8192, hits)).instance_id == "a"
    with pytest.raises(ValueError, match="shape"):
        pol.choose_prefill(cands, PlacementRequest(8192, hits[:1]))
    with pytest.raises(ValueError, match="must not increase"):
        PolicyConfig(tier_credit=(0.5, 0.9, 0.6, 0.4))


def test_no_candidates_and_exclusion() -> None:
    view = ClusterView()
    view.replace([_inst("p0", "prefill"), _inst("p1", "prefill")])
    placer = Placer(make_router_policy("least_load"))
    d = placer.place_prefill(view.candidates("prefill", exclude={"p0"}), [], 10)
    assert d.instance_id == "p1" and set(d.scores) == {"p1"}
    with pytest.raises(NoCandidateError):
        placer.place_prefill(view.candidates("prefill", exclude={"p0", "p1"}), [], 10)
    with pytest.raises(NoCandidateError):
        placer.place_decode(view.candidates("decode"), 10)


def test_stale_heartbeats_drop_out() -> None:
    view = ClusterView(expiry_s=5.0)
    view.replace([_inst("p0", "prefill", heartbeat=100.0), _inst("p1", "prefill", heartbeat=99.5)])
    assert view.candidates("prefill", now=104.0).ids == ("p0", "p1")
    assert view.candidates("prefill", now=104.6).ids == ("p0",)


def test_hit_rule_caps_restorable_tokens_from_the_slowest_tier() -> None:
    blocks = np.array([[2, 0, 0, 2], [1, 0, 0, 0]])
    # A 256-token prompt fully matched: the last block must be computed (reserve 1).
    tokens = restorable_tokens(blocks, 64, 256, HitRule(block_tokens=64))
    assert tokens.tolist() == [[128, 0, 0, 64], [64, 0, 0, 0]]
    swa = HitRule(block_tokens=64, window=128, backtrack=6)       # the L - 134 rule
    assert restorable_tokens(blocks, 64, 256, swa).tolist() == [[64, 0, 0, 0], [64, 0, 0, 0]]


# ----------------------------------------------------------- prefix view


def test_prefix_view_events_and_per_location_match() -> None:
    pv = PrefixView(initial_rows=2, initial_locations=2)           # forces both to grow
    keys = [bytes([i]) * 16 for i in range(6)]
    pv.apply_event("stored", "n1", "G2", keys[:5])
    pv.apply_event("stored", "n1", "G3", keys[:2])
    pv.apply_event("stored", "p1", "G1", keys[:3])
    pv.apply_event("stored", GLOBAL, "G4", keys)
    m = pv.match(keys)
    assert m["n1"] == TierCounts(5, (0, 5, 0, 0))                   # G2 beats G3
    assert m["p1"] == TierCounts(3, (3, 0, 0, 0))
    assert m[GLOBAL] == TierCounts(6, (0, 0, 0, 6))
    pv.apply_event("evicted", "n1", "G2", keys[1:2])                # a hole at block 1 ...
    assert pv.match(keys)["n1"] == TierCounts(5, (0, 4, 1, 0))      # ... G3 still holds it
    pv.apply_event("evicted", "n1", "G3", keys[1:2])
    assert pv.match(keys)["n1"] == TierCounts(1, (0, 1, 0, 0))      # run stops at the hole
    for loc, tier in (("n1", "G2"), ("n1", "G3"), ("p1", "G1"), (GLOBAL, "G4")):
        pv.apply_event("evicted", loc, tier, keys)
    assert len(pv) == 0 and pv.match(keys) == {}                    # rows returned
    with pytest.raises(ValueError, match="unknown tier"):
        pv.apply_event("stored", "n1", "G9", keys)


def test_candidates_combine_own_node_and_global_sources() -> None:
    cands = CandidateSet.of([_inst("p1", "prefill", node="n1"), _inst("p2", "prefill", node="n1"),
                             _inst("p3", "prefill", node="n2")])
    pv = PrefixView()
    keys = [bytes([i]) * 16 for i in range(8)]
    pv.apply_event("stored", "p1", "G1", keys[:2])
    pv.apply_event("stored", "n1", "G2", keys[2:4])                 # continues p1's run
    pv.apply_event("stored", GLOBAL, "G4", keys[:1] + keys[4:6])
    got = pv.match_candidates(keys, cands)
    assert got.tolist() == [[2, 2, 0, 2],                           # G1 + G2 + G4, 6 blocks
                            [0, 0, 0, 1],                           # p2 lacks p1's G1 block 1
                            [0, 0, 0, 1]]


def test_match_candidates_agrees_with_a_naive_walk() -> None:
    rng = np.random.default_rng(7)
    insts = [_inst(f"p{i}", "prefill", node=f"n{i % 3}") for i in range(7)]
    cands = CandidateSet.of(insts)
    locations = [i.instance_id for i in insts] + ["n0", "n1", "n2", GLOBAL]
    keys = [bytes([i]) * 16 for i in range(40)]
    pv = PrefixView(initial_rows=4)
    truth: dict[tuple[str, bytes], set[int]] = {}
    for _ in range(300):
        loc = locations[rng.integers(len(locations))]
        tier = int(rng.integers(4))
        lo = int(rng.integers(40))
        span = keys[lo:lo + int(rng.integers(1, 12))]
        kind = "stored" if rng.random() < 0.7 else "evicted"
        pv.apply_event(kind, loc, f"G{tier + 1}", span)
        for k in span:
            held = truth.setdefault((loc, k), set())
            if kind == "stored":
                held.add(tier)
            else:
                held.discard(tier)
    got = pv.match_candidates(keys, cands)
    for c, inst in enumerate(insts):
        expect = [0, 0, 0, 0]
        for k in keys:
            tiers = set()
            for loc in (inst.instance_id, inst.node, GLOBAL):
                tiers |= truth.get((loc, k), set())
            if not tiers:
                break
            expect[min(tiers)] += 1
        assert got[c].tolist() == expect, inst.instance_id
