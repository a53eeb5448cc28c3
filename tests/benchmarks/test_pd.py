"""``kvserve bench pd``: both modes run end to end on tiny sizes, and the GPU
mode refuses a machine without CUDA with a clear message."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch


def _bench(*args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvserve.cli", "bench", "pd", *args],
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a CPU machine")
def test_gpu_mode_on_cpu_fails_clearly() -> None:
    res = _bench("--model", "llama-8b-shape", "--device", "cuda")
    assert res.returncode == 2
    assert "needs a CUDA GPU" in res.stderr and "Traceback" not in res.stderr


def test_inproc_restore_bench_runs_on_tiny_sizes(tmp_path: Path) -> None:
    res = _bench("--inproc", "--model", "tiny-dense", "--lengths", "256,1000",
                 "--prefill-chunk", "64", "--json", "--png", str(tmp_path / "c.png"),
                 "--g3-dir", str(tmp_path))
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    rows = [(r["tokens"], r["hit_fraction"], r["cached_tokens"]) for r in out["lengths"]]
    # 90 % and 99 % of the prompt, in whole 64-token blocks, were restored
    assert rows == [(256, 0.9, 192), (256, 0.99, 192), (1000, 0.9, 896), (1000, 0.99, 960)]
    assert all(r["restore_bytes"] > 0 and r["memcpy_GBps"] > 0 for r in out["lengths"])
    assert all(d["decision"] for d in out["disk_only"])
    assert (tmp_path / "c.png").stat().st_size > 0


def test_services_bench_runs_a_short_conversation(tmp_path: Path) -> None:
    cfg = tmp_path / "kvserve.toml"
    cfg.write_text("[blocks]\nblock_tokens = 16\n")
    res = _bench("--model", "tiny-dense", "--config", str(cfg), "--turns", "2",
                 "--max-tokens", "6", "--tool-lines", "1", "--json", "--png", "")
    assert res.returncode == 0, res.stderr
    turns = json.loads(res.stdout)["turns"]
    assert [t["turn"] for t in turns] == [1, 2]
    assert turns[0]["cached_tokens"] == 0
    assert all(t["identical"] for t in turns)
    # Zero think time: turn 2 gets the hit rule on turn 1's prompt + output,
    # unless the cost rule (rightly, for a model this small) chose to recompute;
    # tests/decode_svc/test_disaggregated.py checks it with fetches forced.
    t2 = turns[1]
    assert t2["rule_tokens"] > 0, t2
    assert t2["rule_met"] or t2["fetch_decision"].startswith("recompute"), t2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_inproc_restore_bench_on_the_gpu(tmp_path: Path) -> None:
    res = _bench("--device", "cuda", "--model", "tiny-dense", "--lengths", "512,1000",
                 "--prefill-chunk", "256", "--json", "--png", "", "--g3-dir", str(tmp_path))
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert out["device"] == "cuda" and len(out["lengths"]) == 4
    assert all(r["restore_vs_peak"] > 0 and r["ttft_hit_s"] > 0 for r in out["lengths"])
