"""``kvserve bench vllm-trace``'s arithmetic that needs no vLLM server: the KV
budget in tokens the returning-session probe flushes past, and the ratios it
reports (connector over alone)."""

from __future__ import annotations

from benchmarks.vllm_trace import AnswerProbe, TraceRun, comparison, kv_bytes_per_token


def test_kv_bytes_per_token_of_smollm2(smollm2_dir: str) -> None:
    # 30 layers x 3 KV heads x 64 dims x (K, V) x fp32: a 64-token block is the
    # warehouse's 2,949,120 bytes (docs/vllm.md).
    assert kv_bytes_per_token(smollm2_dir) == 46_080
    assert kv_bytes_per_token(smollm2_dir) * 64 == 2_949_120


def _run(label: str, p50: float, p90: float, p99: float, goodput: float) -> TraceRun:
    return TraceRun(label, 48, 0, p50, p90, p99, 0.1, goodput, 100.0, 0.5, "raw.json",
                    answer_probe=AnswerProbe(960, 129, 8738, 1088, 128))


def test_comparison_is_the_second_run_over_the_first() -> None:
    alone, connector = _run("vllm", 10.0, 40.0, 80.0, 0.1), _run("vllm+kvserve", 1.0, 8.0,
                                                                  20.0, 0.3)
    [line] = comparison([alone, connector])
    assert line == ("vllm+kvserve / vllm: TTFT p50 0.10 x, p90 0.20 x, p99 0.25 x, "
                    "goodput 3.00 x")
    assert comparison([alone]) == []
