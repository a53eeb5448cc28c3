"""KV events on the Redis stream ``kvserve:events`` (docs/architecture.md#redis-control-plane).

The index writes them inside its own Lua scripts, so an index change and its
event are one atomic step: a reader never sees a block the stream did not
announce. One stream entry covers a whole batch (``keys`` is the 16-byte
block keys concatenated), which keeps the stream ~40x smaller than one entry
per block. The router follows the stream with ``EventReader``.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass

from kvstore.redis_conn import connect

STREAM = "kvserve:events"
DEFAULT_MAXLEN = 100_000          # approximate trim; old events age out
KEY_BYTES = 16

KIND_STORED = "stored"
KIND_EVICTED = "evicted"
KIND_DELETED = "deleted"
KINDS = frozenset({KIND_STORED, KIND_EVICTED, KIND_DELETED})


@dataclass(frozen=True, slots=True)
class KVEvent:
    """A batch of blocks that entered (``stored``) or left (``evicted`` /
    ``deleted``) ``tier`` on ``node``; ``instance`` names the kvstore."""

    id: str
    kind: str
    node: str
    tier: str
    instance: str
    keys: tuple[bytes, ...]


def decode_event(entry_id: bytes | str, fields: dict[bytes, bytes]) -> KVEvent:
    blob = fields.get(b"keys", b"")
    if len(blob) % KEY_BYTES:
        raise ValueError(f"event {entry_id!r}: keys field of {len(blob)} bytes is not 16-byte keys")
    kind = fields.get(b"kind", b"").decode()
    if kind not in KINDS:
        raise ValueError(f"event {entry_id!r}: unknown kind {kind!r}")
    return KVEvent(
        id=entry_id.decode() if isinstance(entry_id, bytes) else entry_id,
        kind=kind,
        node=fields.get(b"node", b"").decode(),
        tier=fields.get(b"tier", b"").decode(),
        instance=fields.get(b"instance", b"").decode(),
        keys=tuple(blob[i:i + KEY_BYTES] for i in range(0, len(blob), KEY_BYTES)),
    )


class EventReader:
    """Follows the stream from ``start_id`` ("$" = only events after ``pin()``
    or the first read, "0" = all retained). ``read`` returns the next batch,
    waiting up to ``block_ms``."""

    def __init__(self, redis_url: str, *, start_id: str = "$", stream: str = STREAM) -> None:
        self._redis = connect(redis_url)  # one server or a cluster (kvstore.redis_conn)
        self._stream = stream
        self._last = start_id

    async def pin(self) -> EventReader:
        """Resolve "$" to the stream's current end now, so the next read returns
        every event written after this call (XREAD's "$" would skip those that
        arrive between two reads)."""
        if self._last == "$":
            exists = await self._redis.exists(self._stream)
            info = await self._redis.xinfo_stream(self._stream) if exists else None
            self._last = info["last-generated-id"].decode() if info else "0-0"
        return self

    async def read(self, *, block_ms: int = 1000, count: int = 1000) -> list[KVEvent]:
        await self.pin()
        reply = await self._redis.xread({self._stream: self._last}, count=count,
                                        block=block_ms or None)
        events: list[KVEvent] = []
        for _stream, entries in reply or []:
            for entry_id, fields in entries:
                events.append(decode_event(entry_id, fields))
                self._last = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
        return events

    async def follow(self, *, block_ms: int = 1000) -> AsyncIterator[KVEvent]:
        while True:
            for ev in await self.read(block_ms=block_ms):
                yield ev
            await asyncio.sleep(0)

    async def close(self) -> None:
        await self._redis.aclose()

    async def __aenter__(self) -> EventReader:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
