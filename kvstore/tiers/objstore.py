"""G4: any fsspec filesystem (``memory://bucket``, ``s3://bucket/prefix`` with s3fs,
``gs://``, ``fsspec+file:///dir`` for a local or mounted directory, e.g. 3FS).

URL rule: ``mem://`` is G2, ``file://`` and plain paths are G3; every other
scheme goes to fsspec. Prefix ``fsspec+`` to force fsspec for a scheme that a
closer tier claims (``fsspec+file:///mnt/shared`` = a G4 on a shared mount).

Keys are write-once: a block already present (``exists``) is not rewritten, so
several nodes can share one bucket. Object stores whose single PUT is
all-or-nothing (s3, gcs, azure, memory) are written directly; any other
filesystem gets a temp name under ``.tmp/`` then a move. Reads verify the
header MAC (keyed, kvstore.integrity) and the checksum; a bad object — forged
by someone holding a bucket credential but not the MAC key, damaged, or of an
older format — is deleted, counted and reported as a miss, and ``scan`` never
yields it (so a reindex never indexes it). On a local or mounted filesystem
the tier's directories are 0700 and its objects 0600, as G3's; on object
stores keep the bucket private and give each node its own credential
(docs/security.md, "Integrity at rest and quotas").

Per-tenant accounting: objects listed at open have no known owner until one
is read (the listing gives sizes, not headers); they count toward capacity
as "unattributed" (kvstore.eviction.tenants).

Remote stores (S3 through s3fs, docs/warehouse-sizing.md):
- Credentials and endpoint come from, in order: ``storage_options``, the JSON
  object in ``KVSERVE_G4_OPTIONS`` (e.g. ``{"endpoint_url": ...}``), then the
  client's own chain (``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY`` /
  ``AWS_ENDPOINT_URL_S3`` env, ``AWS_SHARED_CREDENTIALS_FILE``, instance roles),
  which is where a Kubernetes Secret lands (k8s/components/s3-g4).
- An object larger than ``multipart_bytes`` is uploaded in parts of that size
  (S3 makes it visible only when the upload completes, so still all-or-nothing).
- Transient failures are retried with exponential backoff (``retries``); when
  they persist the store is marked down for ``down_cooldown_s``: calls then
  fail at once with ``TierUnavailable`` (counted in ``unavailable``) and the
  warehouse treats the block as a miss (recompute) without clearing the index.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import random
import secrets
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import fsspec
from fsspec.core import url_to_fs
from fsspec.implementations.local import LocalFileSystem

from kvstore.blockfile import (
    UNKEYED,
    BlockCorruptError,
    BlockMac,
    BlockMeta,
    decode_block,
    encode_block,
    header_length,
    parse_header,
)
from kvstore.tiers.base import (
    EvictCallback,
    PutOutcome,
    Tier,
    TierError,
    TierHit,
    key_from_filename,
    key_relpath,
    register_tier,
)
from kvstore.tiers.files import FILE_MODE, mkdir_private, private_root, tighten_tree

log = logging.getLogger(__name__)
ATOMIC_PUT_PROTOCOLS = frozenset({"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "memory"})
_FORCE = "fsspec+"
_HEAD_READ = 4096
OPTIONS_ENV = "KVSERVE_G4_OPTIONS"
MULTIPART_BYTES = 16 * 2**20       # S3's parts must be >= 5 MiB (the last excepted)
# Remote clients retry on their own for a long time by default; we want one fast
# attempt per try so our backoff and the down-marker decide. Listings are not
# cached: another node's new object must be seen by the next ``exists``.
_REMOTE_DEFAULTS: dict[str, dict[str, Any]] = {
    "s3": {"use_listings_cache": False,
           "config_kwargs": {"connect_timeout": 2, "read_timeout": 20,
                             "retries": {"max_attempts": 1}}},
}
T = TypeVar("T")


class TierUnavailable(OSError):
    """The object store did not answer (after retries): a miss, not a lost block."""


def _options(url_scheme: str, given: dict[str, Any] | None) -> dict[str, Any]:
    raw = os.environ.get(OPTIONS_ENV, "")
    try:
        env = json.loads(raw) if raw else {}
    except json.JSONDecodeError as exc:
        raise TierError(f"{OPTIONS_ENV} is not a JSON object: {exc}") from None
    if not isinstance(env, dict):
        raise TierError(f"{OPTIONS_ENV} must be a JSON object, got {type(env).__name__}")
    opts = {**_REMOTE_DEFAULTS.get(url_scheme, {}), **env, **(given or {})}
    endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    if url_scheme in ("s3", "s3a") and endpoint and "endpoint_url" not in opts:
        opts["endpoint_url"] = endpoint
    return opts


def _protocols(fs: fsspec.AbstractFileSystem) -> set[str]:
    proto = fs.protocol
    return {proto} if isinstance(proto, str) else set(proto)


@register_tier(fallback=True)
class ObjectTier(Tier):
    level = "G4"

    def __init__(self, url: str, *, name: str, capacity_bytes: int, policy: str = "lru",
                 lz4: bool = False, on_evict: EvictCallback | None = None,
                 storage_options: dict[str, Any] | None = None,
                 multipart_bytes: int = MULTIPART_BYTES, retries: int = 3,
                 backoff_s: float = 0.05, down_cooldown_s: float = 2.0,
                 mac: BlockMac = UNKEYED) -> None:
        super().__init__(name=name, capacity_bytes=capacity_bytes, policy=policy, lz4=lz4,
                         on_evict=on_evict)
        if multipart_bytes < 5 * 2**20 or retries < 1 or backoff_s < 0 or down_cooldown_s < 0:
            raise TierError("multipart_bytes >= 5 MiB, retries >= 1, backoff_s and "
                            "down_cooldown_s >= 0")
        self.mac = mac
        self.multipart_bytes = multipart_bytes
        self.retries = retries
        self.backoff_s = backoff_s
        self.down_cooldown_s = down_cooldown_s
        self.unavailable = 0            # calls answered "store down" (after retries)
        self.retried = 0                # attempts that failed and were retried
        self.multipart_puts = 0
        self._down_until = 0.0
        self._health = threading.Lock()
        target = url[len(_FORCE):] if url.lower().startswith(_FORCE) else url
        scheme = target.partition("://")[0].lower()
        if scheme not in fsspec.available_protocols():
            raise TierError(f"tier URL {url!r}: no fsspec filesystem for {scheme!r} "
                            "(install its package, e.g. s3fs for s3://)")
        try:
            self.fs, root = url_to_fs(target, **_options(scheme, storage_options))
        except ImportError as exc:
            raise TierError(f"tier URL {url!r}: {exc}") from None
        self.url = url
        self.root = root.rstrip("/")
        self.atomic_put = bool(_protocols(self.fs) & ATOMIC_PUT_PROTOCOLS)
        # A local or mounted directory: private modes, as G3 (object stores: bucket policy).
        self.local = isinstance(self.fs, LocalFileSystem)
        if hasattr(self.fs, "retries"):
            self.fs.retries = 1  # s3fs's own retry loop: ours (``_call``) replaces it
        if self.local:
            private_root(Path(self.root), "G4")
        else:
            self._call(self.fs.makedirs, self.root, exist_ok=True)
        self._call(self._rebuild)

    def path(self, key: bytes) -> str:
        return f"{self.root}/{key_relpath(key)}"

    # -- remote calls: retries, backoff, down-marker --------------------------------------
    def _call(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """``fn`` with retries; FileNotFoundError (a miss) and corrupt data are
        answers, not failures, and pass straight through."""
        if time.monotonic() < self._down_until:
            with self._health:
                self.unavailable += 1
            raise TierUnavailable(f"G4 {self.name}: store marked down")
        delay = self.backoff_s
        for attempt in range(self.retries):
            try:
                return fn(*args, **kwargs)
            except (FileNotFoundError, BlockCorruptError, TierError, PermissionError):
                raise
            except Exception as exc:  # s3fs/botocore/aiohttp errors have no common base
                if attempt + 1 == self.retries:
                    with self._health:
                        self.unavailable += 1
                        self._down_until = time.monotonic() + self.down_cooldown_s
                    log.warning("G4 %s: %s failed %d times, marked down for %.1fs: %s",
                                self.name, getattr(fn, "__name__", "call"), self.retries,
                                self.down_cooldown_s, exc)
                    raise TierUnavailable(f"G4 {self.name}: {exc}") from exc
                with self._health:
                    self.retried += 1
                time.sleep(delay * (1.0 + random.random()))
                delay *= 2
        raise AssertionError("unreachable")

    def _write(self, path: str, data: bytes | bytearray | memoryview) -> None:
        if len(data) <= self.multipart_bytes:
            self.fs.pipe_file(path, data)
            return
        # s3fs uploads a part each time its buffer reaches block_size and completes
        # the upload on close; an exception aborts it (nothing becomes visible).
        with self.fs.open(path, "wb", block_size=self.multipart_bytes) as f:
            view = memoryview(data)
            for i in range(0, len(view), self.multipart_bytes):
                f.write(view[i:i + self.multipart_bytes])
        with self._health:
            self.multipart_puts += 1

    def _rebuild(self) -> None:
        """Account for objects already there (oldest first when the store reports times);
        drop temp objects of interrupted writes."""
        tmp_root = f"{self.root}/.tmp"
        if self.fs.exists(tmp_root):
            self.fs.rm(tmp_root, recursive=True)
        if self.local:
            tighten_tree(Path(self.root))
        found: list[tuple[float, bytes, int]] = []
        for path, info in self.fs.find(self.root, detail=True).items():
            key = key_from_filename(path.rsplit("/", 1)[-1])
            if key is not None:
                found.append((_mtime(info), key, int(info.get("size") or 0)))
        found.sort()
        for mtime, key, size in found:
            self._cache.put(key, size, mtime)  # over capacity: forget, never delete shared data
        self._cache.evictions = 0

    def put(self, key: bytes, payload: bytes | bytearray | memoryview,
            meta: BlockMeta) -> PutOutcome:
        self._check_put(key, meta)
        path = self.path(key)
        with self._lock:
            if key in self._cache:
                self._cache.hit(key, self._now())
                return PutOutcome(True, existed=True)
        data = encode_block(payload, meta, self.lz4, mac=self.mac)
        if len(data) > self.capacity_bytes:
            return PutOutcome(False)
        if self._call(self.fs.exists, path):  # written by another node: write-once
            self._adopt(key, path, meta)
            return PutOutcome(True, existed=True)
        if self.atomic_put:
            self._call(self._write, path, data)
        else:
            tmp = f"{self.root}/.tmp/{key.hex()}.{secrets.token_hex(6)}"
            self._makedirs(f"{self.root}/.tmp")
            self._makedirs(path.rsplit("/", 1)[0])
            self._call(self._write, tmp, data)
            if self.local:
                os.chmod(tmp, FILE_MODE)   # before it gets its name; the root is 0700 anyway
            self.fs.mv(tmp, path)
        with self._lock:
            adm = self._cache.put(key, len(data), self._now(), meta.traffic_class, meta.tenant)
            victims = list(adm.evicted)
            if not adm.stored:
                victims.append(key)
        return PutOutcome(adm.stored, self._remove(victims, skip=key))

    def _makedirs(self, directory: str) -> None:
        """``directory`` and its parent (private ones on a local filesystem)."""
        if self.local:
            mkdir_private(Path(directory))
        else:
            self.fs.makedirs(directory, exist_ok=True)

    def _adopt(self, key: bytes, path: str, meta: BlockMeta) -> None:
        try:
            size = int(self.fs.size(path) or 0)
        except FileNotFoundError:
            return
        with self._lock:
            adm = self._cache.put(key, size, self._now(), meta.traffic_class, meta.tenant)
        self._remove(list(adm.evicted))

    def _release_evicted(self, keys: list[bytes]) -> list[BlockMeta]:
        return self._remove(keys)

    def _remove(self, keys: list[bytes], skip: bytes | None = None) -> list[BlockMeta]:
        metas: list[BlockMeta] = []
        for key in keys:
            path = self.path(key)
            meta = BlockMeta(key, "", "", 0, "", 0.0)
            try:
                if self.on_evict is not None and key != skip:
                    block = decode_block(self.fs.cat_file(path), expect_key=key, mac=self.mac)
                    meta = block.meta
                    self.on_evict(meta, block.payload)
                elif key != skip:
                    meta = self._header(path)
                self.fs.rm_file(path)
            except (OSError, BlockCorruptError) as exc:
                log.info("G4 %s: evicting %s: %s", self.name, key.hex(), exc)
            if key != skip:
                metas.append(meta)
        return metas

    def _header(self, path: str) -> BlockMeta:
        head = self.fs.cat_file(path, start=0, end=_HEAD_READ)
        need = header_length(head)
        if need > len(head):
            head = self.fs.cat_file(path, start=0, end=need)
        return parse_header(head, mac=self.mac).meta

    def get(self, key: bytes) -> TierHit | None:
        path = self.path(key)
        try:
            data = self._call(self.fs.cat_file, path)
        except FileNotFoundError:
            with self._lock:
                self._cache.discard(key)
                self._misses += 1
            return None
        try:
            block = decode_block(data, expect_key=key, mac=self.mac)
        except BlockCorruptError as exc:
            log.warning("G4 %s: %s; deleted", self.name, exc)
            with self._lock:
                self._cache.discard(key)
                self._checksum_failures += 1
                self._misses += 1
            with contextlib.suppress(FileNotFoundError):
                self.fs.rm_file(path)
            return None
        with self._lock:
            self._hits += 1
            now = self._now()
            if self._cache.hit(key, now):
                evicted = self._cache.attribute(key, block.meta.tenant, now)
            else:
                evicted = self._cache.put(key, len(data), now, block.meta.traffic_class,
                                          block.meta.tenant).evicted
        if evicted:
            self._remove(evicted)
        return TierHit(block.meta, block.payload)

    def contains(self, key: bytes) -> bool:
        """Content-addressed: a block another node wrote counts too."""
        if super().contains(key):
            return True
        try:
            return bool(self._call(self.fs.exists, self.path(key)))
        except TierUnavailable:
            return False

    def delete(self, key: bytes) -> bool:
        with self._lock:
            self._cache.discard(key)
        try:
            self.fs.rm_file(self.path(key))
        except FileNotFoundError:
            return False
        return True

    def scan(self) -> Iterator[BlockMeta]:
        """Headers of the objects this tier accounts for, MAC verified; one that does
        not verify is never yielded (a reindex never indexes it)."""
        for key in self.keys():
            try:
                yield self._header(self.path(key))
            except FileNotFoundError:
                continue
            except BlockCorruptError as exc:
                log.warning("G4 %s: %s", self.name, exc)


def _mtime(info: dict[str, Any]) -> float:
    for field in ("mtime", "LastModified", "created", "updated"):
        value = info.get(field)
        if value is None:
            continue
        if hasattr(value, "timestamp"):
            return float(value.timestamp())
        try:
            return float(value)
        except (TypeError, ValueError):
            continue
    return 0.0
