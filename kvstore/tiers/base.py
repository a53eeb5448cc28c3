"""The tier interface, its typed results, and the registry that picks a tier by URL.

A tier stores verified blocks under their 16-byte keys with a byte capacity;
eviction order is an ``kvstore.eviction`` policy, one instance per tenant,
driven through ``TenantCache`` (per-tenant quotas and max-min fair eviction,
kvstore/eviction/tenants.py; with one tenant the same accounting the
simulator replays). Invariants every tier keeps:

- ``get`` never returns bytes whose xxh3-128 differs from the checksum taken at
  ``put``; a bad block is deleted, counted in ``checksum_failures`` and reported
  as a miss (``None``).
- G3 files and G4 objects carry a header MAC keyed by the deployment's block
  MAC key (``mac``, kvstore.integrity); a block whose MAC does not verify is
  treated exactly like a corrupt one, and is never scanned into the index.
- A tenant over its quota in a tier evicts only its own blocks; see
  ``TenantCache`` for whose block a full tier gives up.
- Keys are content addresses (a key names its tokens, tenant and model), so a
  second ``put`` of a present key stores nothing and reports ``existed``.
- All state is guarded by one lock per tier: the gRPC service calls tiers from
  a thread pool. Slow I/O runs outside the lock wherever a reader can never
  observe a half-written block.
"""

from __future__ import annotations

import importlib
import pkgutil
import re
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, NamedTuple, Self

from kvstore.blockfile import KEY_BYTES, BlockMeta
from kvstore.eviction.tenants import TenantCache, TenantUsage

_NAME = re.compile(r"^[A-Za-z0-9._-]{1,64}\Z")
BLOCK_SUFFIX = ".kvb"

# Called with each evicted block's meta and payload (a private copy), after the
# tier's lock is released, in the thread that caused the eviction (G2 -> G3 demotion).
EvictCallback = Callable[[BlockMeta, memoryview], None]
# One block handed to ``Tier.put_many``: (key, payload, meta), as ``put`` takes them.
PutItem = tuple[bytes, bytes | bytearray | memoryview, BlockMeta]


class TierError(ValueError):
    """Bad tier configuration or input (unknown URL scheme, bad name, key/meta mismatch)."""


@dataclass(frozen=True, slots=True)
class PutOutcome:
    """``stored``: the block is resident after the call; ``existed``: it already was
    (nothing written); ``evicted``: blocks removed to make room."""

    stored: bool
    evicted: list[BlockMeta] = field(default_factory=list)
    existed: bool = False


@dataclass(frozen=True, slots=True)
class TierStats:
    name: str
    capacity_bytes: int
    used_bytes: int
    blocks: int
    hits: int
    misses: int
    evictions: int
    checksum_failures: int
    level: str = ""


class TierHit(NamedTuple):
    """A verified block: its metadata and its uncompressed payload."""

    meta: BlockMeta
    payload: memoryview


def check_name(name: str) -> str:
    if not isinstance(name, str) or not _NAME.match(name):
        raise TierError(f"tier name {name!r} must match [A-Za-z0-9._-]{{1,64}}")
    return name


def check_key(key: bytes) -> bytes:
    if not isinstance(key, bytes) or len(key) != KEY_BYTES:
        raise TierError(f"block key must be {KEY_BYTES} bytes, got {key!r:.60}")
    return key


def key_relpath(key: bytes) -> str:
    """Content-addressed location of a block: ``ab/cd/<32 hex>.kvb`` (existence is
    checkable from the key alone, and 65,536 directories keep listings short)."""
    h = check_key(key).hex()
    return f"{h[:2]}/{h[2:4]}/{h}{BLOCK_SUFFIX}"


def key_from_filename(filename: str) -> bytes | None:
    """The key a ``<hex>.kvb`` file name encodes, or None for any other name."""
    if not filename.endswith(BLOCK_SUFFIX) or len(filename) != 2 * KEY_BYTES + len(BLOCK_SUFFIX):
        return None
    try:
        return bytes.fromhex(filename[:2 * KEY_BYTES])
    except ValueError:
        return None


