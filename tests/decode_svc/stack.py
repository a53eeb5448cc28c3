"""A shared running stack for the service tests (store, prefill, decode as
real processes on real Redis) and blocking gRPC helpers to drive it.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest

from engine import Engine, EngineConfig, SamplingParams
from kvstore.keys import chain_keys
from kvstore.redis_server import EmbeddedRedis
from kvstore.registry import InstanceInfo, InstanceRegistry
from kvstore.types import RequestCtx
from proto import common_pb2, decode_pb2, decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc
from tests.prefill_svc import procs
from tests.tls import channel, secret

TIMEOUT = 60.0


@dataclass(slots=True)
class Stack:
    redis_url: str
    config: Path
    log_dir: Path
    store: procs.Proc
    prefill: procs.Proc
    decode: procs.Proc
    ref: Engine
    # /dev/shm's names before this stack started: what an earlier run (another
    # session's, or one that was killed) left there is not this stack's to answer for.
    shm_before: frozenset[str] = frozenset()
    # One channel per address, shared by every call and thread, as a real client
    # holds it: a new TLS handshake per call made 11 concurrent handshakes per batch.
    _channels: dict[str, grpc.Channel] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def prefill_stub(self, address: str | None = None) -> prefill_pb2_grpc.PrefillStub:
        return prefill_pb2_grpc.PrefillStub(self._channel(address or self.prefill.address))

    def decode_stub(self, address: str | None = None) -> decode_pb2_grpc.DecodeStub:
        return decode_pb2_grpc.DecodeStub(self._channel(address or self.decode.address))

    def _channel(self, address: str) -> grpc.Channel:
        with self._lock:
            if address not in self._channels:
                self._channels[address] = channel(address)
            return self._channels[address]

    def close(self) -> None:
        for ch in self._channels.values():
            ch.close()


def sampling(max_tokens: int, **kw: object) -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(max_tokens=max_tokens, **kw)  # type: ignore[arg-type]


def prefill(stub: prefill_pb2_grpc.PrefillStub, tokens: Sequence[int], *, max_tokens: int = 8,
            tenant: str = "", request_id: str = "", **kw: object) -> prefill_pb2.KVHandle:
    req = prefill_pb2.PrefillRequest(
        ctx=common_pb2.RequestContext(tenant=tenant, request_id=request_id),
        token_ids=list(tokens), sampling=sampling(max_tokens, **kw))
    return stub.Prefill(req, timeout=TIMEOUT)


@dataclass(frozen=True, slots=True)
class Decoded:
    tokens: list[int]
    text: str
    finish_reason: str
    events: list[decode_pb2.DecodeEvent]


def decode(stub: decode_pb2_grpc.DecodeStub, handle: prefill_pb2.KVHandle, *,
           max_tokens: int = 8, **kw: object) -> Decoded:
    events = list(stub.Decode(decode_pb2.DecodeRequest(handle=handle,
                                                       sampling=sampling(max_tokens, **kw)),
                              timeout=TIMEOUT))
    toks = [t for ev in events for t in ev.token_ids]
    return Decoded(toks, "".join(ev.text for ev in events), events[-1].finish_reason, events)


def generate(stack: Stack, tokens: Sequence[int], *, max_tokens: int = 8, tenant: str = "",
             **kw: object) -> tuple[prefill_pb2.KVHandle, Decoded]:
    h = prefill(stack.prefill_stub(), tokens, max_tokens=max_tokens, tenant=tenant, **kw)
    return h, decode(stack.decode_stub(), h, max_tokens=max_tokens, **kw)


def reference(ref: Engine, tokens: Sequence[int], max_tokens: int = 8,
              **kw: object) -> list[int]:
    return ref.generate(list(tokens), SamplingParams(max_tokens=max_tokens, **kw)).tokens  # type: ignore[arg-type]


async def _matched(c: object, keys: Sequence[bytes], prompt_tokens: int, tenant: str) -> int:
    res = await c.lookup(list(keys), prompt_tokens=prompt_tokens,  # type: ignore[attr-defined]
                         ctx=RequestCtx(tenant=tenant), touch=False)
    return int(res.matched_blocks)


def _store_client(store_address: str):  # type: ignore[no-untyped-def]
    from kvstore.client import KVStoreClient

    return KVStoreClient(store_address, timeout_s=5.0, use_shm=False)


def stored_blocks(store_address: str, keys: Sequence[bytes], prompt_tokens: int,
                  tenant: str = "") -> int:
    """Leading blocks of ``keys`` the warehouse holds for ``tenant`` (a real Lookup:
    blocks are bound to their tenant's namespace, docs/security.md)."""
    async def look() -> int:
        async with _store_client(store_address) as c:
            return await _matched(c, keys, prompt_tokens, tenant)

    return asyncio.run(look())


def wait_stored(store_address: str, keys: Sequence[bytes], n: int, prompt_tokens: int,
                tenant: str = "", timeout_s: float = 20.0) -> int:
    """Wait until the warehouse holds at least ``n`` leading blocks of ``keys``.

    One client polls, as a real one would hold its channel (one TLS handshake,
    not one every 50 ms). A store unavailable for a moment is "not yet", until
    the deadline. (The failed handshake that once failed this wait was the
    channels' 100 ms connection-attempt deadline: tests/security/test_channels.py.)"""
    from kvstore.errors import StoreUnavailable

    async def wait() -> int:
        deadline, have = time.monotonic() + timeout_s, 0
        async with _store_client(store_address) as c:
            while True:
                with contextlib.suppress(StoreUnavailable):
                    have = await _matched(c, keys, prompt_tokens, tenant)
                if have >= n or time.monotonic() > deadline:
                    return have
                await asyncio.sleep(0.05)

    return asyncio.run(wait())


def keys_of(ref: Engine, tokens: Sequence[int], tenant: str = "default") -> list[bytes]:
    return chain_keys(list(tokens), block_tokens=ref.layout.block_tokens, tenant=tenant,
                      fingerprint=ref.fingerprint, secret=secret())


def prompt(seed: int, n: int) -> list[int]:
    """Deterministic byte-range tokens (tiny-dense's tokenizer is byte level)."""
    return [(seed * 31 + i * 7) % 250 + 1 for i in range(n)]


@pytest.fixture(scope="package")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """kvstore + prefill + decode, tiny-dense, 16-token blocks. The prefill
    keeps no local prefix cache and fetches every usable block (for a model
    this small the cost rule would often rather recompute), so every hit
    comes from the warehouse and cached_tokens is the hit rule's value.

    The stack serves every test of this package (it stops after the last one,
    so its processes idle through none of the rest of the suite) and gets a
    Redis server of its own (the same bundled real server the ``redis_url``
    fixture uses): other tests flush that one between tests, which would wipe
    this stack's index.
    """
    base = tmp_path_factory.mktemp("stack")
    with EmbeddedRedis() as redis:
        yield from _stack(base, redis.url)


def _stack(base: Path, redis_server: str) -> Iterator[Stack]:
    shm_before = frozenset(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else frozenset()
    config = procs.write_config(base / "kvserve.toml")
    store = procs.store(config, redis_server, base)
    store.start()
    pre = procs.engine_service("prefill", config, redis_server, base,
                               store_address=store.address,
                               extra=("--no-local-prefix-cache", "--fetch-policy", "always"))
    dec = procs.engine_service("decode", config, redis_server, base, store_address=store.address)
    procs.start_all(pre, dec)
    store.wait_ready()
    ref = Engine(EngineConfig(model="tiny-dense", block_tokens=procs.BLOCK, num_blocks=512))
    s = Stack(redis_server, config, base, store, pre, dec, ref, shm_before)
    try:
        yield s
    finally:
        s.close()
        for p in (dec, pre, store):
            p.stop()


def instances(redis_url: str) -> list[InstanceInfo]:
    async def ls() -> list[InstanceInfo]:
        async with InstanceRegistry(redis_url) as reg:
            return await reg.list_instances()

    return asyncio.run(ls())
