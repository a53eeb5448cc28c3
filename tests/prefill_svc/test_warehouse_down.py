"""With the kvstore process killed, prefill still answers by
recomputing and counts the degradation; when the store returns (same port,
same disk tier, same Redis) the hits come back without restarting prefill."""

from __future__ import annotations

import time
from pathlib import Path

from engine import Engine, EngineConfig, SamplingParams
from proto import common_pb2, decode_pb2, decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc
from tests.prefill_svc import procs
from tests.tls import channel

B = procs.BLOCK


def _services(redis_url: str, tmp_path: Path, **config: str) -> tuple[procs.Proc, ...]:
    """A store, a prefill that always fetches (no G1) and a decode, not started."""
    cfg = procs.write_config(tmp_path / "kvserve.toml", **config)
    store = procs.store(cfg, redis_url, tmp_path)
    pre = procs.engine_service("prefill", cfg, redis_url, tmp_path, store_address=store.address,
                               extra=("--no-local-prefix-cache", "--fetch-policy", "always"))
    dec = procs.engine_service("decode", cfg, redis_url, tmp_path, store_address=store.address)
    return store, pre, dec


def _generate(pre: prefill_pb2_grpc.PrefillStub, dec: decode_pb2_grpc.DecodeStub,
              tokens: list[int]) -> tuple[prefill_pb2.KVHandle, list[int]]:
    sp = common_pb2.SamplingParams(max_tokens=6)
    h = pre.Prefill(prefill_pb2.PrefillRequest(token_ids=tokens, sampling=sp), timeout=30)
    events = dec.Decode(decode_pb2.DecodeRequest(handle=h, sampling=sp), timeout=30)
    return h, [t for ev in events for t in ev.token_ids]


def test_prefill_degrades_to_recompute_and_recovers(redis_url: str, tmp_path: Path) -> None:
    store, pre, dec = _services(redis_url, tmp_path, g3_path=str(tmp_path / "g3"))
    procs.start_all(store, pre, dec)
    ref = Engine(EngineConfig(model="tiny-dense", block_tokens=B, num_blocks=256))
    tokens = [(i * 13) % 250 + 1 for i in range(90)]
    want = ref.generate(tokens, SamplingParams(max_tokens=6)).tokens
    try:
        with channel(pre.address) as pch, channel(dec.address) as dch:
            p_stub, d_stub = prefill_pb2_grpc.PrefillStub(pch), decode_pb2_grpc.DecodeStub(dch)
            h, out = _generate(p_stub, d_stub, tokens)
            assert (h.cached_tokens, out) == (0, want)
            _wait_hit(p_stub, d_stub, tokens, want)          # written through: now a hit

            store.kill()
            for _ in range(3):
                h, out = _generate(p_stub, d_stub, tokens)
                assert out == want
                assert h.cached_tokens == 0
                assert h.fetch_decision == "warehouse unavailable: recompute"
            m = pre.metrics()
            assert m["kvserve_prefill_prefill_degraded_requests_total"] >= 3
            assert m["kvserve_prefill_store_degraded_total{kind=lookup}"] >= 3
            assert m["kvserve_prefill_store_available"] == 0

            store = procs.Proc(store.role, store.argv, store.port, store.log).start()
            store.wait_ready()
            h = _wait_hit(p_stub, d_stub, tokens, want)       # from G3 on disk, same keys
            assert h.cached_tokens == (len(tokens) - 1) // B * B
            assert pre.metrics()["kvserve_prefill_store_available"] == 1
    finally:
        for p in (dec, pre, store):
            p.kill()


def test_prefill_started_before_its_store_hits_on_the_first_request(
        redis_url: str, tmp_path: Path) -> None:
    """Services start in parallel: a prefill that came up before its store
    must not carry the failed first dial into its first real requests."""
    store, pre, dec = _services(redis_url, tmp_path)
    procs.start_all(pre, dec)                       # the store's port is still closed
    ref = Engine(EngineConfig(model="tiny-dense", block_tokens=B, num_blocks=256))
    tokens = [(i * 7) % 250 + 3 for i in range(70)]
    want = ref.generate(tokens, SamplingParams(max_tokens=6)).tokens
    try:
        store.start()
        store.wait_ready()
        with channel(pre.address) as pch, channel(dec.address) as dch:
            p_stub, d_stub = prefill_pb2_grpc.PrefillStub(pch), decode_pb2_grpc.DecodeStub(dch)
            h, out = _generate(p_stub, d_stub, tokens)
            assert out == want
            assert h.fetch_decision != "warehouse unavailable: recompute"
            assert list(h.written_tiers) != ["warehouse"]          # the store's real tiers
            h = _wait_hit(p_stub, d_stub, tokens, want)
            assert h.cached_tokens == (len(tokens) - 1) // B * B
    finally:
        for p in (dec, pre, store):
            p.kill()


def _wait_hit(pre: prefill_pb2_grpc.PrefillStub, dec: decode_pb2_grpc.DecodeStub,
              tokens: list[int], want: list[int], timeout_s: float = 20.0) -> prefill_pb2.KVHandle:
    deadline = time.monotonic() + timeout_s
    while True:
        h, out = _generate(pre, dec, tokens)
        assert out == want
        if h.cached_tokens > 0 or time.monotonic() > deadline:
            assert h.cached_tokens > 0, f"no hit within {timeout_s}s: {h.fetch_decision}"
            return h
        time.sleep(0.1)
