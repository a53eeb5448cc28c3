"""The block index in Redis (docs/architecture.md#redis-control-plane): one key per
block, EXPIRE = TTL.

Key:   b"B" + the 16-byte block key (17 bytes; our other keys start "kvserve:").
Value: 16 packed bytes ``<BBHIII`` = tier mask, class id, node id, payload
       size, last refresh (unix seconds), tenant namespace id. An embstr, so
       one allocation.

Invariants
- An entry exists only while some tier holds a complete copy (the warehouse
  indexes a block after its tier write returned), so no reader sees a torn
  block. Local tiers (G1-G3) belong to the entry's node; G4 is shared.
- Every change and its KV event (kvstore.events) happen in one Lua script.
- A node's G2 keys are also listed in the set ``kvserve:g2:<node>``: G2 dies
  with the process, and on restart the store clears exactly those bits
  (``reconcile_g2``) without scanning the whole index.
- TTL refresh on hit is amortized: an entry is rewritten only when its
  refresh stamp is older than ``refresh_fraction`` of its TTL, so hot chains
  cost MGETs, not thousands of SETs, per lookup.
- The TTL of a block is the longest of the classes that used it: a chat
  request hitting an agent block moves it to the chat class.

Node and class names map to small ids through the hash ``kvserve:ids``; every
store re-asserts its own ids, so a FLUSHALL cannot make two names share one.
Tenant namespaces get ids the same way (``tenant:`` space): an entry belongs to
the namespace that stored it first; a lookup for another namespace stops there
and a store for another namespace leaves it alone (docs/security.md). Only a
store (or a reindex) creates a tenant id, up to ``max_tenants`` names; a
lookup for a name without one matches nothing and creates nothing, so
requests cannot grow the table (Redis runs ``noeviction``).
"""

from __future__ import annotations

import struct
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from string import Template

import numpy as np
from redis.exceptions import RedisError

from common.config import TrafficClasses
from kvstore import events, index_cluster
from kvstore.errors import InvalidRequest, StoreUnavailable
from kvstore.index_ids import IDS_HASH, IdTable
from kvstore.keys import DEFAULT_TENANT
from kvstore.redis_conn import connect, is_cluster_url
from kvstore.types import LOCAL_TIERS_MASK, TIER_BITS
from security.redact import redact_url

KEY_BYTES = 16
PREFIX = b"B"
ENTRY = struct.Struct("<BBHIII")          # mask, class id, node id, size, stamp, tenant id
RECORD = struct.Struct("<16sIBII")        # key, size, class id, ttl, tenant id (store input)
EPOCH_KEY = "kvserve:index:epoch"
MAX_NODE_ID = 65_535
MAX_CLASS_ID = 255
ALL_TIERS_MASK = sum(TIER_BITS.values())
# Keys per MGET inside Lua: a small first probe (a cold prompt misses at once),
# then large batches (fewer calls; Lua's unpack() is limited to ~8,000 values).
_TENANT_ID = struct.Struct("<I")
_MGET_FIRST = 32
_MGET_BATCH = 4096


def g2_set_name(node: str) -> str:
    return f"kvserve:g2:{node}"


def index_key(key: bytes) -> bytes:
    return PREFIX + key


