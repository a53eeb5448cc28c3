"""Two nodes, one warehouse: two kvstore processes (own G2/G3, distinct node
names and ports) share a Redis Cluster index and a G4 bucket on a real S3 API
(moto_server). Prefill on node B restores the prefix node A computed (from G4,
promoted into B's G2) with token identity, and the router's tier-aware
affinity, fed by the real KV events, prefers the node whose G2 holds it."""

from __future__ import annotations

import asyncio
import json
import os
import time
from pathlib import Path

import numpy as np
import pytest

from common.config import TrafficClasses
from engine import Engine, EngineConfig, SamplingParams
from kvstore.events import EventReader
from kvstore.index import BlockIndex
from kvstore.registry import InstanceInfo
from kvstore.tiers.objstore import OPTIONS_ENV
from kvstore.types import TIER_BITS
from proto import (
    common_pb2,
    decode_pb2,
    decode_pb2_grpc,
    kvstore_pb2,
    kvstore_pb2_grpc,
    prefill_pb2,
    prefill_pb2_grpc,
)
from router.placement import Placer, PolicyConfig, make_router_policy
from router.view import CandidateSet, PrefixView
from tests.kvstore.s3proc import MotoS3
from tests.prefill_svc import procs
from tests.tls import channel

B = procs.BLOCK
SP = common_pb2.SamplingParams(max_tokens=6)


def _generate(pre: prefill_pb2_grpc.PrefillStub, dec: decode_pb2_grpc.DecodeStub,
              tokens: list[int]) -> tuple[prefill_pb2.KVHandle, list[int]]:
    h = pre.Prefill(prefill_pb2.PrefillRequest(token_ids=tokens, sampling=SP), timeout=60)
    events = dec.Decode(decode_pb2.DecodeRequest(handle=h, sampling=SP), timeout=60)
    return h, [t for ev in events for t in ev.token_ids]


async def _wait_g4(url: str, keys: list[bytes], timeout_s: float = 30.0) -> None:
    ix = await BlockIndex(url, node="probe", classes=TrafficClasses()).start()
    try:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            entries = await ix.entries(keys)
            if all(e is not None and e.tiers & TIER_BITS["G4"] for e in entries):
                return
            await asyncio.sleep(0.1)
        raise AssertionError("node A's blocks never reached G4")
    finally:
        await ix.close()


async def _events(url: str) -> list[object]:
    reader = EventReader(url, start_id="0")
    try:
        return list(await reader.read(block_ms=200, count=10_000))
    finally:
        await reader.close()


@pytest.mark.slow
def test_node_b_restores_node_a_prefix_and_router_prefers_the_g2_holder(
        cluster_url: str, moto_s3: MotoS3, s3_bucket: str, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(OPTIONS_ENV, json.dumps(moto_s3.options()))   # inherited by children
    config = procs.write_config(tmp_path / "kvserve.toml")
    g4 = f"{s3_bucket}/g4"
    stores = {}
    for node in ("na", "nb"):
        s = procs.store(config, cluster_url, tmp_path)
        s.argv += ["--node", node, "--g3-path", str(tmp_path / node), "--g4-url", g4]
        stores[node] = s
    pres = {node: procs.engine_service(
        "prefill", config, cluster_url, tmp_path, store_address=stores[node].address,
        extra=("--node", node, "--no-local-prefix-cache", "--fetch-policy", "always"))
        for node in ("na", "nb")}
    dec = procs.engine_service("decode", config, cluster_url, tmp_path,
                               store_address=stores["nb"].address, extra=("--node", "nb"))
    everyone = (*stores.values(), *pres.values(), dec)
    for p in everyone:                          # in parallel: model loads overlap
        p.start()
    try:
        for p in everyone:                      # five processes on a shared CI box: patience
            p.wait_ready(timeout_s=240)
    except BaseException:
        for p in everyone:
            p.kill()
        raise
    ref = Engine(EngineConfig(model="tiny-dense", block_tokens=B, num_blocks=256))
    tokens = [(i * 11) % 250 + 1 for i in range(100)]
    want = ref.generate(tokens, SamplingParams(max_tokens=6)).tokens
    try:
        with channel(pres["na"].address) as ach, channel(pres["nb"].address) as bch, \
                channel(dec.address) as dch:
            a, b = prefill_pb2_grpc.PrefillStub(ach), prefill_pb2_grpc.PrefillStub(bch)
            d = decode_pb2_grpc.DecodeStub(dch)
            h, out = _generate(a, d, tokens)                 # node A computes ...
            assert (h.cached_tokens, out) == (0, want)
            keys = list(h.block_keys)                        # keyed by the deployment secret
            asyncio.run(_wait_g4(cluster_url, keys))         # ... and writes through to G4
            h, out = _generate(b, d, tokens)                 # node B restores it from G4
            assert out == want                               # token identity
            assert h.cached_tokens == (len(tokens) - 1) // B * B
            assert "G4" in h.fetch_decision
            with channel(stores["nb"].address) as sch:      # promoted into B's G2
                st = kvstore_pb2_grpc.KVStoreStub(sch).Stats(kvstore_pb2.StatsRequest(),
                                                             timeout=10)
            g2 = {t.tier: t for t in st.tiers}["G2"]
            assert st.node == "nb" and g2.blocks >= len(keys)
            h, out = _generate(b, d, tokens)                 # again: still identical
            assert out == want and h.cached_tokens > 0

        # The router's view, fed by the stores' real KV events on the cluster stream.
        view = PrefixView()
        for ev in asyncio.run(_events(cluster_url)):
            view.apply(ev)  # type: ignore[arg-type]
        cands = CandidateSet.of([InstanceInfo(instance_id=f"p-{n}", role="prefill",
                                              address=pres[n].address, node=n)
                                 for n in ("na", "nb")])
        # Credits from measured-style costs: G2 at host speed, G4 at object-store speed.
        cfg = PolicyConfig.from_costs({"G2": 5e9, "G3": 1e9, "G4": 0.2e9},
                                      {"G2": 1e-4, "G3": 1e-3, "G4": 0.03},
                                      block_bytes=16 * 4096, block_tokens=B,
                                      prefill_tokens_per_s=1_000.0, fetch_blocks=len(keys))
        assert cfg.tier_credit[1] > cfg.tier_credit[3] > 0.0
        placer = Placer(make_router_policy("cache_aware", cfg), view)
        for _ in range(4):                                   # not a round-robin accident
            d1 = placer.place_prefill(cands, keys, len(tokens))
            assert d1.instance_id == "p-na" and d1.reason == "prefix_affinity"
        req = placer.prefill_request(cands, keys, len(tokens))
        assert req.hit_tokens is not None
        assert req.hit_tokens[0, 1] > 0 and req.hit_tokens[1, 1] == 0    # G2 on na only
        assert req.hit_tokens[1, 3] == req.hit_tokens[0].sum()           # nb: via G4
        # A prompt nobody holds: no affinity, least load decides.
        other = [os.urandom(16) for _ in range(4)]
        assert placer.place_prefill(cands, other, 64).reason == "least_load"
        assert not np.any(placer.prefill_request(cands, other, 64).hit_tokens)
    finally:
        for p in (dec, *pres.values(), *stores.values()):
            p.kill()
