"""vLLM's KV-event wire format (``vllm/distributed/kv_events.py``), without vLLM.

vLLM publishes ``KVEventBatch`` messages over ZMQ (``--kv-events-config``):
multipart ``(topic, seq as 8-byte big-endian, msgpack payload)``; the payload
is an array ``[ts, events, data_parallel_rank]`` and each event a map tagged
``"type"``: ``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared``. llm-d,
Dynamo and SGLang's router read the same schema. kvserve speaks it both ways:
``kvstore.vllm_events`` publishes the warehouse's tiers in it, and
``router.vllm_events`` consumes vLLM instances' own events. These structs
mirror vLLM 0.32's field names, order and defaults, so a payload encoded here
decodes with vLLM's own classes and the reverse (tests/connectors check both).
"""

from __future__ import annotations

from typing import Any

import msgspec

MEDIUM_GPU = "GPU"
MEDIUM_CPU = "CPU"
END_SEQ = (-1).to_bytes(8, "big", signed=True)    # replay: "no more batches"


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):  # type: ignore[call-arg]
    """Base of the three event kinds."""


class BlockStored(KVCacheEvent):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[bytes | int]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):  # type: ignore[call-arg]
    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(KVEventBatch)


def encode(batch: KVEventBatch) -> bytes:
    return _ENCODER.encode(batch)


def decode(payload: bytes) -> KVEventBatch:
    """A batch, or ``msgspec.DecodeError`` / ``msgspec.ValidationError``."""
    return _DECODER.decode(payload)


def seq_bytes(seq: int) -> bytes:
    return seq.to_bytes(8, "big")


__all__ = ["END_SEQ", "MEDIUM_CPU", "MEDIUM_GPU", "AllBlocksCleared", "BlockRemoved",
           "BlockStored", "KVEventBatch", "decode", "encode", "seq_bytes"]