# ARGV: the chain's index keys concatenated (17 bytes each, "B" + key), touch, now,
# request class id, refresh fraction, node id, local mask, shared mask, the tenant
# namespace id (4 packed bytes, compared with each entry's last 4), then the TTL per
# class id. Keys travel as one blob: declaring 2,048 KEYS halves the
# server's time but triples the client's (redis-py packs each argument in Python);
# one blob is the cheaper total (on a Redis Cluster each master gets one blob of its
# keys, kvstore/index_cluster.py). The blob carries the "B" prefix so each key is one
# string.sub, not a sub plus a concat.
# Per entry the hot path reads only the bytes it tests (string.byte: mask and
# node, the stamp only when the class could need a refresh) and keeps MGET's own
# reply strings, concatenated in one table.concat up to the first stop; a full
# struct.unpack/pack happens only for the rare entry that is rewritten. This
# halves the script's time for a hot 2,048-block chain.
_LUA_LOOKUP = Template("""
local blob = ARGV[1]
local touch = ARGV[2] == '1'
local now = tonumber(ARGV[3])
local req = tonumber(ARGV[4])
local frac = tonumber(ARGV[5])
local me = tonumber(ARGV[6])
local lmask = tonumber(ARGV[7])
local smask = tonumber(ARGV[8])
local tenant = ARGV[9]
local byte, sub, band = string.byte, string.sub, bit.band
local any_node = me < 0
local me_lo, me_hi = me % 256, math.floor(me / 256) % 256
local function ttl_of(c) return tonumber(ARGV[10 + c] or '0') or 0 end
-- Per mask byte: 2 = a shared tier, 1 = only local tiers, 0 = nothing this node serves.
local serves = {}
for m = 0, 255 do
  if band(m, smask) ~= 0 then serves[m] = 2 elseif band(m, lmask) ~= 0 then serves[m] = 1
  else serves[m] = 0 end
end
-- Per stored class id: false (never refresh) or {new class, new ttl, always, amortize}.
local plan = {}
local rt = ttl_of(req)
local function plan_of(c)
  local bt = ttl_of(c)
  local nc, nt = c, bt
  if rt > bt then nc, nt = req, rt end
  local p = false
  -- Stamps are whole seconds: TTLs too short to amortize are always refreshed.
  if nt > 0 then p = {nc, nt, nc ~= c or nt * frac < 1, nt * frac} end
  plan[c] = p
  return p
end
local n = #blob / 17
local got = {}
local g = 0
local i = 1
local step = $first
while i <= n do
  local j = math.min(n, i + step - 1)
  step = $batch
  local ks = {}
  for t = i, j do ks[t - i + 1] = sub(blob, t * 17 - 16, t * 17) end
  local vals = redis.call('MGET', unpack(ks))
  local stop = #vals + 1
  for t = 1, #vals do
    local v = vals[t]
    if not v then stop = t break end
    local mask, cls, lo, hi = byte(v, 1, 4)
    local s = serves[mask]
    -- A malformed value (wrong length) or another tenant's entry ends the match
    -- like a missing one.
    if #v ~= 16 or s == 0 or (s == 1 and not any_node and (lo ~= me_lo or hi ~= me_hi))
        or sub(v, 13, 16) ~= tenant then
      stop = t break
    end
    if touch then
      local p = plan[cls]
      if p == nil then p = plan_of(cls) end
      if p then
        local refresh = p[3]
        if not refresh then
          local s1, s2, s3, s4 = byte(v, 9, 12)
          refresh = now - (s1 + 256 * s2 + 65536 * s3 + 16777216 * s4) >= p[4]
        end
        if refresh then
          local _, _, node, size = struct.unpack('<BBHII', v)
          v = struct.pack('<BBHII', mask, p[1], node, size, now) .. tenant
          redis.call('SET', ks[t], v, 'EX', p[2])
          vals[t] = v
        end
      end
    end
  end
  if stop > 1 then
    g = g + 1
    got[g] = table.concat(vals, '', 1, stop - 1)
  end
  if stop <= #vals then break end
  i = j + 1
end
return table.concat(got)
""").substitute(first=_MGET_FIRST, batch=_MGET_BATCH)

# ARGV: records, tier bit, node id, now, g2 set ('' = none), stream ('' = none),
# maxlen, node name, tier name, instance, then (field, value) id re-assertions.
_LUA_STORE = Template("""
local blob = ARGV[1]
local tbit = tonumber(ARGV[2])
local me = tonumber(ARGV[3])
local now = tonumber(ARGV[4])
local g2set, stream = ARGV[5], ARGV[6]
local LOCAL = $local_mask
for a = 11, #ARGV, 2 do redis.call('HSETNX', '$ids', ARGV[a], ARGV[a + 1]) end
local n = #blob / 29
local created = 0
local changed = {}
for i = 1, n do
  local key = string.sub(blob, i * 29 - 28, i * 29 - 13)
  local size, cls, ttl = struct.unpack('<IBI', blob, i * 29 - 12)
  local tenant = string.sub(blob, i * 29 - 3, i * 29)
  local k = 'B' .. key
  local v = redis.call('GET', k)
  if not v or #v ~= 16 then
    redis.call('SET', k, struct.pack('<BBHII', tbit, cls, me, size, now) .. tenant, 'EX', ttl)
    created = created + 1
    changed[#changed + 1] = key
  else
    local mask, ocls, node, osize, stamp = struct.unpack('<BBHII', v)
    local is_local = bit.band(tbit, LOCAL) ~= 0
    -- Another tenant namespace's entry is never merged into (docs/security.md).
    if string.sub(v, 13, 16) == tenant
        and not (is_local and node ~= me and bit.band(mask, LOCAL) ~= 0) then
      if is_local then node = me end
      mask = bit.bor(mask, tbit)
      local left = redis.call('TTL', k)
      if ttl >= left then
        redis.call('SET', k, struct.pack('<BBHII', mask, cls, node, size, now) .. tenant,
                   'EX', ttl)
      else
        redis.call('SET', k, struct.pack('<BBHII', mask, ocls, node, size, stamp) .. tenant,
                   'KEEPTTL')
      end
      changed[#changed + 1] = key
    end
  end
end
if g2set ~= '' and #changed > 0 then
  for i = 1, #changed do redis.call('SADD', g2set, changed[i]) end
end
if stream ~= '' and #changed > 0 then
  redis.call('XADD', stream, 'MAXLEN', '~', ARGV[7], '*', 'kind', 'stored', 'node', ARGV[8],
             'tier', ARGV[9], 'instance', ARGV[10], 'keys', table.concat(changed))
end
return created
""").substitute(local_mask=LOCAL_TIERS_MASK, ids=IDS_HASH)

