"""Same-host reads of G2 blocks straight from the store's shared-memory arena.

The store answers ``locate(key)`` with a ``ShmSlot``; a client on the same
host attaches the named segment once and copies the slot out, with no socket
in between. Any process of the store's user can write the segment, and a slot
can be evicted and reused while the client copies, so **every copy is hashed
and compared with the checksum taken at put before anyone uses it**
(``copy_verified``: the hash runs over the private copy, chunk by chunk while
each chunk is in cache); a mismatch returns False and the caller falls back
to a normal get, which verifies again in the store and drops a bad block.

The store still avoids rewriting a freed slot within ``grace`` seconds
(``valid_until``) and bumps a reuse generation (u64 at offset 0) when it must:
that keeps legitimate reuse, and so refetches, rare. Neither is trusted in
place of the hash.
"""

from __future__ import annotations

import struct
import sys
import threading
from collections.abc import Iterable, Sequence
from multiprocessing import resource_tracker, shared_memory
from typing import NamedTuple

import numpy as np
import xxhash

GEN = struct.Struct("<Q")   # the reuse generation at offset 0 of a G2 segment
SEGMENT_HEADER = 64         # bytes before the arena (one cache line)
# Copy-then-hash granule: small enough that the copied chunk is still in L2 when it
# is hashed (measured on cpu-2c: 256-512 KiB ~ memcpy speed, 64 KiB pays Python
# overhead per chunk, whole 2 MiB blocks fall out of cache and cost a second pass).
VERIFY_CHUNK = 256 * 2**10


class ShmSlot(NamedTuple):
    shm_name: str
    offset: int             # absolute offset in the segment
    size: int
    checksum: bytes = b""   # xxh3-128 of the payload, to verify a copy taken from the slot
    valid_until: float = 0.0  # time.monotonic() before which the slot is normally not reused
    reuse_gen: int = -1       # the segment's reuse generation at locate (a hint, never trusted)


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


def digest_matches(pieces: Iterable[memoryview | bytes], want: bytes) -> bool:
    """Whether the concatenation of ``pieces`` (private copies) hashes to ``want``.
    An empty ``want`` never matches: a copy with nothing to check is not used."""
    if not want:
        return False
    h = xxhash.xxh3_128()
    for piece in pieces:
        h.update(piece)
    return h.digest() == want


def copy_verified(seg: shared_memory.SharedMemory, slot: ShmSlot,
                  out: bytearray | memoryview) -> bool:
    """Copy ``slot`` out of ``seg`` into ``out`` and verify the copy against
    ``slot.checksum``, hashing each chunk right after copying it. False when the
    slot is out of bounds, ``out`` has the wrong size, or the copy does not
    match (scribbled, or reused under us): the caller must not use ``out``."""
    dst = memoryview(out).cast("B")
    if not slot.checksum or slot.offset < SEGMENT_HEADER \
            or slot.offset + slot.size > seg.size or dst.nbytes != slot.size:
        return False
    src = np.frombuffer(seg.buf, dtype=np.uint8, count=slot.size, offset=slot.offset)
    d = np.frombuffer(dst, dtype=np.uint8)
    h = xxhash.xxh3_128()
    step = VERIFY_CHUNK
    for off in range(0, slot.size, step):
        piece = d[off:off + step]
        np.copyto(piece, src[off:off + step])   # both release the GIL
        h.update(piece)
    del src
    return h.digest() == slot.checksum


def copy_verified_scatter(seg: shared_memory.SharedMemory, slot: ShmSlot,
                          outs: Sequence[memoryview]) -> bool:
    """``copy_verified`` into a destination in pieces: ``outs`` in order receive
    the slot's bytes (a vLLM block goes straight into each layer's paged cache),
    hashed piece by piece right after each copy. False as for ``copy_verified``;
    then the pieces hold unverified bytes and the caller must not use them."""
    views = [memoryview(o).cast("B") for o in outs]
    if not slot.checksum or slot.offset < SEGMENT_HEADER \
            or slot.offset + slot.size > seg.size or sum(v.nbytes for v in views) != slot.size:
        return False
    src = np.frombuffer(seg.buf, dtype=np.uint8, count=slot.size, offset=slot.offset)
    h = xxhash.xxh3_128()
    pos = 0
    for v in views:
        d = np.frombuffer(v, dtype=np.uint8)
        for off in range(0, v.nbytes, VERIFY_CHUNK):
            piece = d[off:off + VERIFY_CHUNK]
            np.copyto(piece, src[pos + off:pos + off + piece.size])
            h.update(piece)
        pos += v.nbytes
    del src
    return h.digest() == slot.checksum


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
        """A private, verified copy of the slot's bytes, or None if it does not match
        (scribbled, reused under us) or the segment is gone."""
        data = bytearray(slot.size)
        return memoryview(data) if self.read_into(slot, data) else None

    def read_into(self, slot: ShmSlot, out: bytearray | memoryview) -> bool:
        """Copy the slot into ``out`` (e.g. a pinned tensor's buffer) and verify it; False
        if it does not match its checksum (the caller then fetches the block another way)."""
        try:
            shm = self._segment(slot.shm_name)
        except FileNotFoundError:
            return False
        return copy_verified(shm, slot, out)

    def close(self) -> None:
        with self._lock:
            for shm in self._segments.values():
                shm.close()
            self._segments.clear()
