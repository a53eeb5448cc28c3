"""The live what-if estimator against replays of the same and of held-out traffic."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest

from kvstore.whatif import WhatIfEstimator, fit_trace
from kvstore.whatif_bins import FenwickTree, rt_bin, rt_position
from studies.sim import replay_cache
from tests.kvstore.simtrace import make_trace, random_prefix_trace

TTLS = [5.0, 20.0, 60.0, 100.0, 1000.0, math.inf]


def _all(rows: list, ttl: float, cap: float = math.inf):
    return next(r for r in rows if r.cls == "all" and r.ttl_s == ttl and r.capacity_tokens == cap)


def test_bins_are_closed_on_the_right() -> None:
    # A reuse exactly TTL seconds later is a hit (the store keeps it until then).
    assert rt_bin(10.0) == 9 and rt_position(10.0) == 10.0 and rt_bin(10.001) == 10
    f = FenwickTree(8)
    for i, v in enumerate([1, 2, 3, 4]):
        f.add(i, v)
    assert (f.range_sum(1, 3), f.prefix(4)) == (5, 10)


def test_ttl_predictions_equal_replay_without_sampling() -> None:
    tr = random_prefix_trace(3, sessions=40, think_s=40.0)
    rows = fit_trace(tr).predict(TTLS, [None])
    for ttl in TTLS:
        st = replay_cache(tr, ttl_s=ttl)
        row = _all(rows, ttl)
        assert row.hit_rate == pytest.approx(st.hit_rate, abs=1e-9), ttl
        assert row.token_hit_rate == pytest.approx(st.token_hit_rate, abs=1e-9), ttl
        assert row.bytes_mean == pytest.approx(st.bytes_mean, rel=0.02), ttl
        assert row.policy == "lru" and row.bytes_peak >= row.bytes_mean


def test_capacity_predictions_follow_lru_stack_distance() -> None:
    # A cycle over 10 single-block requests: LRU hits all (after the first lap)
    # iff it holds all 10 blocks, none if it holds fewer.
    tr = make_trace([(i, [i % 10]) for i in range(100)])
    rows = fit_trace(tr).predict([math.inf], [36, 40, None])
    assert [_all(rows, math.inf, c).hit_rate for c in (36, 40, math.inf)] == [0.0, 0.9, 0.9]
    tr = random_prefix_trace(4, sessions=60, think_s=20.0)
    unique = len({h for r in tr.requests for h in r.hash_ids}) * tr.block_tokens
    caps = [unique // 8, unique // 4, unique // 2]
    rows = fit_trace(tr).predict([math.inf], caps)
    for cap in caps:
        st = replay_cache(tr, capacity_tokens=cap)
        assert _all(rows, math.inf, cap).hit_rate == pytest.approx(st.hit_rate, abs=0.02), cap


def test_partial_tails_count_as_misses() -> None:
    tr = make_trace([(0, [1, 2]), (1, [1, 2])], tail=3)
    est = fit_trace(tr)
    row = _all(est.predict([math.inf], [None]), math.inf)
    st = replay_cache(tr)
    assert (row.hit_rate, row.token_hit_rate) == (st.hit_rate, st.token_hit_rate) == (0.25, 4 / 14)


def test_json_round_trip_predicts_the_same() -> None:
    tr = random_prefix_trace(5, sessions=30, classes=("chat", "agent"))
    est = fit_trace(tr)
    text = est.to_json()
    doc = json.loads(text)
    assert set(doc["classes"]) == {"agent", "chat"}
    again = WhatIfEstimator.from_json(text)
    a = est.predict(TTLS, [100, None])
    b = again.predict(TTLS, [100, None])
    assert [r.as_json() for r in a] == [r.as_json() for r in b]
    assert {r.cls for r in a} == {"agent", "chat", "all"}
    keys = {"class", "ttl_s", "capacity_tokens", "policy", "hit_rate", "token_hit_rate",
            "bytes_peak", "bytes_mean", "hit_rate_bound"}
    assert set(a[0].as_json()) == keys
    assert json.loads(json.dumps(a[-1].as_json()))["ttl_s"] is None     # inf -> null
    with pytest.raises(ValueError, match="not a what-if estimator state"):
        WhatIfEstimator.from_json('{"format": 1}')


def test_fit_on_one_half_predicts_the_other() -> None:
    # A stationary workload split by session: what the store learned from one
    # half of the users predicts the other half's replayed hit rate.
    tr = random_prefix_trace(11, sessions=500, turns=8, rate_s=0.2, think_s=60.0)
    half = [replace(tr, requests=tuple(r for r in tr.requests if int(r.session[1:]) % 2 == k))
            for k in (0, 1)]
    rows = fit_trace(half[0]).predict(TTLS, [None])
    for ttl in TTLS:
        replayed = replay_cache(half[1], ttl_s=ttl).hit_rate
        assert abs(_all(rows, ttl).hit_rate - replayed) <= 0.01, ttl


def test_sampling_bounds_memory_and_stays_close() -> None:
    tr = random_prefix_trace(6, sessions=300, turns=8, think_s=60.0)
    unique = len({h for r in tr.requests for h in r.hash_ids})
    # Hundreds of sampled blocks only (a real store samples tens of thousands).
    est = fit_trace(tr, estimator=WhatIfEstimator(max_tracked=unique // 4))
    assert est.rate < 0.5 and est._sampled <= unique // 4
    exact = fit_trace(tr).predict(TTLS, [None])
    rows = est.predict(TTLS, [None])
    for ttl in TTLS:
        assert _all(rows, ttl).hit_rate == pytest.approx(_all(exact, ttl).hit_rate, abs=0.03)


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="max_tracked"):
        WhatIfEstimator(max_tracked=1)


def test_prediction_reports_a_bound_that_covers_the_replay() -> None:
    tr = random_prefix_trace(11, sessions=60, think_s=20.0)
    est = fit_trace(tr)
    for ttl in (5.0, 20.0, 60.0, float("inf")):
        (row,) = [r for r in est.predict([ttl], [None]) if r.cls == "all"]
        assert 0.0 <= row.hit_rate_bound < 0.2
        assert "hit_rate_bound" in row.as_json()
        truth = replay_cache(tr, ttl_s=ttl).hit_rate
        assert abs(row.hit_rate - truth) <= row.hit_rate_bound + 1e-9, (ttl, row, truth)
