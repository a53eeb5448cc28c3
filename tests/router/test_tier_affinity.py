"""Tier-aware affinity: credits from measured costs, and the ranking they give
(G2 holder > G4 fetch > recompute) on a view fed by KV events."""

from __future__ import annotations

import pytest

from kvstore.registry import InstanceInfo
from router.placement import Placer, PolicyConfig, make_router_policy
from router.view import GLOBAL, CandidateSet, PrefixView

COSTS = ({"G2": 4e9, "G3": 2e9, "G4": 1e9}, {"G2": 1e-4, "G3": 2e-3, "G4": 0.02})


def test_credits_follow_measured_costs() -> None:
    # 1 MiB blocks of 64 tokens at 10k tok/s: recompute 6.4 ms per block.
    cfg = PolicyConfig.from_costs(*COSTS, block_bytes=2**20, block_tokens=64,
                                  prefill_tokens_per_s=10_000, fetch_blocks=10)
    g1, g2, g3, g4 = cfg.tier_credit
    assert g1 == 1.0
    assert g2 == pytest.approx(1 - (1e-5 + 2**20 / 4e9) / 6.4e-3)
    assert g4 == pytest.approx(1 - (2e-3 + 2**20 / 1e9) / 6.4e-3)
    assert g2 > g3 > g4 > 0
    # A slower store than recompute earns nothing; a tier never beats a faster one.
    slow = PolicyConfig.from_costs({"G2": 4e9, "G3": 5e9, "G4": 1e7},
                                   {"G2": 1e-4, "G3": 1e-4, "G4": 0.04}, block_bytes=2**20,
                                   block_tokens=64, prefill_tokens_per_s=10_000)
    assert slow.tier_credit[3] == 0.0 and slow.tier_credit[2] == slow.tier_credit[1]
    with pytest.raises(ValueError, match="must be > 0"):
        PolicyConfig.from_costs(*COSTS, block_bytes=0, block_tokens=64,
                                prefill_tokens_per_s=1.0)


def test_g2_holder_beats_g4_fetch_beats_recompute() -> None:
    cfg = PolicyConfig.from_costs(*COSTS, block_bytes=2**20, block_tokens=64,
                                  prefill_tokens_per_s=10_000, fetch_blocks=10)
    keys = [bytes([i]) * 16 for i in range(10)]
    view = PrefixView()
    view.apply_event("stored", "node-a", "G2", keys)       # node A computed it ...
    view.apply_event("stored", GLOBAL, "G4", keys)         # ... and wrote it to G4
    infos = [InstanceInfo(instance_id=i, role="prefill", address="x:1", node=n)
             for i, n in (("pa", "node-a"), ("pb", "node-b"), ("pc", ""))]
    cands = CandidateSet.of(infos)
    placer = Placer(make_router_policy("cache_aware", cfg), view)
    d = placer.place_prefill(cands, keys, 10 * 64 + 1)
    assert d.instance_id == "pa"
    s = d.scores
    assert s["pa"] > s["pb"] > 0                            # G4 fetch still beats nothing
    assert s["pb"] == pytest.approx(10 * 64 * cfg.tier_credit[3])
    # Node A busy by more than the difference: the G4 reader wins; by less: A keeps it.
    gap = s["pa"] - s["pb"]
    busy = CandidateSet.of(infos, {"pa": gap + 1})
    assert placer.place_prefill(busy, keys, 10 * 64 + 1).instance_id == "pb"
    calm = CandidateSet.of(infos, {"pa": gap - 1})
    assert placer.place_prefill(calm, keys, 10 * 64 + 1).instance_id == "pa"
