"""``kvserve bench store`` runs end to end on tiny sizes and reports every row."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.redis_args import redis_args

KEYS = ("g2_put_gbps", "g2_get_gbps", "memcpy_gbps", "g3_write_gbps", "g3_read_gbps",
        "raw_write_gbps", "raw_read_gbps", "redis_put_gbps", "redis_get_gbps",
        "lookup_p50_ms", "lookup_p99_ms", "grpc_gbps", "grpc_put_gbps", "shm_gbps",
        "shm_put_gbps", "verified_copy_gbps", "shm_get_vs_memcpy", "ack_g2_put_gbps",
        "ack_durable_put_gbps", "ack_durable_vs_g2", "lanes1_put_gbps", "lanes4_put_gbps",
        "lanes4_vs_1",
        "plain_gbps", "plain_put_gbps", "tls_put_ratio", "tls_get_ratio")  # mTLS vs plain


def test_bench_store_json(redis_url: str, tmp_path: Path) -> None:
    png = tmp_path / "bench.png"
    out = subprocess.run(
        [sys.executable, "-m", "kvserve.cli", "bench", "store", "--json", "--blocks", "4",
         "--block-bytes", "65536", "--repeats", "1", "--chain", "64", "--lookups", "5",
         *redis_args(redis_url), "--dir", str(tmp_path), "--png", str(png)],
        capture_output=True, text=True, timeout=240, check=True)
    res = json.loads(out.stdout)
    for k in KEYS:
        assert isinstance(res[k], float) and res[k] > 0, k
    assert res["lookup_p50_ms"] <= res["lookup_p99_ms"]
    assert {g["metric"] for g in res["goals"].values()} >= {"g3_write_gbps", "shm_gbps",
                                                            "lookup_p99_ms", "grpc_gbps"}
    assert png.stat().st_size > 1000
