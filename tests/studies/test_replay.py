"""Cluster replay through the placement policies and simulated stores, on
subsamples of the shared traces (kept small: the full runs are in
docs/BENCHMARKS.md)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from common.traces import load_trace, rebin
from kvserve.cli import main
from studies.replay import (
    ReplayConfig,
    arrival_times,
    calibrate_load,
    policy_kind,
    replay_cluster,
    simulate,
)
from studies.replay_cost import DESIGN_POINTS, CostModel, CostModelError
from tests.shared_data import shared_dir

TRACES = shared_dir() / "traces"
MOONCAKE = TRACES / "mooncake-fast25" / "conversation_trace.jsonl"
AGENTS = TRACES / "weka-claude-code" / "traces.tar.xz"
needs_traces = pytest.mark.skipif(not MOONCAKE.is_file() or not AGENTS.is_file(),
                                  reason="shared traces absent")


@needs_traces
def test_conversation_trace_cache_aware_beats_round_robin() -> None:
    trace = load_trace(MOONCAKE, max_requests=1000)
    cfg = ReplayConfig(instances=4, capacity_tokens=(1_000_000,))
    results, calib = replay_cluster(trace, ["round_robin", "cache_aware"], cfg)
    assert calib is not None and calib.reached
    assert abs(calib.utilization - 0.7) < 0.02
    rr, ca = results
    assert rr.load == ca.load == calib.load                        # same offered load
    assert ca.hit_rate > rr.hit_rate
    assert ca.ttft_p90_s * 2 < rr.ttft_p90_s
    assert ca.utilization < rr.utilization                         # less work for the same load
    assert sum(i.requests for i in ca.per_instance) == len(trace.requests)
    assert rr.imbalance >= 1.0


@needs_traces
def test_agent_sessions_keep_their_affinity() -> None:
    trace = rebin(load_trace(AGENTS, max_sessions=10, seed=3), 512)
    cfg = ReplayConfig(instances=4, load=200.0)
    rr = simulate(trace, "round_robin", cfg, 200.0)
    ca = simulate(trace, "cache_aware", cfg, 200.0)
    assert ca.hit_rate > rr.hit_rate + 0.05
    assert ca.ttft_p90_s < rr.ttft_p90_s


@needs_traces
def test_session_arrivals_keep_each_sessions_own_timing() -> None:
    trace = load_trace(AGENTS, max_sessions=6, seed=1)
    base = arrival_times(trace, 1.0)
    fast = arrival_times(trace, 10.0)
    sessions = np.array([r.session.split("/")[0] for r in trace.requests])
    for s in set(sessions.tolist()):
        idx = np.flatnonzero(sessions == s)
        assert np.diff(fast[idx]) == pytest.approx(np.diff(base[idx]))   # think time kept
    starts = sorted(base[sessions == s].min() for s in set(sessions.tolist()))
    fast_starts = sorted(fast[sessions == s].min() for s in set(sessions.tolist()))
    assert np.diff(fast_starts) == pytest.approx(np.diff(starts) / 10.0)


def test_cost_model_fits_design_points_and_reads_files(tmp_path: Path) -> None:
    m = CostModel.default()
    for tokens, seconds in DESIGN_POINTS:
        assert m.compute_s(tokens, 0) == pytest.approx(seconds, rel=0.02)
    assert m.compute_s(32768, 32000) < 0.1 * m.compute_s(32768, 0)
    assert m.tier_usable(0) and not m.tier_usable(1)                 # disk slower than compute
    bench = tmp_path / "bench.json"
    bench.write_text(json.dumps({"rows": [{"prompt_tokens": 512, "cold_ttft_s": 0.8},
                                          {"prompt_tokens": 1024, "cold_ttft_s": 1.7},
                                          {"prompt_tokens": 2048, "cold_ttft_s": 3.8}]}))
    fitted = CostModel.from_json(bench)
    assert fitted.compute_s(1024, 0) == pytest.approx(1.7, rel=0.05)
    bench.write_text(json.dumps({"nothing": 1}))
    with pytest.raises(CostModelError, match="no cost model"):
        CostModel.from_json(bench)


def test_policy_names_cover_routing_and_eviction() -> None:
    assert policy_kind("cache_aware") == "router"
    assert policy_kind("belady") == "eviction"
    with pytest.raises(ValueError, match=r"routing policies .*eviction policies"):
        policy_kind("fifo-ish")


@needs_traces
def test_cli_cluster_and_cache_modes(capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["replay", "--trace", str(MOONCAKE), "--policy", "cache_aware", "--instances", "3",
               "--max-requests", "300", "--load", "2", "--json"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    for key in ("hit_rate", "token_hit_rate", "ttft_p50_s", "ttft_p90_s", "ttft_p99_s",
                "imbalance", "per_instance"):
        assert key in out
    assert len(out["per_instance"]) == 3 and out["load"] == 2.0
    rc = main(["replay", "--trace", str(MOONCAKE), "--policy", "belady",
               "--max-requests", "300", "--capacity-tokens", "200000", "--json"])
    assert rc == 0
    cache = json.loads(capsys.readouterr().out)
    assert cache["mode"] == "cache" and 0 < cache["hit_rate"] <= 1
    assert 0 < cache["token_hit_rate"] <= 1
    assert main(["replay", "--trace", str(MOONCAKE), "--policy", "nope"]) == 2
    err = capsys.readouterr().err
    assert "round_robin" in err and "belady" in err


@needs_traces
def test_calibration_reports_an_unreachable_target() -> None:
    trace = rebin(load_trace(AGENTS, max_sessions=3, seed=0), 512)
    calib = calibrate_load(trace, ReplayConfig(instances=8))
    assert not calib.reached and calib.utilization < 0.7


def test_bench_router_smoke(capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["bench", "router", "--instances", "8", "--prompt-tokens", "2048",
               "--decisions", "200", "--cpu", "-1", "--json"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    for key in ("decisions_per_s", "p99_ms", "tokenize_ms_p50"):
        assert out[key] > 0
