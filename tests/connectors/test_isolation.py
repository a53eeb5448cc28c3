"""Issues 11, 19 and 20: whose blocks a vLLM request may touch, and what a bad
block costs.

* Tenants proven by the router's salts never share a block.
* A vLLM client that names another tenant (its bare name, a salt with a forged
  or truncated MAC, or a genuine salt re-labelled) gets nothing of that
  tenant's: no warehouse hit, no vLLM-local hit, the same tokens.
* Async loads that cannot be served as promised — every copy of a block
  scribbled after the Lookup found it, or its G3 file gone with its G2 slot
  scribbled — are detected, recomputed (identical output) and counted; nothing
  bad reaches vLLM's cache.

All on server B; a fresh salt nonce gives the same tenant a cold vLLM-local
cache, so only the warehouse can answer (no dev-mode cache reset exists).
"""

from __future__ import annotations

import asyncio
import stat
from pathlib import Path

import pytest

from connectors.vllm_identity import identity_of
from kvstore.tiers.shm import ShmSlot, attach_segment
from kvstore.wire import decode_get_chunk
from proto import kvstore_pb2
from tests.connectors.stack import (
    BLOCK,
    block_keys,
    complete,
    deployment_secret,
    fingerprint,
    hit_rule,
    operator_security,
    prompts,
    salt,
    stats,
    store_client,
    wait_count,
    wait_for,
    wait_stored,
)

pytestmark = pytest.mark.timeout(1500)


def test_tenants_apart_and_a_client_naming_another_tenant_gets_nothing(vllm_stack,
                                                                       vllm_servers):
    server = vllm_servers.only("vllm-b")
    _only_private_files(server)
    p = prompts(1, seed=21, lo=600, hi=601)[0]
    alice_name, bob_name = f"alice-{vllm_stack.run}", f"bob-{vllm_stack.run}"
    alice, bob = salt(alice_name), salt(bob_name)
    a1 = complete(server, p, salt=alice)
    assert a1.cached_tokens == 0
    wait_stored(vllm_stack, [(p, alice, len(p) // BLOCK)])

    b1 = complete(server, p, salt=bob)
    assert b1.cached_tokens == 0, "bob was served alice's blocks"
    assert b1.token_ids == a1.token_ids                  # same model, same prompt
    assert not set(block_keys(vllm_stack.redis_url, p, alice)) & set(
        block_keys(vllm_stack.redis_url, p, bob))

    # Clients without the deployment secret, each naming alice some way.
    head, tenant_part, nonce, mac = alice.split(".")[0], alice_name, "r", alice.split(".")[-1]
    forged = [alice_name,                                          # her bare name
              f"{head}.{tenant_part}.{nonce}.{'0' * len(mac)}",     # a forged MAC
              f"{head}.{tenant_part}.{nonce}.{mac[:-2]}",           # a truncated one
              f"{head}.{tenant_part}.x.{mac}",                      # her MAC, another nonce
              f"{head}.{bob_name}.{nonce}.{mac}",                   # her MAC on bob's name
              None]                                                 # no salt at all
    before = stats(vllm_stack.redis_url, "vllm-b")
    for text in forged:
        scope = identity_of(text, fingerprint(vllm_stack.redis_url), deployment_secret())
        assert not scope.trusted and scope.tenant != alice_name
        got = complete(server, p, salt=text)
        assert got.cached_tokens == 0, f"salt {text!r} hit alice's blocks"
        assert got.token_ids == a1.token_ids
    after = wait_count(vllm_stack.redis_url, "vllm-b", before, "untrusted_salt", len(forged))
    assert after.get("hit_tokens", 0) == before.get("hit_tokens", 0)

    a2 = complete(server, p, salt=salt(alice_name, "again"))   # alice, cold vLLM cache
    assert a2.cached_tokens == hit_rule(len(p), len(p) // BLOCK) > 0
    assert a2.token_ids == a1.token_ids


async def _scribble(address: str, keys: list[bytes], tenant: str, fp: str) -> int:
    """Flip one byte of every stored block in the store's shared memory (what any
    process of the store's user could do); returns how many were hit."""
    async with operator_security().aio_channel(address, "kvstore") as ch:
        call = ch.unary_stream("/kvserve.v1.KVStore/Get",
                               request_serializer=kvstore_pb2.GetRequest.SerializeToString,
                               response_deserializer=decode_get_chunk)
        slots = []
        req = kvstore_pb2.GetRequest(ctx={"tenant": tenant, "model_fingerprint": fp},
                                     keys=keys, use_shm=True)
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


@pytest.mark.parametrize("g3", ["scribbled", "deleted"])
def test_async_loads_that_fail_or_are_tampered_are_recomputed_never_served(
        vllm_stack, vllm_servers, g3):
    server = vllm_servers.only("vllm-b")
    seed = 31 if g3 == "scribbled" else 32
    p = prompts(1, seed=seed, lo=520, hi=521)[0]
    tenant = f"scribble-{g3}-{vllm_stack.run}"
    clean = complete(server, p, salt=salt(tenant))
    wait_stored(vllm_stack, [(p, salt(tenant), len(p) // BLOCK)])

    usable = hit_rule(len(p), len(p) // BLOCK) // BLOCK
    keys = block_keys(vllm_stack.redis_url, p, salt(tenant))[:len(p) // BLOCK]
    ident = identity_of(salt(tenant), fingerprint(vllm_stack.redis_url), deployment_secret())
    address = vllm_stack.store.address
    # Every copy goes bad: the G3 files (once written back) and the G2 slots, else
    # the store would rightly serve the intact G3 copy of a scribbled G2 slot.
    files = [_g3_file(vllm_stack.store.g3, k) for k in keys]
    wait_for(lambda: all(f.exists() for f in files), what="G3 write-back")
    for f in files:
        if g3 == "deleted":
            f.unlink()
            continue
        data = bytearray(f.read_bytes())
        data[len(data) // 2] ^= 0xFF
        f.write_bytes(bytes(data))
    assert asyncio.run(_scribble(address, keys, ident.tenant, ident.fingerprint.hex())) == len(
        keys)
    failures = asyncio.run(_g2_checksum_failures(address))
    before = stats(vllm_stack.redis_url, "vllm-b")

    again = complete(server, p, salt=salt(tenant, "cold"))   # the Lookup still finds them
    assert again.token_ids == clean.token_ids, "a corrupt block was served"
    after = wait_count(vllm_stack.redis_url, "vllm-b", before, "load_errors", usable)
    assert after.get("loads_async", 0) > before.get("loads_async", 0)   # the async path ran
    assert after.get("load_errors", 0) - before.get("load_errors", 0) == usable
    assert after.get("loaded_blocks", 0) == before.get("loaded_blocks", 0)
    assert asyncio.run(_g2_checksum_failures(address)) - failures >= usable


def _only_private_files(server) -> None:  # type: ignore[no-untyped-def]
    """What vLLM writes to its temp dir (its torch.distributed store file, ZMQ
    sockets; world-readable in the shared /tmp otherwise) is its owner's alone."""
    tmp = server.tmp_dir
    assert tmp is not None and stat.S_IMODE(tmp.stat().st_mode) == 0o700
    entries = list(tmp.rglob("*"))
    assert entries, "vLLM wrote nothing to its TMPDIR: is it used at all?"
    loose = [(e.name, oct(stat.S_IMODE(e.lstat().st_mode))) for e in entries
             if stat.S_IMODE(e.lstat().st_mode) & 0o077]
    assert not loose, loose
