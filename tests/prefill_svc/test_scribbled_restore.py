"""Issue 10, verify on every read path: when every G2 slot of a prompt is scribbled,
a prefill instance (a separate process on the same host, so it reads G2 through
shared memory) detects it, the store counts it, and the prefill recomputes: the
answer is the cold one, and no scribbled byte is restored."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from engine import Engine, EngineConfig, SamplingParams
from proto import kvstore_pb2, kvstore_pb2_grpc, prefill_pb2, prefill_pb2_grpc
from security.config import SecurityConfig
from tests.kvstore.test_verify import scribble, slots_of
from tests.prefill_svc import procs
from tests.security.tlsenv import tls_env  # noqa: F401 - a fixture

B = 4
BLOCKS = 55                          # >= 50 scribbled slots through the prefill path


@pytest.mark.usefixtures("tls_env")
def test_prefill_recomputes_every_scribbled_block(redis_url: str, tmp_path: Path) -> None:
    config = procs.write_config(tmp_path / "kvserve.toml", block_tokens=B)
    store = procs.store(config, redis_url, tmp_path)
    pre = procs.engine_service("prefill", config, redis_url, tmp_path,
                               store_address=store.address,
                               extra=("--no-local-prefix-cache", "--fetch-policy", "always"))
    procs.start_all(store, pre)
    tokens = [(i * 7) % 250 + 1 for i in range(BLOCKS * B + 1)]
    ref = Engine(EngineConfig(model="tiny-dense", block_tokens=B, num_blocks=256))
    want = ref.generate(tokens, SamplingParams(max_tokens=1)).tokens[0]
    req = prefill_pb2.PrefillRequest(token_ids=tokens)
    try:
        sec = SecurityConfig.from_env("operator")
        with sec.sync_channel(pre.address, "prefill") as pch, \
                sec.sync_channel(store.address, "kvstore") as sch:
            p_stub, s_stub = prefill_pb2_grpc.PrefillStub(pch), kvstore_pb2_grpc.KVStoreStub(sch)
            h = p_stub.Prefill(req, timeout=60)
            assert (h.cached_tokens, h.first_token) == (0, want)
            deadline = time.monotonic() + 30          # written through: now a hit
            while (h := p_stub.Prefill(req, timeout=60)).cached_tokens == 0:
                assert time.monotonic() < deadline, h.fetch_decision
                time.sleep(0.1)
            assert h.cached_tokens == BLOCKS * B and h.first_token == want

            slots = asyncio.run(slots_of(store.address, list(h.block_keys), h.ctx.tenant))
            assert len(slots) == BLOCKS
            scribble(slots, seed=5)

            def g2_failures() -> int:
                st = s_stub.Stats(kvstore_pb2.StatsRequest(), timeout=10)
                return next(t.checksum_failures for t in st.tiers if t.tier == "G2")

            before = g2_failures()
            h = p_stub.Prefill(req, timeout=60)
            assert h.cached_tokens == 0, "a scribbled block was restored"
            assert h.first_token == want                   # recomputed: the cold answer
            assert g2_failures() - before == BLOCKS        # each one detected and counted
    finally:
        for p in (pre, store):
            p.kill()
