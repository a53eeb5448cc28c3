"""Typed values that cross the warehouse's boundaries (client, service,
warehouse, index). Nothing here talks to Redis, disk or the network.

Tiers are named "G1".."G4" (docs/architecture.md#tiers-ttls-and-eviction) and each
has one bit in the index's tier mask; a block's *best* tier is the lowest-numbered tier holding it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from kvstore.errors import InvalidRequest

TIER_BITS: dict[str, int] = {"G1": 1, "G2": 2, "G3": 4, "G4": 8}
TIER_ORDER: tuple[str, ...] = ("G1", "G2", "G3", "G4")
# Tiers whose copy lives on one node (its kvstore or engine); G4 is shared.
LOCAL_TIERS_MASK = TIER_BITS["G1"] | TIER_BITS["G2"] | TIER_BITS["G3"]

_TENANT = re.compile(r"^[A-Za-z0-9._-]{1,64}$")
MAX_LAYOUT_CHARS = 128   # "L<layers>xH<heads>xT<tokens>xD<dim>:<dtype>" is ~30
_LAYOUT = re.compile(r"^L(\d+)xH(\d+)xT(\d+)xD(\d+):(\w+)$")
_ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8, "float8_e4m3fn": 1,
             "float8_e5m2": 1, "int8": 1, "uint8": 1}
_FINGERPRINT = re.compile(r"^([0-9a-f]{2}){1,64}$")
_REQUEST_ID_MAX = 256


def best_tier(mask: int) -> str:
    """The fastest tier set in ``mask``; "" when none is."""
    for name in TIER_ORDER:
        if mask & TIER_BITS[name]:
            return name
    return ""


def tiers_of(mask: int) -> list[str]:
    return [name for name in TIER_ORDER if mask & TIER_BITS[name]]


@dataclass(frozen=True, slots=True)
class BlockLayout:
    """A KV layout name as the engine writes it (``engine.KVLayout.name``),
    e.g. "L30xH3xT64xD64:float32": one block is [layers, 2, kv_heads, tokens, dim]."""

    layers: int
    kv_heads: int
    block_tokens: int
    head_dim: int
    dtype: str

    @classmethod
    def parse(cls, name: str) -> BlockLayout:
        if len(name) > MAX_LAYOUT_CHARS:   # client input: bound it before any parsing
            raise InvalidRequest(f"layout name of {len(name)} characters exceeds "
                                 f"{MAX_LAYOUT_CHARS} (e.g. {name[:40]!r}...)")
        m = _LAYOUT.match(name)
        if not m or m.group(5) not in _ITEMSIZE:
            raise InvalidRequest(
                f"layout {name[:80]!r} is not L<layers>xH<kv_heads>xT<tokens>xD<head_dim>:<dtype> "
                f"with dtype one of {sorted(_ITEMSIZE)}")
        layers, heads, tokens, dim = (int(g) for g in m.groups()[:4])
        if min(layers, heads, tokens, dim) < 1:
            raise InvalidRequest(f"layout {name[:80]!r} has a zero dimension")
        return cls(layers, heads, tokens, dim, m.group(5))

    @property
    def block_nbytes(self) -> int:
        return (self.layers * 2 * self.kv_heads * self.block_tokens * self.head_dim
                * _ITEMSIZE[self.dtype])


@dataclass(frozen=True, slots=True)
class RequestCtx:
    """Who asks and how long their KV should live (proto ``RequestContext``).

    ``tenant`` salts block keys upstream (kvstore.keys); the warehouse sees it
    only to validate and to label metrics. Empty fields take defaults.
    """

    request_id: str = ""
    tenant: str = ""
    traffic_class: str = ""
    model_fingerprint: str = ""

    def __post_init__(self) -> None:
        if self.tenant and not _TENANT.match(self.tenant):
            raise InvalidRequest(
                f"tenant {self.tenant[:80]!r} is not a valid tenant name "
                "(want [A-Za-z0-9._-]{1,64}, or empty for the default tenant)")
        if self.model_fingerprint and not _FINGERPRINT.match(self.model_fingerprint):
            raise InvalidRequest(
                f"model_fingerprint {self.model_fingerprint[:80]!r} is not lowercase hex")
        if len(self.request_id) > _REQUEST_ID_MAX:
            raise InvalidRequest(f"request_id longer than {_REQUEST_ID_MAX} characters")


@dataclass(frozen=True, slots=True)
class LookupResult:
    """Longest stored prefix of a key chain.

    ``matched_blocks`` leading blocks are fetchable from this warehouse;
    ``usable_tokens`` is what the hit rule (docs/architecture.md#the-hit-rule) lets the caller
    restore; ``block_tiers[i]`` is the best tier of matched block i.
    """

    matched_blocks: int
    usable_tokens: int
    block_tiers: list[str]
    lookup_s: float

    @property
    def tier_counts(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for t in self.block_tiers:
            counts[t] = counts.get(t, 0) + 1
        return counts


@dataclass(frozen=True, slots=True)
class PutResult:
    stored: int          # blocks newly written
    skipped: int         # already present (keys are write-once)
    bytes: int           # payload bytes received


@dataclass(frozen=True, slots=True)
class GetResult:
    """One entry per requested key, in order; None = missing or failed its
    checksum, so the caller recomputes that block (and everything after it)."""

    payloads: list[memoryview | None]
    bytes: int = 0
    get_s: float = 0.0
    tiers: list[str] = field(default_factory=list)   # tier each payload came from ("" = miss)

    @property
    def hit_prefix(self) -> int:
        """Leading payloads present: the blocks a caller can actually restore."""
        n = 0
        for p in self.payloads:
            if p is None:
                break
            n += 1
        return n


@dataclass(frozen=True, slots=True)
class DeleteResult:
    deleted: int


@dataclass(frozen=True, slots=True)
class TierSnapshot:
    """One tier's counters as the service reports them (proto ``TierStats``)."""

    tier: str
    capacity_bytes: int
    used_bytes: int
    blocks: int
    hits: int
    misses: int
    evictions: int
    checksum_failures: int


@dataclass(frozen=True, slots=True)
class TenantSnapshot:
    """One tenant's share of one tier (proto ``TenantStats``); quota -1 = no limit."""

    tier: str
    tenant: str
    used_bytes: int
    blocks: int
    quota_bytes: int
    evictions: int


@dataclass(frozen=True, slots=True)
class QuotaEntry:
    """One quota: ``quota_bytes`` None = no limit; ``source`` "config" or "operator"."""

    tier: str
    tenant: str
    quota_bytes: int | None
    source: str


@dataclass(frozen=True, slots=True)
class ClassSnapshot:
    traffic_class: str
    ttl_s: int
    hits: int
    misses: int
    blocks: int


@dataclass(frozen=True, slots=True)
class StoreStats:
    node: str
    tiers: list[TierSnapshot]
    classes: list[ClassSnapshot]
    whatif_json: str = ""
    shm_capable: bool = False
    hostname: str = ""
    tenants: list[TenantSnapshot] = field(default_factory=list)
    tenant_names: int = 0          # names holding a tenant id (bounded by max_tenants)
    max_tenants: int = 0
