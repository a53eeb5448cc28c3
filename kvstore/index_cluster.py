"""The block index's scripts on a Redis Cluster: one script call per master, in parallel.

Key placement (docs/warehouse-sizing.md has the reasoning): index keys keep
their single-server names (``B`` + 16-byte block key, no hash tag), so a
chain's keys spread over every slot. A block key alone names its slot, which
is what eviction, delete, the sweeper and reindex have (they never know a
chain's root), and no slot is hot because many chains share a first block
(a common system prompt). The price: a chain's lookup is one script per
master, sent concurrently (one round trip of wall time), and inside a script
each key is its own GET (Redis 6.2 refuses a multi-slot MGET even when every
slot is local).

Longest prefix across masters: each master walks its own keys in chain order
and stops at its first miss; the chain's match ends at the earliest of those
stops. A master may therefore refresh the TTL of entries after another
master's miss: such entries sit behind a missing block, so no lookup can
match them until that block is stored again, and the refresh only delays
their expiry.

Failover: a connection error or a refused key (slot moved) marks the slot map
stale, is counted in ``errors`` and raises; the caller maps it to
StoreUnavailable (recompute). The next call re-reads CLUSTER SLOTS from any
node that answers, so calls resume once a replica has been promoted.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Sequence
from typing import Any
from urllib.parse import unquote, urlsplit

import numpy as np
import redis.asyncio as aioredis
from redis.crc import key_slot
from redis.exceptions import NoScriptError, RedisError

from kvstore.redis_conn import plain_url

SLOTS = 16384


def _crc16_tables() -> tuple[np.ndarray, np.ndarray]:
    """CRC16-XMODEM tables: per byte, and per 16-bit word (the register is 16
    bits wide, so feeding a whole word from state s gives table16[s ^ word])."""
    t8 = np.zeros(256, dtype=np.uint32)
    for i in range(256):
        crc = i << 8
        for _ in range(8):
            crc = ((crc << 1) ^ 0x1021) if crc & 0x8000 else crc << 1
        t8[i] = crc & 0xFFFF
    word = np.arange(65536, dtype=np.uint32)
    c = t8[word >> 8]
    c = ((c << 8) & 0xFFFF) ^ t8[((c >> 8) ^ (word & 0xFF)) & 0xFF]
    return t8.astype(np.uint16), c.astype(np.uint16)


_CRC8, _CRC16 = _crc16_tables()


def key_slots(rows: np.ndarray) -> np.ndarray:
    """Redis Cluster slot of each row of ``rows`` (n x L uint8, one key per row):
    CRC16-XMODEM, vectorised over the keys one 16-bit word at a time (a Python
    loop over 2,048 keys would cost more than the lookup itself). Keys holding
    ``{`` may carry a hash tag; those few (~6% of random 17-byte keys) go
    through redis-py's rule."""
    n, width = rows.shape
    crc = np.zeros(n, dtype=np.uint16)
    start = width % 2
    if start:
        crc = _CRC8[rows[:, 0]]
    # Native-order columns, each contiguous: the loop then costs one XOR and one take.
    words = np.ascontiguousarray(rows[:, start:]).view(">u2").astype(np.uint16).T.copy()
    for col in words:
        crc = _CRC16.take(crc ^ col)
    slots = (crc & (SLOTS - 1)).astype(np.int64)
    # A hash tag needs a "{" and a later "}" with something between: find the rare
    # rows that have one without a Python loop over all of them.
    opened = rows == 0x7B
    has = np.flatnonzero(opened.any(axis=1))
    if len(has):
        sub = rows[has]
        first = opened[has].argmax(axis=1)
        cols = np.arange(rows.shape[1])
        closing = (sub == 0x7D) & (cols[None, :] > first[:, None] + 1)
        for i in has[closing.any(axis=1)].tolist():
            slots[i] = key_slot(rows[i].tobytes())
    return slots


def cluster_lookup_script(script: str, batch_fetch: str) -> str:
    """The single-server lookup script with its MGET replaced by per-key GETs."""
    if batch_fetch not in script:
        raise AssertionError("lookup script changed: update kvstore.index_cluster")
    per_key = ("{} for t = 1, #ks do vals[t] = redis.call('GET', ks[t]) end")
    return script.replace(batch_fetch, per_key)


def returning_changes(script: str, last_line: str, counter: str) -> str:
    """A store/clear script that also returns the keys it changed (the cluster
    backend writes their events and G2 set members after the call)."""
    if last_line not in script:
        raise AssertionError("index script changed: update kvstore.index_cluster")
    return script.replace(last_line, f"return {{{counter}, table.concat(changed)}}")


class ClusterScripts:
    """Slot map, one client per master, and scripts run per master in parallel."""

    def __init__(self, url: str, **client_kwargs: Any) -> None:
        parts = urlsplit(plain_url(url))
        self._seeds = [(parts.hostname or "127.0.0.1", parts.port or 6379)]
        self._auth = {"username": unquote(parts.username) if parts.username else None,
                      "password": unquote(parts.password) if parts.password else None}
        self._ssl = parts.scheme == "rediss"
        # A master that vanished without a reset (host down) must fail fast, not hang.
        self._kw = {"socket_connect_timeout": 2.0, **client_kwargs}
        self._clients: dict[tuple[str, int], aioredis.Redis] = {}
        self._masters: list[tuple[str, int]] = []
        self._slot_master = np.zeros(SLOTS, dtype=np.int16)
        self._stale = True
        self._lock = asyncio.Lock()
        self._shas: dict[str, str] = {}
        self.errors = 0          # failed calls or slot-map reads (failover, unreachable master)
        self.refreshes = 0       # slot map re-reads

    def _client(self, addr: tuple[str, int]) -> aioredis.Redis:
        c = self._clients.get(addr)
        if c is None:
            c = aioredis.Redis(host=addr[0], port=addr[1], ssl=self._ssl, **self._auth,
                               **self._kw)
            self._clients[addr] = c
        return c

    async def refresh(self) -> None:
        """Re-read CLUSTER SLOTS from the first node that answers."""
        async with self._lock:
            if not self._stale:
                return
            last: Exception | None = None
            for addr in [*self._masters, *self._clients, *self._seeds]:
                try:
                    slots = await self._client(addr).execute_command("CLUSTER SLOTS")
                except (RedisError, OSError) as exc:
                    last = exc
                    continue
                masters: list[tuple[str, int]] = []
                table = np.full(SLOTS, -1, dtype=np.int16)
                for start, end, master, *_ in slots:
                    host = master[0].decode() if isinstance(master[0], bytes) else master[0]
                    a = (host or addr[0], int(master[1]))
                    if a not in masters:
                        masters.append(a)
                    table[int(start):int(end) + 1] = masters.index(a)
                if (table < 0).any():
                    last = RedisError("cluster does not cover every slot (failover under way?)")
                    continue
                self._masters, self._slot_master = masters, table
                self._stale = False
                self.refreshes += 1
                return
            raise RedisError(f"no Redis Cluster node answered CLUSTER SLOTS: {last}")

    async def split(self, rows: np.ndarray) -> list[tuple[int, np.ndarray]]:
        """Per master: the row numbers (in order) of the keys it holds."""
        if self._stale:
            try:
                await self.refresh()
            except RedisError:
                self.errors += 1
                raise
        owner = self._slot_master[key_slots(rows)]
        order = np.argsort(owner, kind="stable")
        bounds = np.searchsorted(owner[order], np.arange(len(self._masters) + 1))
        return [(m, order[bounds[m]:bounds[m + 1]]) for m in range(len(self._masters))
                if bounds[m + 1] > bounds[m]]

    async def _eval(self, master: int, script: str, args: Sequence[Any]) -> Any:
        client = self._client(self._masters[master])
        sha = self._shas.get(script)
        if sha is None:
            sha = self._shas[script] = hashlib.sha1(script.encode()).hexdigest()
        try:
            return await client.evalsha(sha, 0, *args)
        except NoScriptError:
            return await client.eval(script, 0, *args)

    async def run(self, script: str, calls: Sequence[tuple[int, Sequence[Any]]]) -> list[Any]:
        """One script call per (master, args), concurrently; results in order."""
        # Every call is awaited to its end (no orphaned task) before one failure is raised.
        out = await asyncio.gather(*[self._eval(m, script, a) for m, a in calls],
                                   return_exceptions=True)
        failed = next((r for r in out if isinstance(r, BaseException)), None)
        if failed is None:
            return out
        self._stale = True
        self.errors += 1
        if isinstance(failed, RedisError | OSError):
            raise RedisError(f"cluster script failed: {failed}") from failed
        raise failed

    async def aclose(self) -> None:
        for c in self._clients.values():
            await c.aclose()
        self._clients.clear()


def merge_prefix(n: int, parts: Sequence[tuple[np.ndarray, bytes]], entry_size: int) -> bytes:
    """Join per-master replies (each: that master's row numbers, its entries up
    to its first stop) into the chain's longest matched prefix."""
    matched = n
    for rows, raw in parts:
        got = len(raw) // entry_size
        if got < len(rows):
            matched = min(matched, int(rows[got]))
    if matched == 0:
        return b""
    out = np.empty((matched, entry_size), dtype=np.uint8)
    for rows, raw in parts:
        k = int(np.searchsorted(rows, matched))
        if k:
            out[rows[:k]] = np.frombuffer(raw, dtype=np.uint8, count=k * entry_size).reshape(
                k, entry_size)
    return out.tobytes()


__all__ = ["ClusterScripts", "cluster_lookup_script", "key_slots", "merge_prefix",
           "returning_changes"]


class ClusterOps:
    """The index's script-backed operations on a Redis Cluster (kvstore.index
    delegates here when its URL is a cluster URL). Scripts change only index
    keys; the KV event, the G2 set members and the id re-assertions go out
    right after, through redis-py's cluster client: an index change and its
    event are no longer one atomic step (a crash between them loses the event;
    the router's view is a hint that lookups correct)."""

    def __init__(self, url: str, client: Any, *, lookup: str, store: str, clear: str,
                 entry_size: int, record_size: int, **client_kwargs: Any) -> None:
        self.shards = ClusterScripts(url, **client_kwargs)
        self._r = client
        self._lookup, self._store, self._clear = lookup, store, clear
        self._entry = entry_size
        self._record = record_size

    @property
    def errors(self) -> int:
        return self.shards.errors

    async def lookup(self, blob: bytes, stride: int, args: Sequence[Any]) -> bytes:
        """``blob``: the chain's index keys (``stride`` bytes each)."""
        rows = np.frombuffer(blob, dtype=np.uint8).reshape(-1, stride)
        split = await self.shards.split(rows)
        replies = await self.shards.run(
            self._lookup, [(m, [rows[idx].tobytes(), *args]) for m, idx in split])
        return merge_prefix(len(rows), [(idx, bytes(raw)) for (_m, idx), raw
                                        in zip(split, replies, strict=True)], self._entry)

    async def _per_master(self, script: str, blob: bytes, width: int, prefix: bytes,
                          args: Sequence[Any]) -> tuple[int, bytes]:
        rows = np.frombuffer(blob, dtype=np.uint8).reshape(-1, width)
        keys = np.empty((len(rows), len(prefix) + 16), dtype=np.uint8)
        keys[:, :len(prefix)] = np.frombuffer(prefix, dtype=np.uint8)
        keys[:, len(prefix):] = rows[:, :16]
        split = await self.shards.split(keys)
        replies = await self.shards.run(
            script, [(m, [rows[idx].tobytes(), *args]) for m, idx in split])
        return (sum(int(r[0]) for r in replies), b"".join(bytes(r[1]) for r in replies))

    async def store(self, records: bytes, args: Sequence[Any], *, g2set: str, stream: str,
                    maxlen: int, fields: dict[str, str], reassert: Sequence[Any],
                    ids_hash: str, prefix: bytes) -> int:
        created, changed = await self._per_master(self._store, records, self._record, prefix,
                                                  args)
        await self._after(changed, g2set=g2set, stream=stream, maxlen=maxlen, fields=fields,
                          add=True, reassert=reassert, ids_hash=ids_hash)
        return created

    async def clear(self, keys: bytes, args: Sequence[Any], *, g2set: str, stream: str,
                    maxlen: int, fields: dict[str, str], prefix: bytes) -> int:
        removed, changed = await self._per_master(self._clear, keys, 16, prefix, args)
        if g2set:
            await self._r.srem(g2set, *[keys[i:i + 16] for i in range(0, len(keys), 16)])
        await self._after(changed, g2set="", stream=stream, maxlen=maxlen, fields=fields,
                          add=False, reassert=(), ids_hash="")
        return removed

    async def _after(self, changed: bytes, *, g2set: str, stream: str, maxlen: int,
                     fields: dict[str, str], add: bool, reassert: Sequence[Any],
                     ids_hash: str) -> None:
        pipe = self._r.pipeline(transaction=False)
        for i in range(0, len(reassert), 2):
            pipe.hsetnx(ids_hash, reassert[i], reassert[i + 1])
        if changed and g2set and add:
            pipe.sadd(g2set, *[changed[i:i + 16] for i in range(0, len(changed), 16)])
        if changed and stream:
            pipe.xadd(stream, {**fields, "keys": changed}, maxlen=maxlen, approximate=True)
        if len(pipe):
            await pipe.execute()

    async def aclose(self) -> None:
        await self.shards.aclose()
