"""Per-tenant byte accounting, quotas and eviction inside one live tier
(docs/security.md, "Integrity at rest and quotas").

Every resident block has an owner, its tenant namespace ("" = not known yet:
a G4 object listed at start, attributed when first read). Each owner has its
own instance of the tier's eviction policy, so "the next block to evict" is
always asked *within* one owner. A put of ``size`` bytes by tenant T:

1. Quota: while T's bytes + size exceed T's quota in this tier, evict T's own
   next victim. A block larger than T's quota is not stored.
2. Capacity: while the tier's bytes + size exceed its capacity, evict from the
   owner holding the most bytes if it holds at least T's bytes + size (it
   keeps at least as much as T will have); otherwise T's own next victim. A T
   holding nothing, when no owner qualifies, takes from the largest owner
   (reachable only when every owner holds less than one such block).

What that guarantees (tests/kvstore/test_quotas.py):
- a tenant over its quota only ever evicts its own blocks;
- a put by T evicts U's block only when U holds at least as many bytes as T
  will: a flooding tenant pushes others down to its own level at most
  (max-min fair shares), never evicts everyone;
- when the quotas of the tenants holding blocks sum to at most the capacity,
  step 2 never runs while each is within its quota, so no tenant's activity
  evicts another's block: eviction carries no signal between tenants.

With a single owner this is exactly ``CapacityCache`` over the same policy;
the replay simulator keeps using ``CapacityCache``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

from kvstore.eviction.base import Admission, EvictionPolicy, make_policy

UNATTRIBUTED = ""


class TenantUsage(NamedTuple):
    tenant: str
    used_bytes: int
    blocks: int
    quota_bytes: int | None      # None: no per-tenant limit in this tier
    evictions: int               # blocks of this tenant evicted (quota or capacity)


class TenantCache:
    """Byte capacity and per-tenant quotas over one policy per tenant; holds sizes,
    never payloads. Not thread-safe (tiers call it under their lock)."""

    __slots__ = ("_counts", "_evicted", "_policies", "_policy", "_usage", "capacity_bytes",
                 "default_quota", "evictions", "owner", "quotas", "sizes", "used_bytes")

    def __init__(self, capacity_bytes: int, policy: str = "lru") -> None:
        if capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must be >= 0, got {capacity_bytes}")
        make_policy(policy)              # an unknown name fails here, not at the first put
        self.capacity_bytes = capacity_bytes
        self._policy = policy
        self.sizes: dict[Any, int] = {}
        self.owner: dict[Any, str] = {}
        self.used_bytes = 0
        self.evictions = 0
        self.quotas: dict[str, int | None] = {}   # None: explicitly no limit
        self.default_quota: int | None = None
        self._policies: dict[str, EvictionPolicy] = {}
        self._usage: dict[str, int] = {}
        self._counts: dict[str, int] = {}
        self._evicted: dict[str, int] = {}

    def __contains__(self, key: Any) -> bool:
        return key in self.sizes

    def __len__(self) -> int:
        return len(self.sizes)

    def quota(self, tenant: str) -> int | None:
        if tenant == UNATTRIBUTED:
            return None
        if tenant in self.quotas:
            return self.quotas[tenant]
        return self.default_quota

    def hit(self, key: Any, now: float) -> bool:
        owner = self.owner.get(key)
        if owner is None:
            return False
        self._policies[owner].touch(key, now)
        return True

    def put(self, key: Any, size: int, now: float, cls: str = "",
            tenant: str = UNATTRIBUTED) -> Admission:
        if key in self.sizes:
            self.hit(key, now)
            return Admission(True)
        limit = self.quota(tenant)
        if size > self.capacity_bytes or (limit is not None and size > limit):
            return Admission(False)
        pol = self._policies.get(tenant)
        if pol is None:
            pol = make_policy(self._policy)
        if not pol.admit(key, size, now, cls):
            return Admission(False)
        over_quota = limit is not None and self._usage.get(tenant, 0) + size > limit
        if (over_quota or self.used_bytes + size > self.capacity_bytes) \
                and pol.bypass_when_full(key):
            return Admission(False)
        evicted: list[Any] = []
        if limit is not None:
            while self._usage.get(tenant, 0) + size > limit:
                evicted.append(self._evict(tenant))
        while self.used_bytes + size > self.capacity_bytes:
            evicted.append(self._evict(self._victim_owner(tenant, size)))
        # After the evictions: taking a tenant's last block drops its policy entry.
        self._policies.setdefault(tenant, pol)
        self.sizes[key] = size
        self.owner[key] = tenant
        self.used_bytes += size
        self._usage[tenant] = self._usage.get(tenant, 0) + size
        self._counts[tenant] = self._counts.get(tenant, 0) + 1
        pol.insert(key, size, now, cls)
        return Admission(True, evicted)

    def discard(self, key: Any) -> bool:
        size = self.sizes.pop(key, None)
        if size is None:
            return False
        owner = self.owner.pop(key)
        self.used_bytes -= size
        self._usage[owner] -= size
        self._counts[owner] -= 1
        self._policies[owner].remove(key)
        if not self._counts[owner]:      # a tenant with no blocks costs no memory
            del self._counts[owner], self._usage[owner], self._policies[owner]
        return True

    def evict_one(self, tenant: str | None = None, size: int = 0) -> Any:
        """Evict the block a put of ``size`` bytes by ``tenant`` would evict next for
        capacity (None: the largest owner's next victim); returns its key."""
        if not self.sizes:
            raise LookupError("eviction requested from an empty cache")
        owner = self._victim_owner(tenant, size) if tenant is not None else self._largest()
        return self._evict(owner)

    def attribute(self, key: Any, tenant: str, now: float) -> list[Any]:
        """Move an unattributed block to the tenant it turned out to belong to (its
        header was read); returns keys evicted to keep that tenant within its quota."""
        if self.owner.get(key) != UNATTRIBUTED or tenant == UNATTRIBUTED:
            return []
        size = self.sizes[key]
        self.discard(key)
        adm = self.put(key, size, now, tenant=tenant)
        return adm.evicted

    def set_quotas(self, quotas: Mapping[str, int | None], default: int | None) -> list[Any]:
        """Replace the quota table; tenants now over their quota lose their own
        least valuable blocks at once. Returns the evicted keys."""
        self.quotas = dict(quotas)
        self.default_quota = default
        evicted: list[Any] = []
        for tenant in list(self._usage):
            limit = self.quota(tenant)
            while limit is not None and self._usage.get(tenant, 0) > limit:
                evicted.append(self._evict(tenant))
        return evicted

    def usage(self) -> list[TenantUsage]:
        """One row per tenant holding blocks, with an explicit quota or evictions, by
        name (blocks of no known owner yet are in ``used_bytes`` only)."""
        names = sorted((set(self._usage) | set(self.quotas) | set(self._evicted))
                       - {UNATTRIBUTED})
        return [TenantUsage(t, self._usage.get(t, 0), self._counts.get(t, 0), self.quota(t),
                            self._evicted.get(t, 0)) for t in names]

    def tenant_bytes(self, tenant: str) -> int:
        return self._usage.get(tenant, 0)

    # -- internals -----------------------------------------------------------------------
    def _largest(self) -> str:
        return max(self._usage, key=self._usage.__getitem__)

    def _victim_owner(self, tenant: str, size: int) -> str:
        """Whose block goes to make room for ``size`` bytes of ``tenant`` (module doc, 2)."""
        need = self._usage.get(tenant, 0) + size
        best, most = "", -1
        for name, held in self._usage.items():
            if name != tenant and held > most:
                best, most = name, held
        if most >= need or (most >= 0 and not self._usage.get(tenant, 0)):
            return best
        return tenant

    def _evict(self, owner: str) -> Any:
        victim = self._policies[owner].victim()
        self.discard(victim)
        self.evictions += 1
        if owner != UNATTRIBUTED and len(self._evicted) < 65_536:   # bounded: names from puts
            self._evicted[owner] = self._evicted.get(owner, 0) + 1
        return victim


__all__ = ["UNATTRIBUTED", "TenantCache", "TenantUsage"]