# ARGV: keys, tier bit, node id, g2 set, stream, maxlen, node name, tier name, instance
_LUA_CLEAR = Template("""
local blob = ARGV[1]
local tbit = tonumber(ARGV[2])
local me = tonumber(ARGV[3])
local g2set, stream = ARGV[4], ARGV[5]
local LOCAL = $local_mask
local n = #blob / 16
local removed = 0
local changed = {}
for i = 1, n do
  local key = string.sub(blob, i * 16 - 15, i * 16)
  local k = 'B' .. key
  local v = redis.call('GET', k)
  if v then
    local mask, cls, node, size, stamp = struct.unpack('<BBHII', v)
    local mine = bit.band(tbit, LOCAL) == 0 or node == me
    if mine and bit.band(mask, tbit) ~= 0 then
      mask = bit.band(mask, bit.bnot(tbit))
      if mask == 0 then
        redis.call('DEL', k)
        removed = removed + 1
      else
        redis.call('SET', k, struct.pack('<BBHII', mask, cls, node, size, stamp)
                   .. string.sub(v, 13, 16), 'KEEPTTL')
      end
      changed[#changed + 1] = key
    end
  end
  if g2set ~= '' then redis.call('SREM', g2set, key) end
end
if stream ~= '' and #changed > 0 then
  redis.call('XADD', stream, 'MAXLEN', '~', ARGV[6], '*', 'kind', 'evicted', 'node', ARGV[7],
             'tier', ARGV[8], 'instance', ARGV[9], 'keys', table.concat(changed))
end
return removed
""").substitute(local_mask=LOCAL_TIERS_MASK)

# Redis Cluster variants (kvstore.index_cluster): per-key GETs instead of MGET, and
# store/clear return the keys they changed (events and G2 set go out after the call).
_LUA_LOOKUP_CLUSTER = index_cluster.cluster_lookup_script(_LUA_LOOKUP,
                                                          "redis.call('MGET', unpack(ks))")
_LUA_STORE_CLUSTER = index_cluster.returning_changes(_LUA_STORE, "return created", "created")
_LUA_CLEAR_CLUSTER = index_cluster.returning_changes(_LUA_CLEAR, "return removed", "removed")


@dataclass(frozen=True, slots=True)
class IndexEntry:
    tiers: int          # bit mask of kvstore.types.TIER_BITS
    class_id: int
    node_id: int
    size: int
    stamp: int          # last TTL refresh, unix seconds
    tenant_id: int = 0  # the tenant namespace that stored it (BlockIndex.tenant_id)

    @classmethod
    def unpack(cls, raw: bytes) -> IndexEntry:
        return cls(*ENTRY.unpack(raw))


_ENTRY_DTYPE = np.dtype([("tiers", "u1"), ("class_id", "u1"), ("node_id", "<u2"),
                         ("size", "<u4"), ("stamp", "<u4"), ("tenant_id", "<u4")])
assert _ENTRY_DTYPE.itemsize == ENTRY.size


