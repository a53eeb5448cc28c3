"""The warehouse's KV events in vLLM's own schema, over ZMQ.

Routers built for vLLM fleets (llm-d's KV-cache indexer, Dynamo's KV router,
SGLang's) subscribe to vLLM's ``--kv-events-config`` stream: ``KVEventBatch``
msgpack over a ZMQ PUB socket, with an optional ROUTER socket that replays
missed batches (``common.vllm_kv_events``). This publisher follows the
warehouse's own stream (``kvstore.events``, Redis) and republishes it that way,
so such a router sees what kvserve's tiers hold:

* a ``stored`` event becomes ``BlockStored`` with medium ``CPU`` (G2, host
  DRAM), ``DISK`` (G3) or ``OBJECT`` (G4); an ``evicted`` or ``deleted`` one
  ``BlockRemoved`` (medium unspecified when the index dropped the block from
  every tier);
* ``block_hashes`` are kvserve's 16-byte block keys. They are keyed by the
  deployment secret (docs/block-keys.md), so they are not vLLM's hashes and
  cannot be computed from a prompt without the secret: a consumer matches them
  against keys it computes with kvserve's chain (``kvstore.keys``), as kvserve's
  own router does; ``parent_block_hash`` is unset and ``token_ids`` empty — the
  warehouse never holds prompt text, and the events must not carry it;
* ``extra_keys`` hold, per block, the slot where vLLM puts the cache salt: here
  the tenant's public tag (``security.vllm_trust.tenant_tag``), never the salt
  itself (a salt proves a tenant to vLLM: a credential has no place on a
  broadcast stream).

The PUB endpoint should be an ``ipc://`` path in a private directory or a
loopback/private-network port: ZMQ has no authentication here (vLLM's
publisher has none either); the events name no tenant and carry no text.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from dataclasses import dataclass

import zmq
import zmq.asyncio

from common.vllm_kv_events import (
    END_SEQ,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    encode,
    seq_bytes,
)
from kvstore.events import KIND_STORED, EventReader, KVEvent
from kvstore.index import ENTRY, IDS_HASH
from kvstore.redis_conn import connect
from security.vllm_trust import tenant_tag

log = logging.getLogger(__name__)
MEDIUMS = {"G2": "CPU", "G3": "DISK", "G4": "OBJECT"}
_TENANT_ID = slice(ENTRY.size - 4, ENTRY.size)


@dataclass(frozen=True, slots=True)
class PublisherConfig:
    redis_url: str
    endpoint: str = "tcp://127.0.0.1:5558"   # bound (PUB)
    replay_endpoint: str = ""                # bound (ROUTER); "" = no replay
    topic: str = "kvserve"
    block_tokens: int = 64
    buffer_steps: int = 10_000               # batches kept for replay
    hwm: int = 100_000
    block_ms: int = 500

    def __post_init__(self) -> None:
        if not self.redis_url:
            raise ValueError("the publisher follows the warehouse's events: a Redis URL is needed")
        for name in ("endpoint", "replay_endpoint"):
            v = getattr(self, name)
            if v and not v.startswith(("tcp://", "ipc://", "inproc://")):
                raise ValueError(f"{name} {v!r} must be a tcp://, ipc:// or inproc:// endpoint")
        if not self.endpoint:
            raise ValueError("endpoint must be set")
        if self.block_tokens < 1 or self.buffer_steps < 1 or self.hwm < 1 or self.block_ms < 1:
            raise ValueError("block_tokens, buffer_steps, hwm and block_ms must be >= 1")


def batch_of(events: list[KVEvent], tags: dict[bytes, str], block_tokens: int,
             ts: float | None = None) -> KVEventBatch | None:
    """The vLLM-schema batch for warehouse events (G1 events are engines' own)."""
    out: list[BlockStored | BlockRemoved] = []
    for ev in events:
        medium = MEDIUMS.get(ev.tier)
        if ev.tier and medium is None:
            continue                                  # G1: the engines publish their own
        if not ev.keys:
            continue
        if ev.kind == KIND_STORED:
            out.append(BlockStored(block_hashes=list(ev.keys), parent_block_hash=None,
                                   token_ids=[], block_size=block_tokens, lora_id=None,
                                   medium=medium, lora_name=None,
                                   extra_keys=[(tags[k],) if k in tags else None
                                               for k in ev.keys]))
        else:
            out.append(BlockRemoved(block_hashes=list(ev.keys), medium=medium))
    if not out:
        return None
    return KVEventBatch(ts=time.time() if ts is None else ts, events=out)


class TenantTags:
    """Block key -> the tenant tag of the namespace that stored it (index entry)."""

    def __init__(self, redis_url: str, secret: bytes) -> None:
        self._r = connect(redis_url, socket_timeout=5.0)
        self._secret = secret
        self._names: dict[int, str] = {}

    async def of(self, keys: list[bytes]) -> dict[bytes, str]:
        if not keys:
            return {}
        pipe = self._r.pipeline(transaction=False)
        for k in keys:
            pipe.get(b"B" + k)
        out: dict[bytes, str] = {}
        for k, raw in zip(keys, await pipe.execute(), strict=True):
            if raw is None or len(raw) != ENTRY.size:
                continue
            tid = int.from_bytes(raw[_TENANT_ID], "little")
            name = self._names.get(tid)
            if name is None:
                got = await self._r.hget(IDS_HASH, f"tenant:i:{tid}")
                if got is None:
                    continue
                name = got.decode()
                if len(self._names) < 65_536:
                    self._names[tid] = name
            out[k] = tenant_tag(name, self._secret)
        return out

    async def close(self) -> None:
        await self._r.aclose()


class VLLMEventPublisher:
    def __init__(self, cfg: PublisherConfig, secret: bytes) -> None:
        self.cfg = cfg
        self.secret = secret
        self._ctx = zmq.asyncio.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(cfg.hwm)
        self._replay: zmq.asyncio.Socket | None = None
        self._buffer: collections.deque[tuple[int, bytes]] = collections.deque(
            maxlen=cfg.buffer_steps)
        self._seq = 0
        self.endpoint = ""
        self.replay_endpoint = ""
        self.published = 0                      # batches sent

    def bind(self) -> VLLMEventPublisher:
        self._pub.bind(self.cfg.endpoint)
        self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
        if self.cfg.replay_endpoint:
            self._replay = self._ctx.socket(zmq.ROUTER)
            self._replay.bind(self.cfg.replay_endpoint)
            self.replay_endpoint = self._replay.getsockopt_string(zmq.LAST_ENDPOINT)
        return self

    async def publish(self, batch: KVEventBatch) -> None:
        payload = encode(batch)
        seq = self._seq
        self._seq += 1
        await self._pub.send_multipart((self.cfg.topic.encode(), seq_bytes(seq), payload))
        self._buffer.append((seq, payload))
        self.published += 1

    async def _serve_replay(self, stop: asyncio.Event) -> None:
        assert self._replay is not None
        while not stop.is_set():
            if not await self._replay.poll(self.cfg.block_ms):
                continue
            frames = await self._replay.recv_multipart()
            if len(frames) != 3 or len(frames[2]) != 8:
                continue                          # not a replay request: ignore it
            client, start = frames[0], int.from_bytes(frames[2], "big")
            for seq, payload in list(self._buffer):
                if seq >= start:
                    await self._replay.send_multipart(
                        (client, b"", self.cfg.topic.encode(), seq_bytes(seq), payload))
            await self._replay.send_multipart((client, b"", b"", END_SEQ, b""))

    async def run(self, stop: asyncio.Event, *, start_id: str = "$") -> None:
        """Follow the warehouse's stream and publish until ``stop`` is set."""
        reader = EventReader(self.cfg.redis_url, start_id=start_id)
        await reader.pin()
        tags = TenantTags(self.cfg.redis_url, self.secret)
        replay = (asyncio.get_running_loop().create_task(self._serve_replay(stop))
                  if self._replay is not None else None)
        try:
            while not stop.is_set():
                try:
                    events = await reader.read(block_ms=self.cfg.block_ms)
                except Exception as exc:           # Redis hiccup: keep going
                    log.warning("KV event stream read failed: %s", exc)
                    await asyncio.sleep(self.cfg.block_ms / 1000)
                    continue
                stored = [k for ev in events if ev.kind == KIND_STORED and ev.tier in MEDIUMS
                          for k in ev.keys]
                batch = batch_of(events, await tags.of(stored), self.cfg.block_tokens)
                if batch is not None:
                    await self.publish(batch)
        finally:
            if replay is not None:
                await replay
            await tags.close()
            await reader.close()

    def close(self) -> None:
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)
        self._ctx.term()


__all__ = ["MEDIUMS", "PublisherConfig", "TenantTags", "VLLMEventPublisher", "batch_of"]
