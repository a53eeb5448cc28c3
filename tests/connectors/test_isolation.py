"""Issue 11: tenants (vLLM's ``cache_salt``) never share a block, and a stored
block whose bytes were flipped is detected, recomputed and counted, with the
same output as the intact run. Both on server A, whose own prefix cache is
emptied between requests so that only the warehouse can answer."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from connectors.vllm_identity import tenant_of
from kvstore.keys import chain_keys
from kvstore.registry import InstanceRegistry
from kvstore.tiers.shm import ShmSlot, attach_segment
from kvstore.wire import decode_get_chunk
from proto import kvstore_pb2
from tests.connectors.stack import (
    BLOCK,
    complete,
    deployment_secret,
    hit_rule,
    operator_security,
    prompts,
    reset_local_cache,
    stats,
    store_client,
    wait_for,
)

pytestmark = pytest.mark.timeout(1500)


def _saved(stack, instance: str) -> int:  # type: ignore[no-untyped-def]
    return stats(stack.redis_url, instance).get("saved_blocks", 0)


def _keys(stack, tokens: list[int], salt: str) -> list[bytes]:  # type: ignore[no-untyped-def]
    async def fingerprint() -> str:
        async with InstanceRegistry(stack.redis_url) as reg:
            return next(i.model_fingerprint for i in await reg.list_instances()
                        if i.instance_id == "vllm-b")

    return chain_keys(tokens, block_tokens=BLOCK, tenant=tenant_of(salt),
                      fingerprint=bytes.fromhex(asyncio.run(fingerprint())),
                      secret=deployment_secret())


def test_two_cache_salt_tenants_never_share_a_block(vllm_stack, vllm_servers):
    server = vllm_servers.only("vllm-b")
    base, p = server.spec.base_url, prompts(1, seed=21, lo=600, hi=601)[0]
    alice, bob = f"alice-{vllm_stack.run}", f"bob-{vllm_stack.run}"
    saved = _saved(vllm_stack, "vllm-b")
    a1 = complete(base, p, salt=alice)
    assert a1.cached_tokens == 0
    wait_for(lambda: _saved(vllm_stack, "vllm-b") - saved >= len(p) // BLOCK, what="saves")

    reset_local_cache(base)
    b1 = complete(base, p, salt=bob)
    assert b1.cached_tokens == 0, "bob was served alice's blocks"
    assert b1.token_ids == a1.token_ids                  # same model, same prompt
    assert not set(_keys(vllm_stack, p, alice)) & set(_keys(vllm_stack, p, bob))

    reset_local_cache(base)
    a2 = complete(base, p, salt=alice)                   # alice's own blocks still hit
    assert a2.cached_tokens == hit_rule(len(p), len(p) // BLOCK) > 0
    assert a2.token_ids == a1.token_ids


async def _scribble(address: str, keys: list[bytes], tenant: str) -> int:
    """Flip one byte of every stored block in the store's shared memory (what any
    process of the store's user could do); returns how many were hit."""
    async with operator_security().aio_channel(address, "kvstore") as ch:
        call = ch.unary_stream("/kvserve.v1.KVStore/Get",
                               request_serializer=kvstore_pb2.GetRequest.SerializeToString,
                               response_deserializer=decode_get_chunk)
        slots = []
        req = kvstore_pb2.GetRequest(ctx={"tenant": tenant}, keys=keys, use_shm=True)
        async for msg in call(req, timeout=30):
            for part in msg.parts():
                if part.header is not None and part.shm_name:
                    slots.append(ShmSlot(part.shm_name, part.shm_offset, part.header.size,
                                         part.header.checksum))
    for s in slots:
        seg = attach_segment(s.shm_name)
        try:
            seg.buf[s.offset + s.size // 2] ^= 0xFF
        finally:
            seg.close()
    return len(slots)


def _g3_file(root: Path, key: bytes) -> Path:
    h = key.hex()
    return root / h[:2] / h[2:4] / f"{h}.kvb"


async def _g2_checksum_failures(address: str) -> int:
    async with store_client(address) as c:
        return next(t.checksum_failures for t in (await c.stats()).tiers if t.tier == "G2")


def test_flipped_bytes_are_detected_recomputed_identical_and_counted(vllm_stack, vllm_servers):
    server = vllm_servers.only("vllm-b")
    base, p = server.spec.base_url, prompts(1, seed=31, lo=520, hi=521)[0]
    salt = f"scribble-{vllm_stack.run}"
    saved = _saved(vllm_stack, "vllm-b")
    clean = complete(base, p, salt=salt)
    wait_for(lambda: _saved(vllm_stack, "vllm-b") - saved >= len(p) // BLOCK, what="saves")

    usable = hit_rule(len(p), len(p) // BLOCK) // BLOCK
    keys = _keys(vllm_stack, p, salt)
    address = vllm_stack.store.address
    # Every copy goes bad: the G3 files (once written back) and the G2 slots, else
    # the store would rightly serve the intact G3 copy of a scribbled G2 slot.
    files = [_g3_file(vllm_stack.store.g3, k) for k in keys]
    wait_for(lambda: all(f.exists() for f in files), what="G3 write-back")
    for f in files:
        data = bytearray(f.read_bytes())
        data[len(data) // 2] ^= 0xFF
        f.write_bytes(bytes(data))
    assert asyncio.run(_scribble(address, keys, tenant_of(salt))) == len(keys)
    failures = asyncio.run(_g2_checksum_failures(address))
    before = stats(vllm_stack.redis_url, "vllm-b")

    reset_local_cache(base)
    again = complete(base, p, salt=salt)
    assert again.token_ids == clean.token_ids, "a corrupt block was served"
    after = stats(vllm_stack.redis_url, "vllm-b")
    assert after.get("load_errors", 0) - before.get("load_errors", 0) == usable
    assert after.get("loaded_blocks", 0) == before.get("loaded_blocks", 0)
    assert asyncio.run(_g2_checksum_failures(address)) - failures >= usable