@dataclass(frozen=True, slots=True)
class ChainMatch:
    """The leading entries of a key chain that the asking node can fetch, as
    the packed reply (decoded lazily: a 2,048-block chain is one numpy view,
    not 2,048 Python objects)."""

    raw: bytes
    lookup_s: float

    @property
    def matched(self) -> int:
        return len(self.raw) // ENTRY.size

    @property
    def table(self) -> np.ndarray:
        """Structured array with fields tiers, class_id, node_id, size, stamp, tenant_id."""
        return np.frombuffer(self.raw, dtype=_ENTRY_DTYPE)

    @property
    def entries(self) -> list[IndexEntry]:
        return [IndexEntry(*e) for e in ENTRY.iter_unpack(self.raw)]


@dataclass(frozen=True, slots=True)
class IndexRecord:
    """One block to index: its key, payload size, class and TTL (None = the
    class TTL; reindex passes what is left of the file's original TTL)."""

    key: bytes
    size: int
    traffic_class: str
    ttl_s: int | None = None
    tenant: str = DEFAULT_TENANT


def _check_keys(keys: Sequence[bytes]) -> bytes:
    try:
        blob = b"".join(keys)
    except TypeError:
        blob = b""
    if len(blob) == KEY_BYTES * len(keys) and all(len(k) == KEY_BYTES for k in keys):
        return blob
    for i, k in enumerate(keys):
        if not isinstance(k, bytes | bytearray) or len(k) != KEY_BYTES:
            raise InvalidRequest(
                f"key {i} is not a {KEY_BYTES}-byte block key (got {len(k)} bytes)")
    return blob


