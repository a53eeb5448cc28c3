"""``kvserve bench stack``'s arithmetic: the limits (quadratic prefill fit, the
compute of a request's misses, the decode roofline and the batch a TPOT SLO
allows), AIPerf's per-request export read back, the phase figures from records
and counters, and the AIPerf command lines of the two phases."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.stack_aiperf import AIPerf, Phase, Record, command, parse_records
from benchmarks.stack_figures import decode_figures, prefill_figures, queue_line, queue_split
from benchmarks.stack_limits import Limits, fit_quadratic, model_config, weight_bytes


def _limits(**kw: float) -> Limits:
    base = dict(device="test", model="m", dtype="bfloat16", h2d_gbps=50.0, copy_gbps=4000.0,
                prefill_s={}, fit_a=1e-5, fit_b=1e-10, weight_bytes=16 * 10**9,
                kv_bytes_per_token=131072)
    return Limits(**{**base, **kw})  # type: ignore[arg-type]


def test_fit_recovers_linear_and_quadratic_terms() -> None:
    a, b = 3e-5, 2e-10
    pts = [(float(t), a * t + b * t * t) for t in (1024, 4096, 16384)]
    fa, fb = fit_quadratic(pts)
    assert fa == pytest.approx(a, rel=1e-6) and fb == pytest.approx(b, rel=1e-6)
    # Noise that would make a term negative falls back to the linear fit, never < 0.
    fa, fb = fit_quadratic([(128.0, 1.0), (512.0, 1.1)])
    assert fa > 0 and fb == 0.0


def test_miss_time_is_the_suffix_against_the_whole_prompt() -> None:
    lim = _limits()
    assert lim.miss_time(8000, 0) == pytest.approx(lim.prefill_time(8000))
    assert lim.miss_time(8000, 8000) == 0.0
    # 100 new tokens after 7,900 cached cost more than 100 tokens alone (they attend
    # to all 8,000), less than the whole prompt.
    assert lim.prefill_time(100) < lim.miss_time(8000, 7900) < lim.prefill_time(8000)
    assert lim.miss_time(100, 500) == 0.0             # cached beyond the prompt: nothing


def test_roofline_and_slo_batch() -> None:
    lim = _limits()
    one = lim.decode_roofline(1, 2048)
    assert one == pytest.approx(4000e9 / (16e9 + 2048 * 131072))
    assert lim.decode_roofline(64, 2048) > 30 * one   # weights shared by the batch
    # The SLO batch's step fits the SLO; one more would not (unless capped).
    b = lim.slo_batch(0.01, 2048, 1000)
    step = lambda n: (16e9 + n * 2048 * 131072) / 4000e9  # noqa: E731
    assert step(b) <= 0.01 < step(b + 1)
    assert lim.slo_batch(0.05, 2048, 64) == 64 and lim.slo_batch(1e-4, 2048, 64) == 1


def test_weight_bytes_of_llama_8b_shape() -> None:
    cfg = model_config("llama-8b-shape")
    # 32 layers of 218.1 M weights + the LM head (128,256 x 4,096), bf16: ~15.0 GB.
    assert weight_bytes(cfg, 2) == pytest.approx(15.0e9, rel=0.01)


def _record(start_ns: int, ttft_ms: float, prompt: int, cached: int, out: int = 16,
            error: object = None) -> str:
    m = {"time_to_first_token": {"value": ttft_ms, "unit": "ms"},
         "usage_prompt_tokens": {"value": prompt, "unit": "tokens"},
         "usage_prompt_cache_read_tokens": {"value": cached, "unit": "tokens"},
         "usage_completion_tokens": {"value": out, "unit": "tokens"},
         "inter_token_latency": {"value": 8.0, "unit": "ms"}}
    doc = {"metadata": {"request_start_ns": start_ns, "request_end_ns": start_ns + 10**9,
                        "was_cancelled": False}, "metrics": m}
    if error:
        doc = {**doc, "error": error, "metrics": {}}
    return json.dumps(doc)


def test_records_and_prefill_figures() -> None:
    lines = [_record(0, 100.0, 8000, 0), _record(10**9, 50.0, 8064, 7936),
             _record(2 * 10**9, 0.0, 100, 0, error={"code": 500, "message": "boom"}), ""]
    recs = parse_records(lines)
    assert [r.ok for r in recs] == [True, True, False] and "boom" in recs[2].error
    assert recs[1].first_token_s == pytest.approx(1.05) and recs[1].itl_s == 0.008
    lim = _limits()
    prefill = {"kvserve_prefill_prefill_warehouse_tokens_total": 7936.0,
               "kvserve_prefill_prefill_g1_tokens_total": 0.0,
               "kvserve_prefill_prefill_computed_tokens_total": 8128.0,
               "kvserve_prefill_prefill_step_seconds_total": 0.42}
    decode = {"kvserve_decode_decode_pull_bytes_total": 4e9,
              "kvserve_decode_decode_pull_seconds_total": 2.0}
    f = prefill_figures(recs, lim, prefill, decode)
    assert (f["requests"], f["errors"], f["prompt_tokens"]) == (3, 1, 16064)
    assert f["span_s"] == pytest.approx(1.05)              # first sent -> last first token
    assert f["effective_prefill_tps"] == pytest.approx(16064 / 1.05)
    compute = lim.miss_time(8000, 0) + lim.miss_time(8064, 7936)
    pcie = 7936 * 131072 / 50e9
    assert f["limit_compute_s"] == pytest.approx(compute)
    assert f["limit_pcie_s"] == pytest.approx(pcie)
    assert f["vs_limit"] == pytest.approx((16064 / 1.05) / (16064 / (compute + pcie)))
    assert f["decode_pull_gbps"] == pytest.approx(2.0)
    # Prefill computed 0.42 s of the 1.05-s phase: the figure is not prefill-bound.
    assert f["prefill_busy_s"] == pytest.approx(0.42)
    assert f["prefill_busy_fraction"] == pytest.approx(0.42 / 1.05)


def test_decode_figures_use_the_batch_the_server_ran() -> None:
    recs = [Record(True, 0.0, 2.0, 0.2, 2048, 0, 128, 0.010),
            Record(True, 0.1, 2.1, 0.2, 2048, 0, 128, 0.012)]
    delta = {"kvserve_decode_batch_steps_total": 100.0,
             "kvserve_decode_batch_tokens_total": 3200.0}
    f = decode_figures(recs, _limits(), delta, batch=32, context=2048, tokens=128,
                       slo_tpot_s=0.05)
    assert f["mean_batch"] == 32.0 and f["itl_p50_s"] == pytest.approx(0.011)
    assert f["decode_tps"] == pytest.approx(32 / 0.011)
    assert f["roofline_tps"] == pytest.approx(_limits().decode_roofline(32, 2048 + 64))
    assert f["tpot_met"] == 1.0 and f["errors"] == 0


def test_phase_command_lines() -> None:
    tool = AIPerf(("python3", "-m", "aiperf"), "/tmp/site")
    tok = Path("/tok")
    fixed = command(tool, Phase("agent", Path("a.jsonl"), 40), "http://h:1", "m", Path("o"), tok)
    assert "--fixed-schedule" in fixed and "--concurrency" not in fixed
    assert {"--use-server-token-count", "--streaming", "--no-gpu-telemetry"} <= set(fixed)
    assert fixed[fixed.index("--tokenizer") + 1] == "/tok"
    conc = command(tool, Phase("decode", Path("d.jsonl"), 64, concurrency=32), "http://h:1",
                   "m", Path("o"), tok)
    assert conc[conc.index("--concurrency") + 1] == "32" and "--no-fixed-schedule" in conc
    env = tool.env(3, Path("/scratch"))
    assert env["PYTHONPATH"] == "/tmp/site" and "HF_HUB_OFFLINE" not in env
    assert env["AIPERF_DATASET_MMAP_CACHE_ENABLED"] == "false"


def test_byte_tokenizer_for_aiperf_matches_the_engines(tmp_path: Path) -> None:
    """The tokenizer AIPerf loads for a byte-level shape gives the engine's ids."""
    from tokenizers import Tokenizer

    from benchmarks.stack_aiperf import tokenizer_dir
    from engine.tokenizer import ByteTokenizer

    d = tokenizer_dir("llama-8b-shape", tmp_path)
    tok = Tokenizer.from_file(str(d / "tokenizer.json"))
    text = "agents, tools: ünïcode \n and bytes"
    assert tok.encode(text).ids == ByteTokenizer(128_256).encode(text)
    assert tok.decode(tok.encode(text).ids) == text
    assert json.loads((d / "tokenizer_config.json").read_text())["tokenizer_class"]


