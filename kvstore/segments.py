"""Shared-memory segments on both sides of the same-host path: attached
segments kept mapped between calls, verified copies out of G2 slots, and the
Put staging segments the store hands out.

Mapping a segment is cheap, but touching a fresh mapping costs a page fault
per 4 KiB page (~1-2 us on the VMs measured here, i.e. a 128 MiB transfer
pays tens of milliseconds), so each side attaches a peer's segment once and
reuses the mapping: the store for its own G2 arena, a client for the store's
G2 arena and its staging segment.

Trust (docs/architecture.md#trust-model): any process of the store's user can write the G2 arena,
and a slot can be reused while a reader copies it, so no copy out of shared
memory is used before its xxh3-128 matches the checksum taken at put. The
hash runs over the *private copy* (never the shared source, which could change
after it was hashed), chunk by chunk right after each chunk is copied, while
the chunk is still in cache: one pass over memory, not two.
"""

from __future__ import annotations

import contextlib
import mmap
import secrets
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from multiprocessing import shared_memory

from kvstore.errors import ResourceExhausted, ShmUnavailable
from kvstore.tiers.shm import (  # noqa: F401 - copy_verified/digest_matches re-exported
    attach_segment,
    copy_verified,
    digest_matches,
    disown_segment,
    own_segment,
)

_MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)   # Linux >= 5.14
STAGING_PREFIX = "kvs-stage-"


class SegmentCache:
    """LRU of attached segments; thread-safe. Old entries are closed when the
    cache is full."""

    def __init__(self, max_segments: int = 8, *, populate: bool = False) -> None:
        self._segs: OrderedDict[str, shared_memory.SharedMemory] = OrderedDict()
        self._max = max_segments
        self._populate = populate
        self._lock = threading.Lock()

    def get(self, name: str) -> shared_memory.SharedMemory:
        """Raises FileNotFoundError when no such segment exists on this host."""
        with self._lock:
            seg = self._segs.get(name)
            if seg is not None:
                self._segs.move_to_end(name)
                return seg
            seg = attach_segment(name)
            if self._populate:
                populate_read(seg)
            self._segs[name] = seg
            while len(self._segs) > self._max:
                _, old = self._segs.popitem(last=False)
                with contextlib.suppress(BufferError):
                    old.close()
            return seg

    def close(self) -> None:
        with self._lock:
            for seg in self._segs.values():
                with contextlib.suppress(BufferError):
                    seg.close()
            self._segs.clear()


def populate_read(seg: shared_memory.SharedMemory) -> bool:
    """Map every page of an attached segment into this process now (one
    madvise) instead of faulting 64 KiB at a time on first copy: measured
    here, a 128 MiB get out of fresh slots spent ~8 ms of its ~32 ms in those
    faults. Only for segments whose pages already exist (the store prefaults
    its G2 arena), else this would allocate them. False where unsupported."""
    mm = getattr(seg, "_mmap", None)    # CPython keeps the mmap object here
    if mm is None or not hasattr(mm, "madvise"):
        return False
    try:
        mm.madvise(_MADV_POPULATE_READ)
    except OSError:
        return False
    return True


@dataclass(slots=True)
class _Staged:
    seg: shared_memory.SharedMemory
    owner: str              # the connection it is bound to (capability)
    caller: str             # the identity whose share it counts against
    used_at: float


PER_OWNER = 8       # staging segments one connection may hold (StagingSegments)