class BlockIndex:
    """Async Redis block index of one node; ``await start()`` before use."""

    def __init__(self, redis_url: str, *, node: str, classes: TrafficClasses,
                 instance: str = "", publish_events: bool = True,
                 event_maxlen: int = events.DEFAULT_MAXLEN,
                 refresh_fraction: float = 0.01, max_tenants: int = 4096) -> None:
        if not 0.0 <= refresh_fraction < 1.0:
            raise ValueError(f"refresh_fraction must be in [0, 1), got {refresh_fraction}")
        self.redis_url = redis_url
        self.node = node
        self.instance = instance or node
        self.classes = classes
        self._stream = events.STREAM if publish_events else ""
        self._maxlen = event_maxlen
        self._frac = refresh_fraction
        self._r = connect(redis_url, socket_timeout=10.0)
        # A cluster URL: scripts run per master (kvstore.index_cluster); None = one server.
        self._cluster = index_cluster.ClusterOps(
            redis_url, self._r, lookup=_LUA_LOOKUP_CLUSTER, store=_LUA_STORE_CLUSTER,
            clear=_LUA_CLEAR_CLUSTER, entry_size=ENTRY.size, record_size=RECORD.size,
            socket_timeout=10.0) if is_cluster_url(redis_url) else None
        self._lookup = self._r.register_script(_LUA_LOOKUP)
        self._store = self._r.register_script(_LUA_STORE)
        self._clear = self._r.register_script(_LUA_CLEAR)
        self.ids = IdTable(self._r, max_tenants=max_tenants)
        self.node_id = -1
        self.class_ids: dict[str, int] = {}
        self._ttl_argv: list[int] = []
        self._reassert: list[str | int] = []

    # -- lifecycle ---------------------------------------------------------------------------
    async def start(self) -> BlockIndex:
        try:
            self.node_id = await self.ids.ensure("node", self.node, MAX_NODE_ID)
            for name in sorted(self.classes.ttl_s):
                self.class_ids[name] = await self.ids.ensure("class", name, MAX_CLASS_ID)
        except RedisError as exc:
            raise StoreUnavailable(f"Redis at {redact_url(self.redis_url)} unavailable: "
                                   f"{exc}") from exc
        top = max(self.class_ids.values())
        ttl_by_id = dict.fromkeys(range(top + 1), 0)
        for name, cid in self.class_ids.items():
            ttl_by_id[cid] = self.classes.ttl_s[name]
        self._ttl_argv = [ttl_by_id[i] for i in range(top + 1)]
        pairs: list[tuple[str, str | int]] = [(f"node:n:{self.node}", self.node_id),
                                              (f"node:i:{self.node_id}", self.node)]
        for name, cid in self.class_ids.items():
            pairs += [(f"class:n:{name}", cid), (f"class:i:{cid}", name)]
        self._reassert = [x for p in pairs for x in p]
        return self

    @property
    def cluster_errors(self) -> int:
        """Failed per-master calls on a Redis Cluster (0 on one server)."""
        return self._cluster.errors if self._cluster is not None else 0

    async def close(self) -> None:
        if self._cluster is not None:
            await self._cluster.aclose()
        await self._r.aclose()

    async def __aenter__(self) -> BlockIndex:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def class_id(self, traffic_class: str) -> int:
        return self.class_ids[self.classes.resolve(traffic_class)]

    async def tenant_id(self, tenant: str) -> int:
        """The namespace id of ``tenant``, created on first use (kvstore.index_ids)."""
        return await self.ids.tenant_id(tenant or DEFAULT_TENANT)

    # -- reads -------------------------------------------------------------------------------
    async def match_chain(self, keys: Sequence[bytes], *, traffic_class: str = "",
                          touch: bool = True, local_only: bool = True,
                          tenant: str = DEFAULT_TENANT) -> ChainMatch:
        """Longest prefix of ``keys`` with an entry of ``tenant``'s namespace
        that this node can serve (its own G2/G3 or the shared G4; any node's
        tiers when ``local_only`` is False), in one round trip; refreshes the
        matched entries' TTLs when ``touch``."""
        _check_keys(keys)
        t0 = time.perf_counter()
        if not keys:
            return ChainMatch(b"", 0.0)
        blob = PREFIX + PREFIX.join(keys)
        local_mask = TIER_BITS["G2"] | TIER_BITS["G3"] if local_only else ALL_TIERS_MASK
        shared_mask = TIER_BITS["G4"] if local_only else ALL_TIERS_MASK
        me = self.node_id if local_only else -1
        known = await self.ids.known_tenant_id(tenant or DEFAULT_TENANT)
        if known is None:   # a namespace that never stored a block has no entries
            return ChainMatch(b"", time.perf_counter() - t0)
        tid = _TENANT_ID.pack(known)
        args = [int(touch), int(time.time()), self.class_id(traffic_class), self._frac,
                me, local_mask, shared_mask, tid, *self._ttl_argv]
        try:
            if self._cluster is not None:
                raw = await self._cluster.lookup(blob, len(PREFIX) + KEY_BYTES, args)
            else:
                raw = await self._lookup(keys=[], args=[blob, *args])
        except RedisError as exc:
            raise StoreUnavailable(f"index lookup failed: {exc}") from exc
        return ChainMatch(bytes(raw), time.perf_counter() - t0)

    async def entries(self, keys: Sequence[bytes]) -> list[IndexEntry | None]:
        _check_keys(keys)
        if not keys:
            return []
        mget = self._r.mget_nonatomic if self._cluster is not None else self._r.mget
        raw = await mget([index_key(k) for k in keys])
        return [IndexEntry.unpack(v) if v is not None and len(v) == ENTRY.size else None
                for v in raw]

    async def ttl(self, key: bytes) -> float:
        """Seconds left on the key's entry; -2 when it has none."""
        ms = await self._r.pttl(index_key(key))
        return ms / 1000.0 if ms >= 0 else float(ms)

    async def memory_usage(self, key: bytes) -> int:
        if self._cluster is not None:  # redis-py cannot route MEMORY USAGE by its key
            node = self._r.get_node_from_key(index_key(key))
            return int(await self._r.execute_command("MEMORY USAGE", index_key(key),
                                                     target_nodes=node) or 0)
        return int(await self._r.memory_usage(index_key(key)) or 0)

    async def scan_keys(self, count: int = 1000) -> AsyncIterator[bytes]:
        """Every indexed block key (SCAN; for audits and tests, not hot paths)."""
        async for k in self._r.scan_iter(match=PREFIX + b"*", count=count):
            if len(k) == len(PREFIX) + KEY_BYTES:
                yield k[len(PREFIX):]

    async def node_name(self, node_id: int) -> str:
        v = await self._r.hget(IDS_HASH, f"node:i:{node_id}")
        return v.decode() if v else ""

    # -- writes ------------------------------------------------------------------------------
    async def add(self, records: Sequence[IndexRecord], *, tier: str) -> int:
        """Mark ``records`` present in ``tier`` on this node; returns how many
        entries were created (the rest already existed and gained the tier)."""
        if not records:
            return 0
        bit = TIER_BITS[tier]
        parts = []
        for r in records:
            cid = self.class_id(r.traffic_class)
            ttl = r.ttl_s if r.ttl_s is not None else self._ttl_argv[cid]
            if len(r.key) != KEY_BYTES:
                raise InvalidRequest(f"key is not {KEY_BYTES} bytes")
            tid = await self.tenant_id(r.tenant)
            parts.append(RECORD.pack(r.key, r.size, cid, max(1, int(ttl)), tid))
        g2 = g2_set_name(self.node) if tier == "G2" else ""
        try:
            if self._cluster is not None:
                return await self._cluster.store(
                    b"".join(parts), [bit, self.node_id, int(time.time()), "", "", self._maxlen,
                                      self.node, tier, self.instance],
                    g2set=g2, stream=self._stream, maxlen=self._maxlen,
                    fields=self._event_fields(events.KIND_STORED, tier),
                    reassert=self._reassert, ids_hash=IDS_HASH, prefix=PREFIX)
            return int(await self._store(keys=[], args=[
                b"".join(parts), bit, self.node_id, int(time.time()), g2, self._stream,
                self._maxlen, self.node, tier, self.instance, *self._reassert]))
        except RedisError as exc:
            raise StoreUnavailable(f"index update failed: {exc}") from exc

    async def remove(self, keys: Sequence[bytes], *, tier: str) -> int:
        """Clear ``tier`` from this node's entries; entries left with no tier
        are deleted (returned count)."""
        if not keys:
            return 0
        g2 = g2_set_name(self.node) if tier == "G2" else ""
        try:
            if self._cluster is not None:
                return await self._cluster.clear(
                    _check_keys(keys), [TIER_BITS[tier], self.node_id, "", "", self._maxlen,
                                        self.node, tier, self.instance],
                    g2set=g2, stream=self._stream, maxlen=self._maxlen,
                    fields=self._event_fields(events.KIND_EVICTED, tier), prefix=PREFIX)
            return int(await self._clear(keys=[], args=[
                _check_keys(keys), TIER_BITS[tier], self.node_id, g2, self._stream,
                self._maxlen, self.node, tier, self.instance]))
        except RedisError as exc:
            raise StoreUnavailable(f"index update failed: {exc}") from exc

    async def delete(self, keys: Sequence[bytes]) -> int:
        """Drop entries whatever tiers they list (Delete RPC, sweeper)."""
        blob = _check_keys(keys)
        if not keys:
            return 0
        if self._cluster is not None:
            return await self._delete_cluster(keys, blob)
        pipe = self._r.pipeline(transaction=True)
        pipe.delete(*[index_key(k) for k in keys])
        pipe.srem(g2_set_name(self.node), *keys)
        if self._stream:
            pipe.xadd(self._stream, {"kind": events.KIND_DELETED, "node": self.node, "tier": "",
                                     "instance": self.instance, "keys": blob},
                      maxlen=self._maxlen, approximate=True)
        res = await pipe.execute()
        return int(res[0])

    async def _delete_cluster(self, keys: Sequence[bytes], blob: bytes) -> int:
        # Keys of many slots: redis-py splits the DEL per slot; the set and the
        # event are separate calls (no cross-slot transaction on a cluster).
        try:
            n = int(await self._r.delete(*[index_key(k) for k in keys]))
            await self._r.srem(g2_set_name(self.node), *keys)
            if self._stream:
                await self._r.xadd(self._stream, {**self._event_fields(events.KIND_DELETED, ""),
                                                  "keys": blob},
                                   maxlen=self._maxlen, approximate=True)
        except RedisError as exc:
            raise StoreUnavailable(f"index update failed: {exc}") from exc
        return n

    def _event_fields(self, kind: str, tier: str) -> dict[str, str]:
        return {"kind": kind, "node": self.node, "tier": tier, "instance": self.instance}

    async def reconcile_g2(self, batch: int = 4096) -> int:
        """G2 died with the previous process: clear this node's G2 bits.
        Returns the number of entries that pointed at G2."""
        name = g2_set_name(self.node)
        members = [k for k in await self._r.smembers(name) if len(k) == KEY_BYTES]
        for i in range(0, len(members), batch):
            await self.remove(members[i:i + batch], tier="G2")
        await self._r.delete(name)
        return len(members)

    async def mark_epoch(self) -> None:
        """A marker with no TTL: when it is gone, Redis lost its data (flush or
        restart) and the sweeper must rebuild rather than delete."""
        await self._r.set(EPOCH_KEY, str(time.time()))

    async def epoch_present(self) -> bool:
        return bool(await self._r.exists(EPOCH_KEY))

