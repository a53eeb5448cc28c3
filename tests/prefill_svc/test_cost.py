"""The cost-aware fetch rule: fetch a tier only when it beats recomputing."""

from __future__ import annotations

import pytest

from service.config import CostConfig
from service.cost import CostModel

MB = 1_000_000


def _model(tps: float = 1000.0, **bw: float) -> CostModel:
    bandwidth = {"G2": 5e9, "G3": 1e9, "G4": 0.1e9, **bw}
    cfg = CostConfig(tier_bandwidth_Bps=bandwidth,
                     tier_latency_s={"G2": 0.0005, "G3": 0.002, "G4": 0.05},
                     prefill_tokens_per_s=tps)
    return CostModel(cfg, block_nbytes=4 * MB, block_tokens=64)


def test_fast_tier_is_fetched() -> None:
    plan = _model().plan(["G2"] * 10, 0, 10)
    assert plan.kind == "fetch" and plan.fetch_blocks == 10
    assert plan.tier_blocks == {"G2": 10}
    assert plan.fetch_s == pytest.approx(0.0005 + 40 * MB / 5e9)
    assert plan.recompute_s == pytest.approx(640 / 1000)
    assert plan.decision == "fetch G2"


def test_slow_tier_is_recomputed_when_compute_is_fast() -> None:
    # 4 MB per 64 tokens from G4 at 0.1 GB/s = 40 ms; recompute at 100k tok/s = 0.64 ms.
    plan = _model(tps=100_000).plan(["G4"] * 8, 0, 8)
    assert plan.kind == "recompute" and plan.fetch_blocks == 0
    assert plan.decision == "recompute"


def test_prefix_cut_where_the_slow_tier_starts() -> None:
    # G2 blocks are worth it, the G4 tail is not (recompute 64 tokens at 10k tok/s = 6.4 ms
    # vs 40 ms per G4 block).
    plan = _model(tps=10_000).plan(["G2"] * 5 + ["G4"] * 5, 0, 10)
    assert plan.kind == "partial" and plan.fetch_blocks == 5
    assert plan.tier_blocks == {"G2": 5}
    assert plan.decision.startswith("fetch G2 (5 blocks), recompute 5")


def test_plan_starts_after_g1_and_stops_at_the_hit_rule() -> None:
    plan = _model().plan(["G2"] * 10, 3, 7)
    assert (plan.start_block, plan.end_block, plan.fetch_blocks) == (3, 7, 4)
    assert _model().plan(["G2"] * 4, 6, 9).kind == "none"      # G1 already covers more


def test_measurements_move_the_estimates() -> None:
    m = _model(tps=1000.0)
    m.observe_prefill(6400, 1.0, calibrate=True)
    assert m.snapshot().prefill_tokens_per_s == pytest.approx(6400)
    m.observe_prefill(10, 1.0)                       # below one block: overhead, ignored
    assert m.snapshot().prefill_tokens_per_s == pytest.approx(6400)
    # A G3 that turns out 10x slower than its prior flips the decision.
    before = m.plan(["G3"] * 4, 0, 4).kind
    for _ in range(20):
        m.observe_fetch({"G3": 4}, 16 * MB, 16 * MB / 0.1e9)
    assert m.snapshot().bandwidth_Bps["G3"] == pytest.approx(0.1e9, rel=0.05)
    assert (before, m.plan(["G3"] * 4, 0, 4).kind) == ("fetch", "recompute")


def test_unknown_tier_costs_like_the_slowest() -> None:
    m = _model(tps=100_000)
    assert m.plan(["G9"] * 4, 0, 4).kind == m.plan(["G4"] * 4, 0, 4).kind == "recompute"


def test_config_is_validated() -> None:
    with pytest.raises(ValueError, match="same tiers"):
        CostConfig(tier_bandwidth_Bps={"G2": 1.0}, tier_latency_s={"G3": 0.0})
    with pytest.raises(ValueError, match="prefill_tokens_per_s"):
        CostConfig(prefill_tokens_per_s=0)