class Tier(ABC):
    """One storage level. Subclasses implement storage; this class holds the
    byte accounting, counters and lock."""

    level: ClassVar[str] = ""

    def __init__(self, *, name: str, capacity_bytes: int, policy: str = "lru",
                 lz4: bool = False, on_evict: EvictCallback | None = None) -> None:
        self.name = check_name(name)
        if capacity_bytes < 0:
            raise TierError(f"tier {name}: capacity_bytes must be >= 0, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self.lz4 = lz4
        self.on_evict = on_evict
        self._lock = threading.RLock()
        self._cache = TenantCache(capacity_bytes, policy)
        self._hits = 0
        self._misses = 0
        self._checksum_failures = 0

    # -- the interface -------------------------------------------------------
    @abstractmethod
    def put(self, key: bytes, payload: bytes | bytearray | memoryview,
            meta: BlockMeta) -> PutOutcome:
        """Store a block (checksum computed here; a supplied one must match)."""

    def put_many(self, items: Sequence[PutItem]) -> list[PutOutcome]:
        """Store several blocks: one outcome per item, in order, exactly as calling
        ``put`` on each in turn would give. Tiers that can commit a batch more
        cheaply than block by block (G3: one group of fsyncs) override this."""
        return [self.put(key, payload, meta) for key, payload, meta in items]

    @abstractmethod
    def get(self, key: bytes) -> TierHit | None:
        """The verified block, or None (missing or corrupt: corrupt is deleted and counted)."""

    @abstractmethod
    def delete(self, key: bytes) -> bool:
        """Remove a block; False when it was not there."""

    @abstractmethod
    def scan(self) -> Iterator[BlockMeta]:
        """Metadata of every resident block (for reindexing), without payload reads
        where the storage allows."""

    def contains(self, key: bytes) -> bool:
        """Presence without touching recency or hit counters."""
        with self._lock:
            return check_key(key) in self._cache

    def keys(self) -> list[bytes]:
        with self._lock:
            return list(self._cache.sizes)

    def stats(self) -> TierStats:
        with self._lock:
            return TierStats(self.name, self.capacity_bytes, self._cache.used_bytes,
                             len(self._cache), self._hits, self._misses,
                             self._cache.evictions, self._checksum_failures, self.level)

    def set_quotas(self, quotas: Mapping[str, int | None],
                   default: int | None) -> list[BlockMeta]:
        """Per-tenant byte quotas in this tier (``default`` for unlisted tenants, None
        = no limit). A tenant now over its quota loses its own blocks at once; their
        metas are returned so the caller can clear their index bits."""
        with self._lock:   # rare (an operator's change): the frees run under the lock too,
            keys = self._cache.set_quotas(quotas, default)   # so no put can race them
            return self._release_evicted(keys) if keys else []

    def tenant_usage(self) -> list[TenantUsage]:
        with self._lock:
            return self._cache.usage()

    def _release_evicted(self, keys: list[bytes]) -> list[BlockMeta]:
        """Free the storage of blocks the accounting already evicted (lock held)."""
        raise NotImplementedError(f"tier {self.name} cannot take quotas")

    def close(self) -> None:  # noqa: B027 - tiers without resources need nothing
        """Release resources (shared memory, file handles)."""

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- helpers for subclasses ----------------------------------------------
    @staticmethod
    def _now() -> float:
        return time.time()

    def _check_put(self, key: bytes, meta: BlockMeta) -> None:
        check_key(key)
        if meta.key != key:
            raise TierError(f"tier {self.name}: meta.key {meta.key.hex()} != key {key.hex()}")

    def _count(self, hit: bool) -> None:
        with self._lock:
            if hit:
                self._hits += 1
            else:
                self._misses += 1

    def _notify_evicted(self, evicted: list[tuple[BlockMeta, memoryview | None]]) -> None:
        if self.on_evict is None:
            return
        for meta, payload in evicted:
            if payload is not None:
                self.on_evict(meta, payload)


# -- registry by URL scheme ----------------------------------------------------

TierFactory = Callable[..., Tier]
_REGISTRY: dict[str, TierFactory] = {}
_FALLBACK: list[TierFactory] = []
_LOADED = False


def register_tier(*schemes: str, fallback: bool = False) -> Callable[[type[Tier]], type[Tier]]:
    """Register a tier class for URL schemes ("" = a plain path). ``fallback``:
    it also takes any scheme nobody registered (the fsspec tier)."""

    def deco(cls: type[Tier]) -> type[Tier]:
        for scheme in schemes:
            if scheme in _REGISTRY:
                raise ValueError(f"tier scheme {scheme!r} registered twice")
            _REGISTRY[scheme] = cls
        if fallback:
            if _FALLBACK:
                raise ValueError("two fallback tiers registered")
            _FALLBACK.append(cls)
        return cls

    return deco


def _load_all() -> None:
    global _LOADED
    if _LOADED:
        return
    # This file's own folder: importing the package here would make it and this
    # module import each other (tests/layers forbids the circle).
    for info in pkgutil.iter_modules([str(Path(__file__).parent)]):
        if info.name not in ("base", "arena", "shm"):
            importlib.import_module(f"kvstore.tiers.{info.name}")
    _LOADED = True


def url_scheme(url: str) -> str:
    """"mem://x" -> "mem", "/data/kv" -> "", "fsspec+file:///x" -> "fsspec+file"."""
    scheme, sep, _ = url.partition("://")
    return scheme.lower() if sep else ""


def tier_schemes() -> list[str]:
    _load_all()
    return sorted(_REGISTRY)


def open_tier(url: str, *, name: str, capacity_bytes: int, policy: str = "lru",
              lz4: bool = False, on_evict: EvictCallback | None = None, **options: Any) -> Tier:
    """Open the tier a URL names: ``mem://`` (G2), ``file:///dir`` or a plain path
    (G3), any other fsspec URL (G4; ``fsspec+file:///dir`` puts G4 on a local dir)."""
    if not isinstance(url, str) or not url:
        raise TierError("tier url must be a non-empty string")
    _load_all()
    scheme = url_scheme(url)
    factory = _REGISTRY.get(scheme) or (_FALLBACK[0] if _FALLBACK else None)
    if factory is None:
        raise TierError(f"no tier for URL {url!r}; known schemes: {tier_schemes()}")
    return factory(url, name=name, capacity_bytes=capacity_bytes, policy=policy, lz4=lz4,
                   on_evict=on_evict, **options)
