"""G3: a local directory of block files (``file:///dir`` or a plain path).

A block lives at ``dir/ab/cd/<hex>.kvb`` (content-addressed: existence needs no
index). Writes go to a hidden temp file in the same directory, are synced,
then ``os.replace``d into place, and the directory is fsynced: a reader, a
crash or a kill -9 sees the whole old state or the whole new file, never a
torn one. Every read verifies the checksum; a corrupt or truncated file is
deleted, counted and reported as a miss.

``put_many`` group-commits a batch: every temp file is written and synced by
a pool of writer threads (the device sees many writes at once and the
journal folds concurrent syncs into few commits), then all are renamed under
the lock, then each distinct directory is fsynced once. A final name appears
only after its file's data is durable, and a block is reported stored only
after its rename is. Temp files are synced with ``fdatasync``: it persists the
data and the size/extent metadata needed to read it back; the name is made
durable by the rename and the directory fsync, and the timestamps it skips
are only an LRU hint.

On open the byte accounting is rebuilt from the files (oldest mtime first, so
LRU order survives restarts; a hit refreshes the mtime) and leftover temp
files from interrupted writes are removed. Each file's header is read and
its MAC verified there (one small read per file, on the writer pool): the
per-tenant accounting needs each block's owner, and a file that is forged,
damaged or of an older format is removed before anyone can look it up.

Private: the directory and every directory under it are 0700, every file
0600 (created so; looser ones left by an older version are tightened at
open). A directory owned by another user is refused: whoever controls it
could swap blocks in (the MAC would catch them, but not the deletions).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import secrets
import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import NamedTuple

from kvstore.blockfile import (
    UNKEYED,
    BlockCorruptError,
    BlockMac,
    BlockMeta,
    decode_block,
    encode_parts,
)
from kvstore.tiers.base import (
    EvictCallback,
    PutItem,
    PutOutcome,
    Tier,
    TierError,
    TierHit,
    key_from_filename,
    key_relpath,
    register_tier,
)
from kvstore.tiers.files import (
    DIR_MODE,
    FILE_MODE,
    HEAD_READ,
    Found,
    dir_from_url,
    fsync_dir,
    mkdir_private,
    private_root,
    read_file,
    read_header,
    tighten,
    write_all,
)

log = logging.getLogger(__name__)
TMP_SUFFIX = ".tmp"
# Writer threads per tier: enough to keep a device queue busy (measured on ext4:
# 16 parallel write+fdatasync streams commit a batch 2-3x faster than one).
DEFAULT_WRITERS = 16
_fdatasync = getattr(os, "fdatasync", os.fsync)  # macOS has no fdatasync
_FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})
FULL_WARN_INTERVAL_S = 60.0   # at most one disk-full warning per minute per tier
REGROW_CHECK_S = 5.0          # how often a shrunk tier looks for returned space
class _Staged(NamedTuple):
    """One block of a batch in its synced temp file, not yet visible.
    ``tmp`` is None when the block is larger than the tier (nothing written)."""

    index: int
    key: bytes
    traffic_class: str
    tenant: str
    nbytes: int
    final: Path
    tmp: Path | None
    new_dirs: list[Path]


@register_tier("file", "")
class DiskTier(Tier):
    level = "G3"

    def __init__(self, url: str, *, name: str, capacity_bytes: int, policy: str = "lru",
                 lz4: bool = False, on_evict: EvictCallback | None = None,
                 fsync: bool = True, writers: int = DEFAULT_WRITERS,
                 temp_grace_s: float = 0.0, mac: BlockMac = UNKEYED) -> None:
        super().__init__(name=name, capacity_bytes=capacity_bytes, policy=policy, lz4=lz4,
                         on_evict=on_evict)
        if not isinstance(writers, int) or writers < 1:
            raise TierError(f"tier {name}: writers must be an int >= 1, got {writers!r}")
        self.root = dir_from_url(url)
        self.fsync = fsync
        self.mac = mac
        self.rejected_at_open = 0      # files that failed their header MAC at open (removed)
        self.tightened_at_open = 0     # files/dirs whose mode was looser than private
        # Full disk (see put_many): the capacity asked for, the current target may be less.
        self.configured_bytes = capacity_bytes
        self.disk_full_events = 0
        self.full_warn_interval_s = FULL_WARN_INTERVAL_S
        self.regrow_check_s = REGROW_CHECK_S
        self._full_warned_at = -float("inf")
        self._regrow_at = 0.0
        self.writers = writers
        # 0: this process owns the directory (a store at start), so every temp file
        # is a leftover. Readers opening beside a live store pass e.g. 600.
        self.temp_grace_s = temp_grace_s
        self._pool: ThreadPoolExecutor | None = None
        self._pool_lock = threading.Lock()
        # Leaf directories whose own entries are known durable. A batch writing into
        # any other also fsyncs the two directories above it, so a block never sits
        # in a directory that a crash could lose, whichever thread created it.
        self._durable_dirs: set[Path] = set()
        private_root(self.root)
        self._rebuild()

    def path(self, key: bytes) -> Path:
        return self.root / key_relpath(key)

    # -- open ------------------------------------------------------------------
    def _rebuild(self) -> None:
        found: list[Found] = []
        for level1 in os.scandir(self.root):
            if not level1.is_dir(follow_symlinks=False) or len(level1.name) != 2:
                continue
            self.tightened_at_open += tighten(level1.path, level1.stat(follow_symlinks=False),
                                               DIR_MODE)
            for level2 in os.scandir(level1.path):
                if not level2.is_dir(follow_symlinks=False):
                    continue
                self.tightened_at_open += tighten(
                    level2.path, level2.stat(follow_symlinks=False), DIR_MODE)
                self._durable_dirs.add(Path(level2.path))
                for entry in os.scandir(level2.path):
                    if entry.name.endswith(TMP_SUFFIX):
                        # An interrupted write, never visible. Another process on the
                        # same directory (a reindex beside a live store) may be writing
                        # right now, so only temp files older than any write are removed.
                        if self.temp_grace_s <= 0 or (
                                time.time() - entry.stat(follow_symlinks=False).st_mtime
                                > self.temp_grace_s):
                            os.unlink(entry.path)
                        continue
                    key = key_from_filename(entry.name)
                    if key is None:
                        continue
                    if not entry.is_file(follow_symlinks=False):   # a link: never followed
                        if self.owns_files:
                            os.unlink(entry.path)
                        self.rejected_at_open += 1
                        continue
                    st = entry.stat(follow_symlinks=False)
                    self.tightened_at_open += tighten(entry.path, st, FILE_MODE)
                    found.append(Found(st.st_mtime, key, st.st_size, entry.path))
        found.sort()
        owners = self._owners(found)
        for f, tenant in zip(found, owners, strict=True):
            if tenant is None:
                continue
            adm = self._cache.put(f.key, f.size, f.mtime, tenant=tenant)
            for victim in adm.evicted:  # capacity shrank since the files were written
                self.path(victim).unlink(missing_ok=True)
            if not adm.stored:
                self.path(f.key).unlink(missing_ok=True)
        self._cache.evictions = 0
        if self.rejected_at_open:
            log.warning("G3 %s: %d block files at %s failed verification at open (an older "
                        "format, written under another deployment secret, forged or damaged)"
                        " and were %s; those blocks are recomputed when next needed",
                        self.name, self.rejected_at_open, self.root,
                        "removed" if self.owns_files else "skipped")
        if self.tightened_at_open:
            log.warning("G3 %s: tightened the mode of %d files/directories under %s to "
                        "private (0600/0700)", self.name, self.tightened_at_open, self.root)

    @property
    def owns_files(self) -> bool:
        """The serving store owns the directory and removes bad files; a tool opened
        beside it (``temp_grace_s`` > 0, e.g. a reindex, perhaps with the wrong key)
        only skips them."""
        return self.temp_grace_s <= 0

    def _owners(self, found: list[Found]) -> list[str | None]:
        """Each file's tenant from its verified header (None: gone, or bad and not
        accounted). One small read per file; the writer pool keeps many in flight
        on a cold disk."""
        bad: list[str] = []     # list.append is atomic: the pool's threads share it

        def owner(f: Found) -> str | None:
            try:
                meta = read_header(f.path, self.mac)
                if meta.key != f.key:
                    raise BlockCorruptError(f"file {f.path} holds key {meta.key_hex}")
                return meta.tenant
            except FileNotFoundError:
                return None
            except (OSError, BlockCorruptError):
                bad.append(f.path)
                if self.owns_files:
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(f.path)
                return None

        if len(found) < 64 or self.writers == 1:
            owners = [owner(f) for f in found]
        else:
            owners = list(self._writer_pool().map(owner, found, chunksize=64))
        self.rejected_at_open += len(bad)
        return owners

    # -- write -----------------------------------------------------------------
    def put(self, key: bytes, payload: bytes | bytearray | memoryview,
            meta: BlockMeta) -> PutOutcome:
        return self.put_many([(key, payload, meta)])[0]

    def put_many(self, items: Sequence[PutItem]) -> list[PutOutcome]:
        """Group commit (see the module doc). Outcomes, recency and eviction order
        are those of ``put`` called on each item in turn. A bad item or a failed
        write removes the batch's temp files and raises before anything is renamed.

        A full disk (ENOSPC/EDQUOT) is not an error: the tier shrinks its target to
        the space it finds (one rate-limited warning with the numbers), evicts its
        oldest blocks to make room and tries the batch once more; blocks that still
        do not fit are reported not stored. The target grows back, up to the
        configured capacity, when space returns."""
        batch = list(items)
        self._maybe_regrow()
        need = sum(memoryview(p).nbytes + HEAD_READ for _, p, _ in batch)
        early = self._make_room(need) if self.capacity_bytes < self.configured_bytes else []
        try:
            outs = self._put_many(batch)
        except OSError as exc:
            if exc.errno not in _FULL_ERRNOS:
                raise
            self._shrink_to_free(exc)
            early += self._make_room(need)
            try:
                outs = self._put_many(batch)
            except OSError as again:
                if again.errno not in _FULL_ERRNOS:
                    raise
                outs = [PutOutcome(False) for _ in batch]
        if early and outs:   # blocks evicted ahead of the batch: their index bits go too
            first = outs[0]
            outs[0] = PutOutcome(first.stored, [*early, *first.evicted], first.existed)
        return outs

    # -- full disk ---------------------------------------------------------------
    def free_bytes(self) -> int:
        """Bytes this process may still write on the tier's filesystem."""
        st = os.statvfs(self.root)
        return st.f_bavail * st.f_frsize

    def _set_target(self, target: int) -> None:
        with self._lock:
            self.capacity_bytes = self._cache.capacity_bytes = target

    def _shrink_to_free(self, exc: OSError) -> None:
        free = self.free_bytes()
        with self._lock:
            old = self.capacity_bytes
            target = max(0, min(self.configured_bytes, self._cache.used_bytes + free))
            self.capacity_bytes = self._cache.capacity_bytes = target
            used = self._cache.used_bytes
        self.disk_full_events += 1
        now = time.monotonic()
        if now - self._full_warned_at >= self.full_warn_interval_s:
            self._full_warned_at = now
            log.warning("G3 %s: disk full at %s (%s): %d bytes free, %d used by this tier; "
                        "target shrunk from %d to %d bytes (configured %d); the oldest blocks "
                        "make room for new ones until space returns (%d disk-full events so "
                        "far; next warning in %.0f s at the earliest)",
                        self.name, self.root, os.strerror(exc.errno or 0), free, used, old,
                        target, self.configured_bytes, self.disk_full_events,
                        self.full_warn_interval_s)

    def _maybe_regrow(self) -> None:
        if self.capacity_bytes >= self.configured_bytes:
            return
        now = time.monotonic()
        if now < self._regrow_at:
            return
        self._regrow_at = now + self.regrow_check_s
        free = self.free_bytes()
        with self._lock:
            target = min(self.configured_bytes, self._cache.used_bytes + free)
            if target <= self.capacity_bytes:
                return
            old = self.capacity_bytes
            self.capacity_bytes = self._cache.capacity_bytes = target
        log.info("G3 %s: space returned (%d bytes free): target %d -> %d bytes (configured %d)",
                 self.name, free, old, target, self.configured_bytes)

    def _make_room(self, need: int) -> list[BlockMeta]:
        """Evict the oldest blocks until ``need`` more bytes fit the target (a full
        disk must free space before the temp files of a batch can be written)."""
        victims: list[tuple[bytes, Path]] = []
        with self._lock:
            c = self._cache
            while c.used_bytes + need > c.capacity_bytes and len(c):
                victim = c.evict_one()          # the largest tenant's next victim
                victims.append((victim, self._set_aside(victim)))
        return self._finish_evictions(victims) if victims else []

    def _put_many(self, batch: list[PutItem]) -> list[PutOutcome]:
        for key, _, meta in batch:
            self._check_put(key, meta)
        outcomes: list[PutOutcome] = []
        staged: dict[int, _Staged] = {}
        doomed: dict[int, list[tuple[bytes, Path]]] = {}
        dirs: dict[Path, None] = {}  # ordered set: each directory fsynced once
        try:
            while len(outcomes) < len(batch):
                # Usually one round; another only when a key present at the start (or
                # repeated in the batch) was evicted by the batch before its turn.
                start = len(outcomes)
                todo = self._absent(batch, start, staged)
                staged.update((s.index, s) for s in self._stage([(i, *batch[i]) for i in todo]))
                with self._lock:
                    for i in range(start, len(batch)):  # batch order, as a put() loop
                        s = staged.pop(i, None)
                        if s is not None:
                            out, doomed[i] = self._commit(s, dirs)
                        elif self._cache.hit(batch[i][0], self._now()):
                            out = PutOutcome(True, existed=True)
                        else:
                            break
                        outcomes.append(out)
        finally:
            # Also after an error in a later round: what was renamed is made durable
            # and its victims are finished; temp files not yet renamed go.
            for s in staged.values():
                if s.tmp is not None:
                    s.tmp.unlink(missing_ok=True)
            if dirs and self.fsync:
                self._fsync_dirs(list(dirs))
            with self._lock:
                self._durable_dirs.update(dirs)
            for i, victims in doomed.items():
                if victims:
                    out = outcomes[i]
                    outcomes[i] = PutOutcome(out.stored, self._finish_evictions(victims),
                                             out.existed)
        return outcomes

    def _absent(self, batch: list[PutItem], start: int, staged: dict[int, _Staged]) -> list[int]:
        """Indexes from ``start`` on whose key is neither stored, nor staged, nor an
        earlier item of the batch: the blocks this round must write."""
        seen = {batch[i][0] for i in staged}
        todo: list[int] = []
        with self._lock:
            for i in range(start, len(batch)):
                key = batch[i][0]
                if key not in seen and key not in self._cache:
                    todo.append(i)
                seen.add(key)
        return todo

    def _commit(self, s: _Staged, dirs: dict[Path, None]
                ) -> tuple[PutOutcome, list[tuple[bytes, Path]]]:
        """Admit one staged block and rename it into place (caller holds the lock)."""
        if s.tmp is None:
            return PutOutcome(False), []
        if self._cache.hit(s.key, self._now()):  # another thread stored it meanwhile
            s.tmp.unlink(missing_ok=True)
            return PutOutcome(True, existed=True), []
        adm = self._cache.put(s.key, s.nbytes, self._now(), s.traffic_class, s.tenant)
        # Move victims aside under the lock (a rename is fast), so a concurrent
        # re-put of a victim key can never lose its new file to our unlink.
        victims = [(v, self._set_aside(v)) for v in adm.evicted]
        if not adm.stored:
            s.tmp.unlink(missing_ok=True)
            return PutOutcome(False), victims
        try:
            os.replace(s.tmp, s.final)
        except OSError as exc:
            log.warning("G3 %s: rename of block %s failed (%s)", self.name, s.key.hex(), exc)
            self._cache.discard(s.key)
            s.tmp.unlink(missing_ok=True)
            return PutOutcome(False), victims
        for d in (*s.new_dirs, s.final.parent):
            dirs[d] = None
        return PutOutcome(True), victims

    def _stage(self, work: list[tuple[int, bytes, bytes | bytearray | memoryview, BlockMeta]]
               ) -> list[_Staged]:
        """Encode and write every block to a synced temp file, in parallel."""
        if len(work) <= 1 or self.writers == 1:
            results: list[_Staged | BaseException] = []
            for w in work:
                try:
                    results.append(self._stage_one(*w))
                except Exception as exc:  # re-raised below, after cleanup
                    results.append(exc)
                    break
        else:
            pool = self._writer_pool()
            futures: list[Future[_Staged]] = [pool.submit(self._stage_one, *w) for w in work]
            results = []
            for f in futures:
                exc = f.exception()
                results.append(exc if exc is not None else f.result())
        staged = [r for r in results if isinstance(r, _Staged)]
        failed = [r for r in results if not isinstance(r, _Staged)]
        if failed:
            for s in staged:
                if s.tmp is not None:
                    s.tmp.unlink(missing_ok=True)
            raise failed[0]
        return staged

    def _stage_one(self, index: int, key: bytes, payload: bytes | bytearray | memoryview,
                   meta: BlockMeta) -> _Staged:
        enc = encode_parts(payload, meta, self.lz4, mac=self.mac)
        final = self.path(key)
        if enc.nbytes > self.capacity_bytes:
            return _Staged(index, key, meta.traffic_class, meta.tenant, enc.nbytes, final,
                           None, [])
        leaf = final.parent
        new_dirs: list[Path] = []
        if leaf not in self._durable_dirs:
            mkdir_private(leaf)
            new_dirs = [leaf.parent.parent, leaf.parent]
        tmp = leaf / f".{final.stem}.{secrets.token_hex(6)}{TMP_SUFFIX}"
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
        try:
            fd = os.open(tmp, flags, FILE_MODE)
        except FileNotFoundError:  # the directory was removed behind our back
            mkdir_private(leaf)
            new_dirs = [leaf.parent.parent, leaf.parent]
            fd = os.open(tmp, flags, FILE_MODE)
        try:
            write_all(fd, [memoryview(enc.header), enc.body])
            if self.fsync:
                _fdatasync(fd)
        except BaseException:
            os.close(fd)
            tmp.unlink(missing_ok=True)
            raise
        os.close(fd)
        return _Staged(index, key, meta.traffic_class, meta.tenant, enc.nbytes, final, tmp,
                       new_dirs)

    def _fsync_dirs(self, dirs: list[Path]) -> None:
        if len(dirs) == 1 or self.writers == 1:
            for d in dirs:
                fsync_dir(d)
        else:
            # Concurrent directory fsyncs share journal commits; list() re-raises errors.
            list(self._writer_pool().map(fsync_dir, dirs))

    def _writer_pool(self) -> ThreadPoolExecutor:
        with self._pool_lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.writers,
                                                thread_name_prefix=f"g3-{self.name}")
            return self._pool

    def close(self) -> None:
        with self._pool_lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)

    def _release_evicted(self, keys: list[bytes]) -> list[BlockMeta]:
        return self._finish_evictions([(k, self._set_aside(k)) for k in keys])

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
                    block = decode_block(read_file(aside), expect_key=key, mac=self.mac)
                    meta = block.meta
                    self.on_evict(meta, block.payload)
                else:
                    meta = read_header(aside, self.mac)
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
            data = read_file(path)
        except FileNotFoundError:  # removed behind our back
            with self._lock:
                self._cache.discard(key)
                self._misses += 1
            return None
        except OSError as exc:     # e.g. a link planted in its place (ELOOP): never followed
            self._drop_corrupt(key, path, exc)
            return None
        try:
            block = decode_block(data, expect_key=key, mac=self.mac)
        except BlockCorruptError as exc:
            self._drop_corrupt(key, path, exc)
            return None
        with contextlib.suppress(FileNotFoundError):
            os.utime(path)  # mtime = last use, so reopening restores LRU order
        self._count(hit=True)
        return TierHit(block.meta, block.payload)

    def _drop_corrupt(self, key: bytes, path: Path, exc: Exception) -> None:
        log.warning("G3 %s: %s; %s", self.name, exc, "deleted" if self.owns_files else "skipped")
        with self._lock:
            self._cache.discard(key)
            self._checksum_failures += 1
            self._misses += 1
            if self.owns_files:
                path.unlink(missing_ok=True)

    def delete(self, key: bytes) -> bool:
        with self._lock:
            present = self._cache.discard(key)
            self.path(key).unlink(missing_ok=True)
        return present

    def scan(self) -> Iterator[BlockMeta]:
        """Headers only (one small read per file, MAC verified); a file whose header does
        not verify is dropped, never yielded (so a reindex never indexes it)."""
        for key in self.keys():
            path = self.path(key)
            try:
                meta = read_header(path, self.mac)
                if meta.key != key:
                    raise BlockCorruptError(f"file {path.name} holds key {meta.key_hex}")
            except FileNotFoundError:
                continue
            except (OSError, BlockCorruptError) as exc:
                self._drop_corrupt(key, path, exc)
                continue
            yield meta
