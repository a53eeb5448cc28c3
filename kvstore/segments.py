"""Attached shared-memory segments, kept mapped between calls.

Mapping a segment is cheap, but touching a fresh mapping costs a page fault
per 4 KiB page (~1-2 us on the VMs measured here, i.e. a 128 MiB transfer
pays tens of milliseconds), so each side attaches a peer's segment once and
reuses the mapping: the store for clients' staging segments and for its own
G2 arena, a client for the store's G2 arena.
"""

from __future__ import annotations

import contextlib
import mmap
import threading
import time
from collections import OrderedDict
from multiprocessing import shared_memory

import xxhash

from kvstore.tiers.shm import GEN, ShmSlot, attach_segment

_MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)   # Linux >= 5.14


class SegmentCache:
    """LRU of attached segments; thread-safe. Old entries are closed when the
    cache is full (a client that re-created its staging segment under a new
    name leaves the old one here until it falls out)."""

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


def copy_is_trusted(seg: shared_memory.SharedMemory, slot: ShmSlot,
                    copies: list[memoryview]) -> bool:
    """After copying ``slot`` out of ``seg`` into ``copies`` (its pieces, in
    order): True when the copy is known good (see kvstore.tiers.shm)."""
    if time.monotonic() < slot.valid_until and GEN.unpack_from(seg.buf)[0] == slot.reuse_gen:
        return True
    if not slot.checksum:
        return False
    h = xxhash.xxh3_128()
    for piece in copies:
        h.update(piece)
    return h.digest() == slot.checksum