def test_decode_step_breakdown_from_the_batchers_counters() -> None:
    from benchmarks.stack_figures import step_breakdown

    p = "kvserve_decode_batch_"
    delta = {f"{p}step_seconds_sum": 4.0, f"{p}step_seconds_count": 10.0,
             f"{p}step_wait_seconds_total": 0.5, f"{p}step_forward_seconds_total": 0.1,
             f"{p}step_sample_seconds_total": 3.0, f"{p}step_read_seconds_total": 0.2,
             f"{p}step_chunk_seconds_total": 0.05, f"{p}step_wait_jobs_seconds_total": 0.3}
    b = step_breakdown(delta)
    assert b["step_wait_jobs_ms"] == pytest.approx(30.0)       # of the wait, not beside it
    assert "step_forward_p50_ms" not in b                      # no buckets scraped
    # The forwards' buckets (cumulative, as scraped with their le label): 6 of 10
    # at most 7 ms, 9 at most 12 ms, one past it: p50 in the 7-ms bucket, p90 12 ms.
    h = f"{p}forward_seconds_bucket"
    delta |= {f"{h}:0.006": 2.0, f"{h}:0.007": 6.0, f"{h}:0.012": 9.0, f"{h}:+Inf": 10.0,
              h: 27.0}      # the scrape's sum over every bucket, under the bare name
    b = step_breakdown(delta)
    assert (b["step_forward_p10_ms"], b["step_forward_p50_ms"]) == pytest.approx((6.0, 7.0))
    assert b["step_forward_p90_ms"] == pytest.approx(12.0)
    assert b["step_ms"] == pytest.approx(400.0) and b["step_sample_ms"] == pytest.approx(300.0)
    assert b["step_loop_ms"] == pytest.approx(400.0 - 50 - 10 - 300 - 20 - 5)
    assert step_breakdown({}) == {}


