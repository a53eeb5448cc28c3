"""G2: host DRAM, one named POSIX shared-memory arena per tier (``mem://[label]``).

Blocks live uncompressed in the arena (``lz4`` is ignored: G2 exists to be
read fast) at offsets from a size-class allocator, so a client on the same
host can copy a block straight out of the segment (``locate`` -> ``ShmSlot``,
read with ``ShmReader``) instead of through a socket. When CUDA is present
the segment is registered with ``cudaHostRegister`` (pinned), so host->GPU
copies run at DMA speed.

Segment layout: 64-byte header (u64 reuse generation at offset 0, see
``kvstore.tiers.shm``) then the arena. Freed slots wait ``reuse_grace_s``
before reuse so a same-host reader's copy rarely races a rewrite (it is
verified against the checksum either way).

Each block's xxh3-128 is kept in memory and verified on every ``get`` (any
same-host process can write the segment; a scribbled block is dropped, never
served). G2 needs no MAC, unlike G3/G4: the reference a copy is checked
against (checksum, key, tenant) lives in this process's private memory, not
in the shared segment, so changing it takes the store's own account (ptrace),
which holds the MAC key anyway; a same-host reader gets the checksum over the
authenticated gRPC channel. ``get`` returns a private copy: a view into the arena could change
under the caller once the slot is evicted and reused.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
import secrets
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from multiprocessing import shared_memory

import numpy as np

from kvstore.blockfile import BlockCorruptError, BlockMeta, checksum
from kvstore.tiers.arena import GraceArena, class_size
from kvstore.tiers.base import EvictCallback, PutOutcome, Tier, TierHit, register_tier
from kvstore.tiers.shm import GEN, SEGMENT_HEADER, ShmSlot, disown_segment, own_segment

log = logging.getLogger(__name__)


@dataclass(slots=True)
class _Slot:
    offset: int              # absolute offset in the segment
    size: int
    meta: BlockMeta          # checksum and size filled in


def _pin(shm: shared_memory.SharedMemory) -> Callable[[], None] | None:
    """cudaHostRegister the segment when CUDA is usable; returns the unpin call."""
    if importlib.util.find_spec("torch") is None:
        return None
    import torch

    if not torch.cuda.is_available():
        return None
    arr = np.frombuffer(shm.buf, dtype=np.uint8)
    ptr = arr.ctypes.data
    del arr  # release the buffer export at once, or shm.close() would refuse later
    cudart = torch.cuda.cudart()
    # Flag 1 = cudaHostRegisterPortable: pinned for every device's context, not only the current.
    err = cudart.cudaHostRegister(ptr, shm.size, 1)
    if int(err) != 0:
        log.warning("cudaHostRegister of %d bytes failed (error %s); G2 stays pageable",
                    shm.size, err)
        return None
    return lambda: cudart.cudaHostUnregister(ptr)


@register_tier("mem")
class HostTier(Tier):
    level = "G2"

    def __init__(self, url: str = "mem://", *, name: str, capacity_bytes: int,
                 policy: str = "lru", lz4: bool = False, on_evict: EvictCallback | None = None,
                 pin: bool | None = None, reuse_grace_s: float = 2.0) -> None:
        super().__init__(name=name, capacity_bytes=capacity_bytes, policy=policy, lz4=lz4,
                         on_evict=on_evict)
        self._arena = GraceArena(self.capacity_bytes, reuse_grace_s, self._bump_generation)
        label = url.partition("://")[2].strip("/") or self.name
        seg = f"kvs-{label[:40]}-{os.getpid()}-{secrets.token_hex(4)}"
        self._shm = shared_memory.SharedMemory(name=seg, create=True,
                                               size=SEGMENT_HEADER + self._arena.size)
        own_segment(self._shm.name)
        self._buf: memoryview | None = self._shm.buf
        GEN.pack_into(self._buf, 0, 0)
        self._generation = 0
        self._slots: dict[bytes, _Slot] = {}
        self._unpin = _pin(self._shm) if pin is not False else None
        self.pinned = self._unpin is not None

    @property
    def shm_name(self) -> str:
        return self._shm.name

    def prefault(self) -> bool:
        """Populate the whole arena's page tables now: first-touch page faults cost
        about 10x the copies themselves (kvstore.memtune), so a store pays them at
        start rather than on its first blocks. Returns False where unsupported."""
        from kvstore.memtune import populate

        return populate(self._shm)

    @property
    def early_reuses(self) -> int:
        """Times a slot was reused inside its grace period (space ran out)."""
        return self._arena.early_reuses

    def _bump_generation(self) -> None:
        # Runs before any quarantined byte is rewritten (GraceArena's contract).
        self._generation += 1
        GEN.pack_into(self._live_buf(), 0, self._generation)

    def _live_buf(self) -> memoryview:
        if self._buf is None:
            raise RuntimeError(f"G2 tier {self.name} is closed")
        return self._buf

    def put(self, key: bytes, payload: bytes | bytearray | memoryview,
            meta: BlockMeta) -> PutOutcome:
        self._check_put(key, meta)
        with self._lock:
            if key in self._slots:  # content-addressed: same key, same bytes
                self._cache.hit(key, self._now())
                return PutOutcome(True, existed=True)
        view = memoryview(payload).cast("B")
        digest = checksum(view)  # outside the lock: hashing 1 MiB takes ~0.1 ms
        if meta.checksum and meta.checksum != digest:
            raise BlockCorruptError(f"block {key.hex()}: payload does not match its checksum")
        meta = replace(meta, checksum=digest, size=view.nbytes)
        need = class_size(view.nbytes)
        evicted: list[tuple[BlockMeta, memoryview | None]] = []
        offset: int | None = None
        with self._lock:
            buf = self._live_buf()
            if key in self._slots:
                self._cache.hit(key, self._now())
                return PutOutcome(True, existed=True)
            if need > self._arena.size:
                return PutOutcome(False)
            adm = self._cache.put(key, need, self._now(), meta.traffic_class, meta.tenant)
            evicted.extend(self._release(k) for k in adm.evicted)
            if adm.stored:
                offset = self._arena.alloc(view.nbytes, time.monotonic())
            # Byte accounting fits but the free space may be fragmented: evict more.
            while adm.stored and offset is None:
                victim = self._cache.evict_one(meta.tenant, view.nbytes)
                if victim == key:
                    self._cache.evictions -= 1   # not stored after all, not an eviction
                    break
                evicted.append(self._release(victim))
                offset = self._arena.alloc(view.nbytes, time.monotonic())
            if offset is not None:
                offset += SEGMENT_HEADER
                buf[offset:offset + view.nbytes] = view
                self._slots[key] = _Slot(offset, view.nbytes, meta)
        self._notify_evicted(evicted)
        return PutOutcome(offset is not None, [m for m, _ in evicted])

    def _release(self, key: bytes) -> tuple[BlockMeta, memoryview | None]:
        """Free a slot (lock held); copy its bytes first only if someone wants them."""
        slot = self._slots.pop(key)
        data = None
        if self.on_evict is not None:
            data = memoryview(bytearray(self._live_buf()[slot.offset:slot.offset + slot.size]))
            if checksum(data) != slot.meta.checksum:
                self._checksum_failures += 1
                data = None
        self._arena.free(slot.offset - SEGMENT_HEADER, slot.size, time.monotonic())
        return slot.meta, data

    def _release_evicted(self, keys: list[bytes]) -> list[BlockMeta]:
        evicted = [self._release(k) for k in keys]
        self._notify_evicted(evicted)
        return [m for m, _ in evicted]

    def _drop(self, key: bytes) -> None:
        slot = self._slots.pop(key)
        self._cache.discard(key)
        self._arena.free(slot.offset - SEGMENT_HEADER, slot.size, time.monotonic())

    def get(self, key: bytes) -> TierHit | None:
        with self._lock:
            slot = self._slots.get(key)
            if slot is None:
                self._misses += 1
                return None
            # Copy under the lock: the slot cannot be freed and reused mid-copy.
            data = bytearray(self._live_buf()[slot.offset:slot.offset + slot.size])
        if checksum(data) != slot.meta.checksum:
            with self._lock:
                if self._slots.get(key) is slot:
                    self._drop(key)
                self._checksum_failures += 1
                self._misses += 1
            log.warning("G2 %s: block %s failed its checksum; dropped", self.name, key.hex())
            return None
        with self._lock:
            self._hits += 1
            self._cache.hit(key, self._now())
        return TierHit(slot.meta, memoryview(data))

    def locate(self, key: bytes) -> ShmSlot | None:
        """Where a same-host reader finds the block (counts as a hit); read it with
        ``ShmReader`` / ``copy_verified``, which verify every copy against the
        checksum returned here before it is used."""
        with self._lock:
            slot = self._slots.get(key)
            if slot is None:
                self._misses += 1
                return None
            self._hits += 1
            self._cache.hit(key, self._now())
            return ShmSlot(self._shm.name, slot.offset, slot.size, slot.meta.checksum,
                           time.monotonic() + self._arena.grace_s, self._generation)

    def meta(self, key: bytes) -> BlockMeta | None:
        with self._lock:
            slot = self._slots.get(key)
            return slot.meta if slot else None

    def delete(self, key: bytes) -> bool:
        with self._lock:
            if key not in self._slots:
                return False
            self._drop(key)
            return True

    def scan(self) -> Iterator[BlockMeta]:
        with self._lock:
            metas = [s.meta for s in self._slots.values()]
        yield from metas

    def close(self) -> None:
        with self._lock:
            if self._buf is None:
                return
            if self._unpin is not None:
                self._unpin()
                self._unpin = None
            self._slots.clear()
            self._buf = None
            self._shm.close()
            self._shm.unlink()
            disown_segment(self._shm.name)

    def __del__(self) -> None:
        # Last resort for a tier never closed (or half-built); the segment must not leak.
        with contextlib.suppress(Exception):
            self.close()
