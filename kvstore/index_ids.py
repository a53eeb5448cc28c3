"""Small ids for names the index packs into entries: nodes, traffic classes and
tenant namespaces, in the Redis hash ``kvserve:ids`` (kvstore/index.py says
how entries use them).

Fields: ``<space>:n:<name>`` -> id and ``<space>:i:<id>`` -> name, and
``<space>:#next`` the next id to try. Every store re-asserts its own node and
class ids, so a FLUSHALL cannot make two names share one.

The tenant space is bounded (``max_tenants``): a name gets an id only when it
first *stores* a block (or a reindex finds one); a lookup for a name without
an id matches nothing and writes nothing, so no request can grow the table,
which lives in a Redis that runs ``noeviction``. A name beyond the bound is
refused with ResourceExhausted.
"""

from __future__ import annotations

from string import Template
from typing import Any

from redis.exceptions import RedisError, ResponseError

from kvstore.errors import ResourceExhausted, StoreUnavailable

IDS_HASH = "kvserve:ids"
MAX_TENANT_ID = 2**32 - 1
_CACHED_NAMES = 65_536      # this process's memory of name -> id (names come from requests)

_LUA_ENSURE_ID = Template("""
local h, name, limit = '$ids', ARGV[1], tonumber(ARGV[2])
local id = redis.call('HGET', h, ARGV[3] .. 'n:' .. name)
if id then return tonumber(id) end
-- Full: refuse before counting, so refusals do not advance the counter.
if tonumber(redis.call('HGET', h, ARGV[3] .. '#next') or '0') > limit then
  return redis.error_reply('id space exhausted for ' .. ARGV[3])
end
local nid = redis.call('HINCRBY', h, ARGV[3] .. '#next', 1) - 1
while redis.call('HEXISTS', h, ARGV[3] .. 'i:' .. nid) == 1 do
  nid = redis.call('HINCRBY', h, ARGV[3] .. '#next', 1) - 1
end
if nid > limit then return redis.error_reply('id space exhausted for ' .. ARGV[3]) end
redis.call('HSET', h, ARGV[3] .. 'n:' .. name, nid, ARGV[3] .. 'i:' .. nid, name)
return nid
""").substitute(ids=IDS_HASH)


class IdTable:
    def __init__(self, r: Any, *, max_tenants: int) -> None:
        if not 1 <= max_tenants <= MAX_TENANT_ID + 1:
            raise ValueError(f"max_tenants must be in 1..2^32, got {max_tenants}")
        self._r = r
        self.max_tenants = max_tenants
        self._ensure = r.register_script(_LUA_ENSURE_ID)
        self._tenant_ids: dict[str, int] = {}

    async def ensure(self, space: str, name: str, limit: int) -> int:
        """The id of ``name`` in ``space``, allocated if new (at most ``limit``)."""
        # KEYS names the hash only so a cluster client routes the call to its slot.
        return int(await self._ensure(keys=[IDS_HASH], args=[name, limit, f"{space}:"]))

    async def tenant_id(self, tenant: str) -> int:
        """The namespace id of ``tenant``, created on first use: one round trip the
        first time per process; ResourceExhausted once ``max_tenants`` names hold one."""
        tid = self._tenant_ids.get(tenant)
        if tid is None:
            try:
                tid = await self.ensure("tenant", tenant, self.max_tenants - 1)
            except ResponseError as exc:
                if "id space exhausted" not in str(exc):
                    raise StoreUnavailable(f"index update failed: {exc}") from exc
                raise ResourceExhausted(
                    f"the tenant-name table is full ({self.max_tenants} names, "
                    "[quotas].max_tenants): a new tenant cannot store blocks until an "
                    "operator raises the limit") from None
            except RedisError as exc:
                raise StoreUnavailable(f"index unavailable: {exc}") from exc
            self._remember(tenant, tid)
        return tid

    async def known_tenant_id(self, tenant: str) -> int | None:
        """The namespace id of ``tenant`` if it ever stored a block, else None; never
        creates one."""
        tid = self._tenant_ids.get(tenant)
        if tid is None:
            try:
                raw = await self._r.hget(IDS_HASH, f"tenant:n:{tenant}")
            except RedisError as exc:
                raise StoreUnavailable(f"index lookup failed: {exc}") from exc
            if raw is None:
                return None
            tid = int(raw)
            self._remember(tenant, tid)
        return tid

    async def tenant_count(self) -> int:
        """Tenant names that hold an id (ids are never reused)."""
        return int(await self._r.hget(IDS_HASH, "tenant:#next") or 0)

    def _remember(self, tenant: str, tid: int) -> None:
        if len(self._tenant_ids) < _CACHED_NAMES:
            self._tenant_ids[tenant] = tid


__all__ = ["IDS_HASH", "MAX_TENANT_ID", "IdTable"]