class StagingSegments:
    """Put staging segments this store created and handed out (docs/architecture.md#trust-model).

    A same-host client asks for one (``open``) and gets an unguessable name bound
    to its connection (the gRPC peer); a shared-memory Put is served only from a
    segment found here under the same owner (``resolve``), never from a name the
    request merely states, so a Put can never make the store read another
    process's memory.

    Limits: ``max_bytes`` in all; each calling identity (``caller``: one
    certificate identity, however many connections it opens) at most
    ``share_bytes``, and each connection ``per_owner`` segments. Making room for
    a caller only ever drops *its own* least recently used segments, or anyone's
    idle for ``idle_s``: no caller can churn another's segments out of the pool.
    A request that does not fit is refused with ResourceExhausted (the client
    streams that Put instead). A client whose segment went asks again.
    Thread-safe."""

    def __init__(self, *, max_bytes: int, idle_s: float = 600.0, min_bytes: int = 64 * 2**20,
                 per_owner: int = PER_OWNER, share_bytes: int | None = None) -> None:
        self.max_bytes = max_bytes
        self.share_bytes = max_bytes if share_bytes is None else min(share_bytes, max_bytes)
        self.per_owner = per_owner
        self.idle_s = idle_s
        self.min_bytes = min_bytes
        self._by_name: OrderedDict[str, _Staged] = OrderedDict()
        self._lock = threading.Lock()

    def open(self, owner: str, nbytes: int, caller: str = "") -> shared_memory.SharedMemory:
        """A new staging segment of at least ``nbytes`` for connection ``owner``,
        counted against ``caller``'s share (default: the connection). Never one handed
        out before: two clients behind one connection (one process) must not write
        the same memory."""
        caller = caller or owner
        if nbytes > self.share_bytes:   # the client streams this put instead
            raise ResourceExhausted(f"a staging segment of {nbytes} bytes exceeds a caller's "
                                    f"share of the staging pool ({self.share_bytes} bytes); "
                                    "stream this Put")
        now = time.monotonic()
        size = min(self.share_bytes, max(nbytes, self.min_bytes))
        with self._lock:
            for name, st in list(self._by_name.items()):
                if now - st.used_at > self.idle_s:
                    self._drop(name)
            mine = [n for n, st in self._by_name.items() if st.owner == owner]
            for name in mine[:max(0, len(mine) + 1 - self.per_owner)]:
                self._drop(name)                 # the owner's least recently used first
            # Room comes from the caller's own segments, least recently used first.
            theirs = [n for n, st in self._by_name.items() if st.caller == caller]
            while theirs and (self._held(caller) + size > self.share_bytes
                              or self._total() + size > self.max_bytes):
                self._drop(theirs.pop(0))
            if self._total() + size > self.max_bytes:
                raise ResourceExhausted(
                    f"the staging pool is full ({self._total()} of {self.max_bytes} bytes, "
                    "held by other callers); stream this Put", retry_after_s=1.0)
            seg = shared_memory.SharedMemory(name=STAGING_PREFIX + secrets.token_hex(16),
                                             create=True, size=size)
            own_segment(seg.name)
            self._by_name[seg.name] = _Staged(seg, owner, caller, now)
            return seg

    def resolve(self, owner: str, name: str) -> shared_memory.SharedMemory:
        """The segment ``name`` if this store handed it to ``owner``; else ShmUnavailable."""
        with self._lock:
            st = self._by_name.get(name)
            if st is None or st.owner != owner:
                raise ShmUnavailable(f"shared-memory segment {name[:80]!r} is not a staging "
                                     "segment this store handed to this connection; ask for "
                                     "one first (Stage)")
            st.used_at = time.monotonic()
            self._by_name.move_to_end(name)
            return st.seg

    def __len__(self) -> int:
        with self._lock:
            return len(self._by_name)

    def close(self) -> None:
        with self._lock:
            for name in list(self._by_name):
                self._drop(name)

    def _total(self) -> int:
        return sum(st.seg.size for st in self._by_name.values())

    def _held(self, caller: str) -> int:
        return sum(st.seg.size for st in self._by_name.values() if st.caller == caller)

    def usage(self) -> dict[str, int]:
        """Bytes of staging segments per calling identity."""
        with self._lock:
            out: dict[str, int] = {}
            for st in self._by_name.values():
                out[st.caller] = out.get(st.caller, 0) + st.seg.size
            return out

    def __contains__(self, name: object) -> bool:
        with self._lock:
            return name in self._by_name

    def _drop(self, name: str) -> None:
        st = self._by_name.pop(name)
        disown_segment(name)
        with contextlib.suppress(FileNotFoundError):
            st.seg.unlink()
        with contextlib.suppress(BufferError):   # a Put still reading it: the mapping
            st.seg.close()                       # goes when its last view does
