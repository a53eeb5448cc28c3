"""The rows ``kvserve bench store --redis-cluster N`` and ``--g4 URL`` add,
on the session's cluster and moto server with tiny sizes."""

from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest

from benchmarks.store_cluster import _lookups, _memory, bench_g4
from kvstore.redis_cluster import EmbeddedRedisCluster
from kvstore.tiers.objstore import OPTIONS_ENV
from tests.kvstore.s3proc import MotoS3


def test_cluster_rows(redis_url: str, cluster_url: str,
                      redis_cluster: EmbeddedRedisCluster) -> None:
    rows = asyncio.run(_lookups(redis_url, cluster_url, chain=64, lookups=5))
    assert set(rows) == {"single_lookup_p50_ms", "single_lookup_p99_ms",
                         "cluster_lookup_p50_ms", "cluster_lookup_p99_ms",
                         "cluster_lookup_ratio"}
    assert all(v > 0 for v in rows.values())
    mem = asyncio.run(_memory(redis_cluster, 500))
    # One entry: a 17-byte key and a 16-byte embstr value, ~80 B by MEMORY USAGE.
    assert 50 < mem["cluster_index_bytes_per_block"] < 120
    assert mem["cluster_index_bytes_per_block_all_in"] > mem["cluster_index_bytes_per_block"]


def test_g4_rows_on_s3(moto_s3: MotoS3, s3_bucket: str,
                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(OPTIONS_ENV, json.dumps({**moto_s3.options(),
                                                "skip_instance_cache": True}))
    data = np.arange(4 * 65536, dtype=np.uint8).reshape(4, 65536)
    rows = bench_g4(f"{s3_bucket}/bench", [memoryview(r) for r in data], repeats=1)
    assert set(rows) == {"g4_put_gbps", "g4_get_gbps", "g4_latency_ms"}
    assert all(v > 0 for v in rows.values())
