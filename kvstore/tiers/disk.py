"""G3: a local directory of block files (``file:///dir`` or a plain path).

A block lives at ``dir/ab/cd/<hex>.kvb`` (content-addressed: existence needs no
index). Writes go to a hidden temp file in the same directory, are fsynced,
then ``os.replace``d into place, and the directory is fsynced: a reader, a
crash or a kill -9 sees the whole old state or the whole new file, never a
torn one. Every read verifies the checksum; a corrupt or truncated file is
deleted, counted and reported as a miss.

On open the byte accounting is rebuilt from the files (oldest mtime first, so
LRU order survives restarts; a hit refreshes the mtime) and leftover temp
files from interrupted writes are removed.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import unquote, urlparse

from kvstore.blockfile import (
    BlockCorruptError,
    BlockMeta,
    decode_block,
    encode_parts,
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

log = logging.getLogger(__name__)
TMP_SUFFIX = ".tmp"
_HEAD_READ = 4096   # one read gets the whole header of any normal block


def _dir_from_url(url: str) -> Path:
    if "://" not in url:
        return Path(url).expanduser()
    parsed = urlparse(url)
    if parsed.netloc not in ("", "localhost"):
        raise TierError(f"file URL {url!r} names host {parsed.netloc!r}; use file:///abs/path")
    return Path(unquote(parsed.path))


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _read_file(path: Path) -> bytearray:
    with open(path, "rb", buffering=0) as f:
        size = os.fstat(f.fileno()).st_size
        data = bytearray(size)
        view = memoryview(data)
        got = 0
        while got < size:
            n = f.readinto(view[got:])
            if not n:
                break
            got += n
    if got != size:
        del data[got:]
    return data


def _read_header(path: Path) -> BlockMeta:
    with open(path, "rb", buffering=0) as f:
        head = f.read(_HEAD_READ)
        need = header_length(head)
        if need > len(head):
            head += f.read(need - len(head))
    return parse_header(head).meta


@register_tier("file", "")
class DiskTier(Tier):
    level = "G3"

    def __init__(self, url: str, *, name: str, capacity_bytes: int, policy: str = "lru",
                 lz4: bool = False, on_evict: EvictCallback | None = None,
                 fsync: bool = True) -> None:
        super().__init__(name=name, capacity_bytes=capacity_bytes, policy=policy, lz4=lz4,
                         on_evict=on_evict)
        self.root = _dir_from_url(url)
        self.fsync = fsync
        self.root.mkdir(parents=True, exist_ok=True)
        self._rebuild()

    def path(self, key: bytes) -> Path:
        return self.root / key_relpath(key)

    # -- open ------------------------------------------------------------------
    def _rebuild(self) -> None:
        found: list[tuple[float, bytes, int]] = []
        for level1 in os.scandir(self.root):
            if not level1.is_dir(follow_symlinks=False) or len(level1.name) != 2:
                continue
            for level2 in os.scandir(level1.path):
                if not level2.is_dir(follow_symlinks=False):
                    continue
                for entry in os.scandir(level2.path):
                    if entry.name.endswith(TMP_SUFFIX):
                        os.unlink(entry.path)  # an interrupted write: never visible
                        continue
                    key = key_from_filename(entry.name)
                    if key is None:
                        continue
                    st = entry.stat(follow_symlinks=False)
                    found.append((st.st_mtime, key, st.st_size))
        found.sort()
        for mtime, key, size in found:
            adm = self._cache.put(key, size, mtime)
            for victim in adm.evicted:  # capacity shrank since the files were written
                self.path(victim).unlink(missing_ok=True)
            if not adm.stored:
                self.path(key).unlink(missing_ok=True)
        self._cache.evictions = 0

    # -- write -----------------------------------------------------------------
    def _write_temp(self, final: Path, header: bytes, body: memoryview) -> Path:
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = final.parent / f".{final.stem}.{secrets.token_hex(6)}{TMP_SUFFIX}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            parts: list[memoryview] = [memoryview(header), body]
            while parts:
                n = os.writev(fd, parts)
                while parts and n >= parts[0].nbytes:
                    n -= parts[0].nbytes
                    parts.pop(0)
                if parts and n:
                    parts[0] = parts[0][n:]
            if self.fsync:
                os.fsync(fd)
        except BaseException:
            os.close(fd)
            tmp.unlink(missing_ok=True)
            raise
        os.close(fd)
        return tmp

    def put(self, key: bytes, payload: bytes | bytearray | memoryview,
            meta: BlockMeta) -> PutOutcome:
        self._check_put(key, meta)
        with self._lock:
            if key in self._cache:
                self._cache.hit(key, self._now())
                return PutOutcome(True, existed=True)
        enc = encode_parts(payload, meta, self.lz4)
        if enc.nbytes > self.capacity_bytes:
            return PutOutcome(False)
        final = self.path(key)
        tmp = self._write_temp(final, enc.header, enc.body)  # slow part, outside the lock
        doomed: list[tuple[bytes, Path]] = []
        with self._lock:
            if key in self._cache:  # another thread stored it meanwhile
                tmp.unlink(missing_ok=True)
                return PutOutcome(True, existed=True)
            adm = self._cache.put(key, enc.nbytes, self._now(), meta.traffic_class)
            # Move victims aside under the lock (a rename is fast), so a concurrent
            # re-put of a victim key can never lose its new file to our unlink.
            for victim in adm.evicted:
                doomed.append((victim, self._set_aside(victim)))
            if adm.stored:
                os.replace(tmp, final)
            else:
                tmp.unlink(missing_ok=True)
        if adm.stored and self.fsync:
            _fsync_dir(final.parent)
        return PutOutcome(adm.stored, self._finish_evictions(doomed))

    def _set_aside(self, key: bytes) -> Path:
        path = self.path(key)
        aside = path.parent / f".{path.stem}.evict-{secrets.token_hex(4)}{TMP_SUFFIX}"
        with contextlib.suppress(FileNotFoundError):
            os.replace(path, aside)
        return aside

    def _finish_evictions(self, doomed: list[tuple[bytes, Path]]) -> list[BlockMeta]:
        metas: list[BlockMeta] = []
        for key, aside in doomed:
            meta = BlockMeta(key, "", "", 0, "", 0.0)
            try:
                if self.on_evict is not None:
                    block = decode_block(_read_file(aside), expect_key=key)
                    meta = block.meta
                    self.on_evict(meta, block.payload)
                else:
                    meta = _read_header(aside)
            except (OSError, BlockCorruptError) as exc:
                log.info("G3 %s: evicted block %s unreadable (%s)", self.name, key.hex(), exc)
            finally:
                aside.unlink(missing_ok=True)
            metas.append(meta)
        return metas

    # -- read ------------------------------------------------------------------
    def get(self, key: bytes) -> TierHit | None:
        with self._lock:
            if not self._cache.hit(key, self._now()):
                self._misses += 1
                return None
        path = self.path(key)
        try:
            data = _read_file(path)
        except FileNotFoundError:  # removed behind our back
            with self._lock:
                self._cache.discard(key)
                self._misses += 1
            return None
        try:
            block = decode_block(data, expect_key=key)
        except BlockCorruptError as exc:
            self._drop_corrupt(key, path, exc)
            return None
        with contextlib.suppress(FileNotFoundError):
            os.utime(path)  # mtime = last use, so reopening restores LRU order
        self._count(hit=True)
        return TierHit(block.meta, block.payload)

    def _drop_corrupt(self, key: bytes, path: Path, exc: Exception) -> None:
        log.warning("G3 %s: %s; deleted", self.name, exc)
        with self._lock:
            self._cache.discard(key)
            self._checksum_failures += 1
            self._misses += 1
            path.unlink(missing_ok=True)

    def delete(self, key: bytes) -> bool:
        with self._lock:
            present = self._cache.discard(key)
            self.path(key).unlink(missing_ok=True)
        return present

    def scan(self) -> Iterator[BlockMeta]:
        """Headers only (one small read per file); a file with a bad header is dropped."""
        for key in self.keys():
            path = self.path(key)
            try:
                meta = _read_header(path)
                if meta.key != key:
                    raise BlockCorruptError(f"file {path.name} holds key {meta.key_hex}")
            except FileNotFoundError:
                continue
            except BlockCorruptError as exc:
                self._drop_corrupt(key, path, exc)
                continue
            yield meta