def test_queue_split_per_request_and_its_report_line() -> None:
    prefill = {"kvserve_prefill_prefill_admitted_total": 4.0,
               "kvserve_prefill_prefill_queue_wait_s_total": 2.0,
               "kvserve_prefill_prefill_queue_split_seconds_total": 1.9,
               "kvserve_prefill_prefill_queue_split_seconds_total:warm": 0.4,
               "kvserve_prefill_prefill_queue_split_seconds_total:pool": 1.2,
               "kvserve_prefill_prefill_queue_split_seconds_total:engine": 0.3,
               "kvserve_prefill_prefill_demote_seconds_total": 0.25}
    router = {"kvserve_router_queue_wait_seconds_sum": 3.0,
              "kvserve_router_queue_wait_seconds_count": 6.0}
    q = queue_split(prefill, router)
    assert q["prefill_admitted"] == 4 and q["prefill_queue_s"] == pytest.approx(0.5)
    assert (q["prefill_queue_warm_s"], q["prefill_queue_pool_s"],
            q["prefill_queue_engine_s"]) == pytest.approx((0.1, 0.3, 0.075))
    assert q["prefill_queue_held_s"] == q["prefill_queue_budget_s"] == 0.0
    assert q["prefill_demote_s_total"] == 0.25 and q["router_queue_s"] == pytest.approx(0.5)
    line = queue_line(q)
    assert line.startswith("a turn waited 0.500 s in the router's admission; ")
    assert "4 requests 0.500 s = warm 0.100, pool 0.300, held 0.000" in line
    assert queue_split({})["prefill_queue_s"] == 0.0 and "router_queue_s" not in queue_split({})


def test_stack_config_carries_the_gpu_share(tmp_path: Path) -> None:
    import argparse

    from benchmarks import commands, stack
    from common.config import ConfigError, KVServeConfig

    p = argparse.ArgumentParser()
    commands._stack(p)
    path = tmp_path / "stack.toml"
    path.write_text(stack._config(p.parse_args(["--gpu-share", "mps",
                                                "--prefill-sm-percent", "70"])))
    eng = KVServeConfig.load(str(path)).engine
    assert (eng.gpu_share, eng.prefill_sm_percent, eng.decode_sm_percent) == ("mps", 70, 0)
    # The default is the driver's time slicing, and a cap without MPS is refused.
    path.write_text(stack._config(p.parse_args([])))
    assert KVServeConfig.load(str(path)).engine.gpu_share == "time"
    with pytest.raises(ConfigError, match=r"needs engine\.gpu_share"):
        stack._config(p.parse_args(["--decode-sm-percent", "30"]))
