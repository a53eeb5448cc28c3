"""Same-host reads of G2 blocks straight from the store's shared-memory arena.

The store answers ``locate(key)`` with a ``ShmSlot``; a client on the same
host attaches the named segment once and copies the slot out, with no socket
in between. The slot can be evicted and reused while the client copies, so a
copy is trusted only when provably untouched, else verified by checksum:

- the store never rewrites a freed slot within ``grace`` seconds of freeing it
  (``valid_until`` = locate time + grace, on ``time.monotonic()``, which is one
  clock for every process of a Linux host), unless it runs out of space; then it
  first bumps the reuse generation, a u64 at offset 0 of the segment;
- a copy finished before ``valid_until`` while the generation still equals the
  slot's ``reuse_gen`` cannot have seen a rewrite (x86 keeps stores in order:
  the generation bump is visible before any byte of the rewrite). Otherwise the
  copy is hashed and compared with ``checksum``; a mismatch returns None and the
  caller falls back to a normal get.
"""

from __future__ import annotations

import struct
import sys
import threading
import time
from multiprocessing import resource_tracker, shared_memory
from typing import NamedTuple

from kvstore.blockfile import checksum

GEN = struct.Struct("<Q")   # the reuse generation at offset 0 of a G2 segment
SEGMENT_HEADER = 64         # bytes before the arena (one cache line)


class ShmSlot(NamedTuple):
    shm_name: str
    offset: int             # absolute offset in the segment
    size: int
    checksum: bytes = b""   # xxh3-128 of the payload, to verify a copy taken from the slot
    valid_until: float = 0.0  # time.monotonic() before which the slot is not rewritten...
    reuse_gen: int = -1       # ...as long as the segment's generation still equals this


# Segments this process created: their resource-tracker registration is the
# crash cleanup (the tracker unlinks them if the store dies) and must stay.
_OWNED: set[str] = set()


def own_segment(name: str) -> None:
    _OWNED.add(name)


def disown_segment(name: str) -> None:
    _OWNED.discard(name)


def attach_segment(name: str) -> shared_memory.SharedMemory:
    """Attach an existing segment without adopting it: the attaching process's
    resource tracker must not unlink the store's segment when it exits
    (CPython < 3.13 registers every attachment; 3.13 added ``track=False``)."""
    if sys.version_info >= (3, 13):
        return shared_memory.SharedMemory(name=name, track=False)  # type: ignore[call-arg]
    shm = shared_memory.SharedMemory(name=name)
    if shm.name not in _OWNED:
        resource_tracker.unregister(shm._name, "shared_memory")  # type: ignore[attr-defined]
    return shm


class ShmReader:
    """Client-side cache of attached segments; thread-safe."""

    def __init__(self) -> None:
        self._segments: dict[str, shared_memory.SharedMemory] = {}
        self._lock = threading.Lock()

    def _segment(self, name: str) -> shared_memory.SharedMemory:
        with self._lock:
            shm = self._segments.get(name)
            if shm is None:
                shm = self._segments[name] = attach_segment(name)
            return shm

    def read(self, slot: ShmSlot) -> memoryview | None:
        """A private copy of the slot's bytes, or None if it changed under us (or the
        segment is gone)."""
        data = bytearray(slot.size)
        return memoryview(data) if self.read_into(slot, data) else None

    def read_into(self, slot: ShmSlot, out: bytearray | memoryview) -> bool:
        """Copy the slot into ``out`` (e.g. a pinned tensor's buffer); False if the copy
        cannot be trusted (the caller then fetches the block another way)."""
        try:
            shm = self._segment(slot.shm_name)
        except FileNotFoundError:
            return False
        dst = memoryview(out).cast("B")
        if slot.offset < SEGMENT_HEADER or slot.offset + slot.size > shm.size \
                or dst.nbytes != slot.size:
            return False
        dst[:] = shm.buf[slot.offset:slot.offset + slot.size]
        if time.monotonic() < slot.valid_until and GEN.unpack_from(shm.buf)[0] == slot.reuse_gen:
            return True
        return bool(slot.checksum) and checksum(dst) == slot.checksum

    def close(self) -> None:
        with self._lock:
            for shm in self._segments.values():
                shm.close()
            self._segments.clear()
