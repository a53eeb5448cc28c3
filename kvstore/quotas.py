"""Per-tenant byte quotas per tier: the config's ``[quotas]`` overlaid by the
operators' settings, which live in Redis so they survive restarts and reach
every store (docs/operators.md, "Per-tenant quotas").

Redis: one hash, ``kvserve:quotas``; field ``<tier>|<tenant>`` ("*" = every
tenant not listed), value the quota in bytes or "none" (explicitly no limit).
An operator's ``reset`` deletes the field, and the config's value applies
again. Stores read the hash at start and every ``[quotas].refresh_s``; the
store that took an operator's change applies it at once.

Enforcement is the tiers' (kvstore.eviction.tenants): a tenant over its quota
in a tier evicts its own blocks, never another tenant's.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Mapping
from dataclasses import dataclass

from redis.exceptions import RedisError

from common.config import ALL_TENANTS, QUOTA_TIERS, QuotaSection
from kvstore.blockfile import BlockMeta
from kvstore.errors import InvalidRequest, StoreUnavailable
from kvstore.redis_conn import connect
from kvstore.tiers import Tier
from kvstore.types import QuotaEntry, TenantSnapshot

QUOTA_HASH = "kvserve:quotas"
MAX_OPERATOR_ENTRIES = 65_536     # operator settings kept in Redis (bounded, names are input)
_TENANT = re.compile(r"^[A-Za-z0-9._-]{1,64}\Z")
_NO_LIMIT = "none"


@dataclass(frozen=True, slots=True)
class QuotaTable:
    """The effective quotas: (tier, tenant) -> bytes | None, with their source."""

    entries: tuple[QuotaEntry, ...] = ()

    def for_tier(self, tier: str) -> tuple[dict[str, int | None], int | None]:
        """Per-tenant quotas of ``tier`` (None: explicitly no limit, which escapes
        the default) and the default for unlisted tenants (None: no limit)."""
        limits: dict[str, int | None] = {}
        default: int | None = None
        for e in self.entries:
            if e.tier != tier:
                continue
            if e.tenant == ALL_TENANTS:
                default = e.quota_bytes
            else:
                limits[e.tenant] = e.quota_bytes
        return limits, default


def check_quota(tier: str, tenant: str, quota_bytes: int | None) -> None:
    if tier not in QUOTA_TIERS:
        raise InvalidRequest(f"tier {tier[:16]!r} takes no quota; one of {list(QUOTA_TIERS)}")
    if tenant != ALL_TENANTS and not _TENANT.match(tenant):
        raise InvalidRequest(f"tenant {tenant[:80]!r} is neither a tenant name "
                             "([A-Za-z0-9._-]{1,64}) nor \"*\" (every tenant not listed)")
    if quota_bytes is not None and not 0 <= quota_bytes < 2**63:
        raise InvalidRequest(f"quota_bytes must be >= 0 (or -1 for no limit), got {quota_bytes}")


def merge(config: QuotaSection, operator: Mapping[tuple[str, str], int | None]) -> QuotaTable:
    out: dict[tuple[str, str], QuotaEntry] = {}
    for tier in QUOTA_TIERS:
        for tenant, nbytes in config.table(tier).items():
            out[(tier, tenant)] = QuotaEntry(tier, tenant, nbytes, "config")
    for (tier, tenant), nbytes in operator.items():
        out[(tier, tenant)] = QuotaEntry(tier, tenant, nbytes, "operator")
    return QuotaTable(tuple(out[k] for k in sorted(out)))


class QuotaStore:
    """The operators' quota settings in Redis; ``await close()`` when done."""

    def __init__(self, redis_url: str) -> None:
        self._r = connect(redis_url, socket_timeout=10.0)

    async def load(self) -> dict[tuple[str, str], int | None]:
        try:
            raw = await self._r.hgetall(QUOTA_HASH)
        except RedisError as exc:
            raise StoreUnavailable(f"quota table unavailable: {exc}") from exc
        out: dict[tuple[str, str], int | None] = {}
        for field_, value in raw.items():
            tier, _, tenant = field_.decode(errors="replace").partition("|")
            text = value.decode(errors="replace")
            try:
                nbytes = None if text == _NO_LIMIT else int(text)
                check_quota(tier, tenant, nbytes)
            except (ValueError, InvalidRequest):
                continue            # not ours to interpret: ignored, never fatal
            out[(tier, tenant)] = nbytes
        return out

    async def set(self, tier: str, tenant: str, quota_bytes: int | None) -> None:
        check_quota(tier, tenant, quota_bytes)
        try:
            if await self._r.hlen(QUOTA_HASH) >= MAX_OPERATOR_ENTRIES and \
                    not await self._r.hexists(QUOTA_HASH, f"{tier}|{tenant}"):
                raise InvalidRequest(f"{MAX_OPERATOR_ENTRIES} operator quota settings exist; "
                                     "reset some, or set a \"*\" default instead")
            await self._r.hset(QUOTA_HASH, f"{tier}|{tenant}",
                               _NO_LIMIT if quota_bytes is None else str(quota_bytes))
        except RedisError as exc:
            raise StoreUnavailable(f"quota table unavailable: {exc}") from exc

    async def reset(self, tier: str, tenant: str) -> None:
        check_quota(tier, tenant, None)
        try:
            await self._r.hdel(QUOTA_HASH, f"{tier}|{tenant}")
        except RedisError as exc:
            raise StoreUnavailable(f"quota table unavailable: {exc}") from exc

    async def close(self) -> None:
        await self._r.aclose()


class QuotaKeeper:
    """Keeps one store's tiers on the effective quota table: applies it at start,
    after an operator's change, and when a refresh finds another store's change.
    Each apply returns the blocks it evicted, per tier, for the index."""

    def __init__(self, redis_url: str, config: QuotaSection, tiers: Mapping[str, Tier]) -> None:
        self.config = config
        self.tiers = tiers
        self.store = QuotaStore(redis_url)
        self.table = merge(config, {})

    async def refresh(self, force: bool = False) -> dict[str, list[BlockMeta]]:
        table = merge(self.config, await self.store.load())
        if table == self.table and not force:
            return {}
        self.table = table
        return await self._apply()

    async def set(self, tier: str, tenant: str, quota_bytes: int | None,
                  reset: bool = False) -> dict[str, list[BlockMeta]]:
        if reset:
            await self.store.reset(tier, tenant)
        else:
            await self.store.set(tier, tenant, quota_bytes)
        return await self.refresh()

    async def _apply(self) -> dict[str, list[BlockMeta]]:
        out: dict[str, list[BlockMeta]] = {}
        for name, tier in self.tiers.items():
            limits, default = self.table.for_tier(name)
            evicted = await asyncio.to_thread(tier.set_quotas, limits, default)
            if evicted:
                out[name] = evicted
        return out

    def usage(self, tenant: str = "") -> list[TenantSnapshot]:
        """Per tier and tenant: bytes, blocks, quota (-1: none), evictions; only
        ``tenant``'s rows when one is given (a tenant sees no one else's)."""
        rows = []
        for name, tier in self.tiers.items():
            for u in tier.tenant_usage():
                if u.tenant and (not tenant or u.tenant == tenant):
                    rows.append(TenantSnapshot(name, u.tenant, u.used_bytes, u.blocks,
                                               -1 if u.quota_bytes is None else u.quota_bytes,
                                               u.evictions))
        return rows

    async def close(self) -> None:
        await self.store.close()


__all__ = ["QUOTA_HASH", "QuotaEntry", "QuotaKeeper", "QuotaStore", "QuotaTable",
           "check_quota", "merge"]
