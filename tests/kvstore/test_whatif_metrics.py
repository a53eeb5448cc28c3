"""The live what-if in a running store's /metrics: a two-class replay sent to a
real ``kvserve store serve`` over gRPC predicts, for every configured TTL, the
hit rate per class within one point of the offline replay of the same
requests at the times the store saw them.

Requests are paced on a grid of ``SLOT_S`` slots (several may share one), so
every reuse gap is a whole number of slots give or take the loopback latency.
The TTLs are whole seconds (edges of the estimator's one-second reuse-time
bins, where it is exact) at least 0.2 s from every multiple of the slot: the
comparison cannot flip on scheduling jitter below that."""

from __future__ import annotations

import asyncio
import math
import os
import select
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import replace
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from common.traces import Trace
from kvstore.client import KVStoreClient
from kvstore.types import RequestCtx
from security.secret_files import redis_url_args
from studies.sim import replay_cache
from tests.kvstore.simtrace import random_prefix_trace
from tests.kvstore.storeproc import write_config

# 48 slots of 0.4 s (19 s of replay; was 64 of 0.6 s, 38 s): each TTL still
# keeps a different share of the hits (offline, on the paced times: 0.40, 0.59,
# 0.65, 0.68 and 0.71 with no TTL), and every TTL is 0.2 s from a slot's multiple.
SLOT_S = 0.4
SLOTS = 48
TTLS = [1.0, 3.0, 5.0, 7.0, math.inf]        # gaps are 0, 0.4, 0.8, 1.2, 1.6, 2.0, ...


def _start_store(redis_url: str, config: Path) -> tuple[subprocess.Popen[str], int, int]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvserve.cli", "store", "serve", "--host", "127.0.0.1",
         "--port", "0", "--metrics-port", "0", *redis_url_args(redis_url, config.parent),
         "--node", "whatif",
         "--g2-bytes", "4MiB", "--no-prefault", "--grace", "5", "--config", str(config)],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert proc.stdout is not None
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if select.select([proc.stdout], [], [], 0.2)[0]:
            line = proc.stdout.readline()
            if line.startswith("kvstore ready"):
                parts = line.split()        # kvstore ready HOST:PORT metrics :MPORT
                return proc, int(parts[2].rsplit(":", 1)[1]), int(parts[4].lstrip(":"))
            if not line:
                break
    proc.kill()
    raise AssertionError("store did not start")


def _paced(trace: Trace, slots: int) -> list[tuple[int, int]]:
    """(slot, request index): the trace's times squeezed onto ``slots`` slots."""
    span = trace.requests[-1].t - trace.requests[0].t
    return [(round((r.t - trace.requests[0].t) / span * (slots - 1)), i)
            for i, r in enumerate(trace.requests)]


async def _replay(address: str, trace: Trace, schedule: list[tuple[int, int]]) -> list[float]:
    """Lookups at their slots; returns the time each was sent and answered (midpoint)."""
    seen = [0.0] * len(trace.requests)
    async with KVStoreClient(address, timeout_s=10.0) as client:
        t0 = time.time() + 0.5
        for slot, i in schedule:
            wait = t0 + slot * SLOT_S - time.time()
            if wait > 0:
                await asyncio.sleep(wait)
            r = trace.requests[i]
            keys = [h.to_bytes(16, "big") for h in r.hash_ids]
            ctx = RequestCtx(f"r{i}", "default", r.traffic_class, "")
            sent = time.time()
            await client.lookup(keys, prompt_tokens=r.input_length, ctx=ctx)
            seen[i] = (sent + time.time()) / 2
    return seen


def _predicted(metrics_port: int) -> dict[tuple[str, float], tuple[float, float]]:
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    rate: dict[tuple[str, float], float] = {}
    bound: dict[tuple[str, float], float] = {}
    dropped = None
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == "kvstore_whatif_dropped_lookups_total":
                dropped = s.value
            if s.name in ("kvstore_whatif_hit_rate", "kvstore_whatif_hit_rate_bound"):
                assert s.labels["capacity_tokens"] == "inf"
                key = (s.labels["traffic_class"], float(s.labels["ttl_s"]))
                (rate if s.name == "kvstore_whatif_hit_rate" else bound)[key] = s.value
    assert dropped == 0.0, "the estimator skipped lookups: the comparison would be unfair"
    return {k: (v, bound[k]) for k, v in rate.items()}


def test_live_whatif_in_metrics_matches_the_offline_replay(redis_url: str,
                                                            tmp_path: Path) -> None:
    trace = random_prefix_trace(7, sessions=24, turns=6, think_s=20.0, rate_s=0.3,
                                classes=("chat", "agent"))
    schedule = _paced(trace, slots=SLOTS)
    config = write_config(tmp_path / "kv.toml", block_tokens=trace.block_tokens)
    config.write_text(config.read_text() + "[whatif]\nttls = \""
                      + ",".join(f"{t:g}" for t in TTLS[:-1]) + ",inf\"\ncapacities = \"inf\"\n")
    proc, port, metrics_port = _start_store(redis_url, config)
    try:
        seen = asyncio.run(_replay(f"127.0.0.1:{port}", trace, schedule))
        predicted = _predicted(metrics_port)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
    # The offline replay of the same requests, at the times the store saw them.
    timed = sorted((replace(r, t=seen[i]) for i, r in enumerate(trace.requests)),
                   key=lambda r: r.t)
    offline = replace(trace, requests=tuple(timed))
    assert {c for c, _ in predicted} == {"chat", "agent", "all"}
    checked = 0
    for ttl in TTLS:
        st = replay_cache(offline, ttl_s=ttl)
        want = {"all": st.hit_rate, **{c: s.hit_rate for c, s in st.per_class.items()}}
        for cls in ("chat", "agent", "all"):
            rate, bound = predicted[(cls, ttl)]
            assert abs(rate - want[cls]) <= 0.01, (cls, ttl, rate, want[cls])
            assert abs(rate - want[cls]) <= bound + 1e-9, (cls, ttl, rate, want[cls], bound)
            checked += 1
    assert checked == 15
    # The TTLs matter on this traffic: the shortest keeps far fewer hits than none.
    assert predicted[("all", math.inf)][0] - predicted[("all", TTLS[0])][0] > 0.1
