"""Issue 20's KV events, without servers: vLLM-native events map to kvserve's keys
(any vLLM block size), the warehouse's events become vLLM-schema batches, and
the wire format is the one vLLM's own classes read and write."""

from __future__ import annotations

import hashlib
import random

import pytest

from common.vllm_kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    decode,
    encode,
)
from kvstore.events import KVEvent
from kvstore.keys import chain_keys
from kvstore.vllm_events import batch_of
from router.vllm_events import ChainMap, salt_of
from security.vllm_trust import tenant_salt

SECRET = bytes(range(32))
FP = b"\x05" * 16
B = 64


def _vllm_events(tokens: list[int], bs: int, salt: str, *, per_event: int = 3,
                 parent: bytes | None = None) -> list[BlockStored]:
    """What vLLM publishes for a request: block hashes chained over the tokens (the
    exact hash function is vLLM's business; any injective chain will do here)."""
    out, prev = [], parent
    n = len(tokens) // bs
    for start in range(0, n, per_event):
        hashes, first_parent = [], prev
        for i in range(start, min(n, start + per_event)):
            prev = hashlib.sha256((prev or b"root") + bytes(str(tokens[i * bs:(i + 1) * bs]),
                                                            "ascii")).digest()
            hashes.append(prev)
        out.append(BlockStored(block_hashes=hashes, parent_block_hash=first_parent,
                               token_ids=tokens[start * bs:(start + len(hashes)) * bs],
                               block_size=bs, lora_id=None, medium="GPU", lora_name=None,
                               extra_keys=[(salt,) if first_parent is None and j == 0 else None
                                           for j in range(len(hashes))]))
    return out


@pytest.mark.parametrize("bs", [16, 64, 128, 48])
def test_native_events_map_to_the_keys_the_router_computes(bs: int) -> None:
    rng = random.Random(bs)
    tokens = [rng.randrange(50_000) for _ in range(1_000)]
    salt = tenant_salt("alice", SECRET)
    want = chain_keys(tokens[:len(tokens) // bs * bs], block_tokens=B, tenant="alice",
                      fingerprint=FP, secret=SECRET)
    cm = ChainMap(block_tokens=B, fingerprint=FP, secret=SECRET)
    events = _vllm_events(tokens, bs, salt)
    got = [k for ev in events for k in cm.stored(ev)]
    assert got == want and cm.unmapped == 0
    # Removing the vLLM blocks withdraws exactly the kvserve keys each completed.
    last = events[-1]
    gone = cm.removed(BlockRemoved(block_hashes=last.block_hashes, medium="GPU"))
    tail_tokens = len(last.block_hashes) * bs
    first_token = len(tokens) // bs * bs - tail_tokens
    assert gone == [k for i, k in enumerate(want) if (i + 1) * B > first_token]


def test_unmappable_events_map_to_nothing_and_are_counted() -> None:
    tokens = list(range(1000, 1256))
    cm = ChainMap(block_tokens=B, fingerprint=FP, secret=SECRET)
    for salt in ("alice", "", tenant_salt("alice", b"other secret")):      # proves nothing
        assert [k for ev in _vllm_events(tokens, B, salt) for k in cm.stored(ev)] == []
    orphan = _vllm_events(tokens, B, tenant_salt("a", SECRET), parent=b"p" * 32)
    assert cm.stored(orphan[0]) == []                                    # unknown parent
    ok = _vllm_events(tokens, B, tenant_salt("a", SECRET))[0]
    for bad in ({"lora_name": "x"}, {"group_idx": 1}, {"medium": "kvserve"},
                {"token_ids": ok.token_ids[:-1]}):
        ev = BlockStored(**{**{f: getattr(ok, f) for f in ok.__struct_fields__}, **bad})
        assert cm.stored(ev) == []
    assert cm.unmapped > 0 and len(cm) == 0
    good = cm.stored(ok)
    assert len(good) == 3 and len(cm) == 3
    cm.clear()
    assert len(cm) == 0


def test_salt_is_the_last_string_of_the_root_extra_keys() -> None:
    assert salt_of(("s",), False) == "s"
    assert salt_of(("lora", ("mm", 0), "s"), True) == "s"
    assert salt_of((("mm", 0), b"digest"), False) is None
    assert salt_of(None, False) is None


def test_warehouse_events_become_vllm_batches_with_media_and_tags() -> None:
    k1, k2, k3 = b"\x01" * 16, b"\x02" * 16, b"\x03" * 16
    evs = [KVEvent("1-0", "stored", "node-0", "G2", "kvstore-0", (k1, k2)),
           KVEvent("1-1", "stored", "node-0", "G3", "kvstore-0", (k1,)),
           KVEvent("1-2", "evicted", "node-0", "G2", "kvstore-0", (k2,)),
           KVEvent("1-3", "stored", "node-0", "G4", "kvstore-0", (k3,)),
           KVEvent("1-4", "deleted", "node-0", "", "kvstore-0", (k3,)),
           KVEvent("1-5", "stored", "node-0", "G1", "vllm-0", (k1,))]          # an engine's
    batch = batch_of(evs, {k1: "kvs-tag.a", k2: "kvs-tag.b"}, B, ts=5.0)
    assert batch is not None and batch.ts == 5.0
    kinds = [(type(e).__name__, e.medium) for e in batch.events]
    assert kinds == [("BlockStored", "CPU"), ("BlockStored", "DISK"), ("BlockRemoved", "CPU"),
                     ("BlockStored", "OBJECT"), ("BlockRemoved", None)]
    first = batch.events[0]
    assert isinstance(first, BlockStored)
    assert first.block_hashes == [k1, k2] and first.extra_keys == [("kvs-tag.a",), ("kvs-tag.b",)]
    assert first.token_ids == [] and first.parent_block_hash is None and first.block_size == B
    assert batch.events[3].extra_keys == [None]                         # no entry: no tag
    assert batch_of([evs[-1]], {}, B) is None
    assert decode(encode(batch)) == batch


def test_our_schema_round_trips_with_vllms_own_classes() -> None:
    kv_events = pytest.importorskip("vllm.distributed.kv_events")
    import msgspec

    ours = KVEventBatch(ts=1.0, events=[
        BlockStored(block_hashes=[b"k" * 16], parent_block_hash=None, token_ids=[], block_size=64,
                    lora_id=None, medium="DISK", lora_name=None, extra_keys=[("kvs-tag.x",)]),
        BlockRemoved(block_hashes=[b"k" * 16], medium="CPU"), AllBlocksCleared()])
    theirs = msgspec.msgpack.Decoder(kv_events.KVEventBatch).decode(encode(ours))
    assert [type(e).__name__ for e in theirs.events] == ["BlockStored", "BlockRemoved",
                                                         "AllBlocksCleared"]
    assert theirs.events[0].medium == "DISK" and theirs.events[0].block_hashes == [b"k" * 16]
    native = kv_events.KVEventBatch(ts=2.0, data_parallel_rank=0, events=[
        kv_events.BlockStored(block_hashes=[b"h"], parent_block_hash=b"p", token_ids=[1, 2],
                              block_size=64, lora_id=None, medium="GPU", lora_name=None,
                              extra_keys=[("salt",)])])
    back = decode(msgspec.msgpack.encode(native))
    assert back.events[0].token_ids == [1, 2] and back.events[0].parent_block_hash == b"p"
