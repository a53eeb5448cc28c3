"""Per-request host buffer of a prompt's KV, served to decode by PullKV, and
decode's side that places and verifies the pieces.

After prefill a prompt's entry is first **resident**: its KV is still in the
prefill engine (a ``Resident`` says how to get it out), so a returning
session's pull copies out only the tail decode lacks, once, on the first pull
(``hold``). A resident entry not pulled soon is copied out whole by the
service (``fill``: it demotes it so its blocks never starve admissions).
Either way the entry then holds tokens [``start``, ``n_tokens``) on the host
until decode releases it; a later pull asking for tokens before ``start`` is
refused (HandleExpired: decode rebuilds them).

The wire format of a piece is the raw bytes of
``[layers, 2, kv_heads, token_count, head_dim]`` in the engine dtype
(docs/engine.md): pieces are cut along the token axis so a reader can place
them into one preallocated tensor.

Lifetime: there is no expiry clock, since a backlogged decode is no reason to
throw finished work away. The buffer is bounded by bytes instead: a put that
needs room drops the oldest entries holding host bytes, and an entry nobody
pulled for ``abandon_s`` (its router went away) is swept. Dropping is always safe
because decode can rebuild any prompt's KV (restore what the warehouse holds,
recompute the rest); a pull of a dropped handle says so and decode rebuilds.
Dropping a resident entry releases its sequence in the engine. Only host
bytes count against the bound: resident entries are bounded by the service's
demotion (prefill_svc/steps.py).

Same-host pulls skip the byte stream: the buffer writes the tensor once into
a private file under ``/dev/shm`` (service.kv_shm: 0600, exclusive create, an
unguessable name) and the reader copies it out with one read. Every piece,
file or bytes, carries a checksum prefill took from its own memory, seeded
with the handle's secret ``kv_seed``; the assembler verifies it before the KV
goes anywhere, and a mismatch is a ``KVIntegrityError`` (decode recomputes).

Same-device pulls skip the host altogether (service.kv_ipc): a resident
entry's first such pull gathers its KV into one device tensor that the entry
then holds (counted against the same byte bound), shared as a CUDA IPC
handle; decode copies it device to device and releases it. Its checksum is
``kv_ipc.device_digest``, taken on the device. A shared copy decode neither
released nor closed within ``ipc_hold_s`` is dropped, and a dead decode's
reference counted down (``kv_ipc.release_orphan``), so it cannot pin device
memory for the prefill's life.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import threading
import time
import warnings
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from engine.staging import CAPTURE, DeviceBudget, PinnedChunks, upload_file
from service import kv_ipc, kv_shm
from service.aio import retrieve
from service.errors import HandleExpired, InvalidRequest

log = logging.getLogger(__name__)

# Dropped entries are remembered (without their tensors) for a while so that a
# late pull says why the KV is gone rather than "unknown".
_TOMBSTONE_S = 600.0
_MAX_TOMBSTONES = 65_536


class KVIntegrityError(ValueError):
    """A hand-off piece does not match the checksum prefill sent for it."""


class IpcUnusable(RuntimeError):
    """A same-device handle this process cannot map (another GPU after all, no
    CUDA here): the pull asks again for the host path."""


@dataclass(frozen=True, slots=True)
class KVShape:
    """Per-token KV geometry: one token is ``[layers, 2, kv_heads, head_dim]``."""

    layers: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @property
    def token_nbytes(self) -> int:
        return self.layers * 2 * self.kv_heads * self.head_dim * self.dtype.itemsize

    def dims(self, n_tokens: int) -> tuple[int, int, int, int, int]:
        return (self.layers, 2, self.kv_heads, n_tokens, self.head_dim)

    @classmethod
    def of(cls, kv: torch.Tensor) -> KVShape:
        layers, two, kv_heads, _, head_dim = kv.shape
        if two != 2:
            raise ValueError("KV tensor must be [layers, 2, kv_heads, tokens, head_dim], "
                             f"got {tuple(kv.shape)}")
        return cls(layers, kv_heads, head_dim, kv.dtype)


@dataclass(frozen=True, slots=True)
class KVPiece:
    """Tokens [start_token, start_token + token_count) either as bytes or as a
    region of a shared-memory file (``shm_name`` set, ``data`` empty), with
    the checksum of those bytes."""

    start_token: int
    token_count: int
    data: bytes = b""
    shm_name: str = ""
    shm_offset: int = 0
    size: int = 0
    checksum: bytes = b""
    ipc: kv_ipc.Share | None = None     # a same-device pull: the staging copy's handle


# A contiguous host tensor of these dims and dtype for a copy-out to land in
# (called from the copy's worker thread).
HostAlloc = Callable[[tuple[int, ...], torch.dtype], torch.Tensor]


@dataclass(frozen=True, slots=True, eq=False)
class Resident:
    """How to get a resident prompt's KV out of the engine that still holds it.
    Compared by identity: it names one prefill of a request id."""

    # tokens [start, n) to the host (into a tensor from the HostAlloc when it
    # can), or with ``on_device`` into one contiguous device tensor (a same-device
    # pull), then the sequence freed; None when the engine no longer holds it
    # (demoted: its ``fill`` came first)
    materialize: Callable[[int, HostAlloc, bool], Awaitable[torch.Tensor | None]]
    release: Callable[[], None]     # free the sequence unread (never raises)


@dataclass(slots=True)
class BufferEntry:
    request_id: str
    kv: torch.Tensor | None         # [layers, 2, kv_heads, n_tokens - start, head_dim],
                                    # contiguous, on the host (or the device for a
                                    # same-device pull); None while resident
    seed: int                       # the handle's kv_seed: keys the pieces' checksums
    put_at: float                   # buffer clock
    n_tokens: int                   # the prompt's tokens
    start: int = 0                  # first token ``kv`` holds (decode has the ones before)
    resident: Resident | None = None    # set while the engine holds the KV
    filling: asyncio.Task[None] | None = None   # the copy-out of a resident entry, once
    # start token -> (file name, checksum): the KV from that token on, written on first use
    shm: dict[int, tuple[str, bytes]] = field(default_factory=dict)
    # Guards ``shm``: one writer per entry; other entries' files are written meanwhile
    # (one lock for the whole buffer queued every pull behind every other's write).
    shm_lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    # The hand-off file ``kv`` is a mapping of (its copy-out landed there): it
    # serves a pull from ``start`` without another write.
    backing: str = ""
    # A same-device pull shared ``kv`` (on the device): the handle, the pulling
    # process (kv_ipc.peer_id), the device digest, when (buffer clock), the device.
    ipc: tuple[kv_ipc.Share, str, bytes, float, torch.device] | None = None

    @property
    def on_device(self) -> bool:
        return self.kv is not None and self.kv.device.type != "cpu"

    @property
    def nbytes(self) -> int:
        return 0 if self.kv is None else self.kv.numel() * self.kv.element_size()

    def tail(self, first: int, end: int | None = None) -> torch.Tensor:
        """Host tokens [first, end) (``first`` >= ``start``) as a view."""
        assert self.kv is not None and first >= self.start
        stop = self.n_tokens if end is None else end
        return self.kv[:, :, :, first - self.start:stop - self.start, :]


@dataclass(frozen=True, slots=True)
class BufferStats:
    entries: int
    bytes: int
    released: int
    evicted: int                    # dropped to make room (decode rebuilds them)
    abandoned: int                  # never pulled within abandon_s
    unbuffered: int                 # larger than the whole buffer: never held
    shm_files: int
    resident: int                   # entries whose KV the engine still holds
    device: int = 0                 # entries holding a device staging copy (same-device pulls)
    ipc_expired: int = 0            # shared copies neither released nor closed in ipc_hold_s
    ipc_orphans: int = 0            # of them, a dead decode's references counted down


def _held(kv: torch.Tensor) -> torch.Tensor:
    """What an entry keeps: contiguous, on the host, or on the device where it is
    (a same-device pull's staging copy)."""
    kv = kv.detach()
    return (kv if kv.device.type == "cuda" else kv.to("cpu")).contiguous()


def _raw(t: torch.Tensor) -> np.ndarray:
    """The bytes of a contiguous tensor as a uint8 array, without a copy."""
    return t.reshape(-1).view(torch.uint8).numpy()


class KVBuffer:
    def __init__(self, *, max_bytes: int, chunk_bytes: int, shm_dir: str = "",
                 abandon_s: float = 3600.0, clock: Callable[[], float] = time.monotonic,
                 names: Callable[[], str] = kv_shm.new_name, ipc_hold_s: float = 60.0) -> None:
        if abandon_s <= 0 or ipc_hold_s <= 0:
            raise ValueError(f"abandon_s and ipc_hold_s must be > 0, got {abandon_s}, "
                             f"{ipc_hold_s}")
        self._ipc_hold_s = ipc_hold_s
        self._max_bytes = max_bytes
        self._chunk_bytes = chunk_bytes
        self._abandon_s = abandon_s
        usable = bool(shm_dir) and os.path.isdir(shm_dir) and os.access(shm_dir, os.W_OK)
        self._shm_dir = Path(shm_dir) if usable else None
        if self._shm_dir is not None:
            swept = kv_shm.sweep_orphans(self._shm_dir)
            if swept:
                log.warning("removed %d hand-off files a killed process left in %s", swept,
                            self._shm_dir)
        self._clock = clock
        self._names = names
        self._entries: dict[str, BufferEntry] = {}       # oldest first (insertion order)
        self._gone: dict[str, tuple[float, str]] = {}    # request id -> (when, why)
        self._bytes = 0
        self._counts = {"released": 0, "evicted": 0, "abandoned": 0, "unbuffered": 0,
                        "ipc_expired": 0, "ipc_orphans": 0}

    @property
    def shm_capable(self) -> bool:
        return self._shm_dir is not None

    @property
    def bytes(self) -> int:
        return self._bytes

    @staticmethod
    def new_seed() -> int:
        """A handle's secret ``kv_seed`` (it goes out in the handle before the put)."""
        return secrets.randbits(64)

    def put(self, request_id: str, kv: torch.Tensor, *, seed: int) -> BufferEntry | None:
        """Keep ``kv`` (moved to host if needed) for ``request_id``, dropping the
        oldest entries if it needs room; replaces an entry of the same id. None
        when it is larger than the whole buffer: decode then rebuilds it."""
        self.sweep()
        kv = _held(kv)
        KVShape.of(kv)
        nbytes = kv.numel() * kv.element_size()
        if request_id in self._entries:
            self._drop(request_id, "released")
        if nbytes > self._max_bytes:
            self._counts["unbuffered"] += 1
            self._remember(request_id, "larger than the whole buffer")
            return None
        self._make_room(nbytes)
        entry = BufferEntry(request_id, kv, seed, self._clock(), int(kv.shape[3]))
        self._entries[request_id] = entry
        self._gone.pop(request_id, None)
        self._bytes += nbytes
        return entry

    def put_resident(self, request_id: str, n_tokens: int, *, seed: int,
                     resident: Resident) -> BufferEntry:
        """An entry whose ``n_tokens`` of KV the engine still holds: copied out
        on the first pull (``hold``) or by the service (``fill``). Replaces an
        entry of the same id."""
        if n_tokens < 1:
            raise ValueError(f"a resident entry needs tokens, got {n_tokens}")
        self.sweep()
        if request_id in self._entries:
            self._drop(request_id, "released")
        entry = BufferEntry(request_id, None, seed, self._clock(), n_tokens, resident=resident)
        self._entries[request_id] = entry
        self._gone.pop(request_id, None)
        return entry

    def fill(self, resident: Resident, kv: torch.Tensor, start: int = 0, *,
             backing: str = "") -> BufferEntry | None:
        """The KV of a resident entry's tokens [``start``, n) is on the host now
        (the engine freed the sequence): the entry holds it. None when the entry
        went meanwhile, or is larger than the whole buffer (then it goes too).
        ``backing``: the hand-off file ``kv`` maps (this buffer's ``host_alloc``);
        it goes with the entry, or now if the entry is not kept."""
        entry = self._resident_entry(resident)
        if entry is None:
            self._unlink(backing)
            return None
        kv = _held(kv)
        KVShape.of(kv)
        if int(kv.shape[3]) != entry.n_tokens - start:
            self._unlink(backing)
            self.lose(resident, "copied out with the wrong length; rebuild it")
            raise ValueError(f"KV of {kv.shape[3]} tokens from {start} for a prompt of "
                             f"{entry.n_tokens}")
        nbytes = kv.numel() * kv.element_size()
        # Out of the eviction order while room is made: it is the newest now.
        del self._entries[entry.request_id]
        entry.resident = None
        if nbytes > self._max_bytes:
            self._unlink(backing)
            self._counts["unbuffered"] += 1
            self._remember(entry.request_id, "larger than the whole buffer")
            return None
        self._make_room(nbytes)
        entry.kv, entry.start, entry.backing = kv, start, backing
        self._entries[entry.request_id] = entry
        self._bytes += nbytes
        return entry

    def lose(self, resident: Resident, why: str) -> None:
        """A resident entry's KV could not be copied out (the engine freed it):
        it goes, and a pull says ``why``."""
        entry = self._resident_entry(resident)
        if entry is not None:
            entry.resident = None       # nothing left to release
            del self._entries[entry.request_id]
            self._remember(entry.request_id, why)

    async def hold(self, entry: BufferEntry, first: int, *,
                   on_device: bool = False) -> BufferEntry:
        """``entry`` with its KV from token ``first`` on held: a resident one is
        copied out from ``first`` on (once, however many pull it at once; a
        caller that leaves does not stop it), to the host, or with
        ``on_device`` into a device tensor (same-device pulls; the host when
        the device is full)."""
        self.check_start(entry, first)
        if entry.kv is None and entry.resident is not None:
            if entry.filling is None:
                entry.filling = asyncio.ensure_future(self._materialize(entry, entry.resident,
                                                                        first, on_device))
                entry.filling.add_done_callback(retrieve)
            await asyncio.shield(entry.filling)
        if entry.kv is None and entry.resident is not None:
            self.lose(entry.resident, "the engine no longer held it; rebuild it")
        if self._entries.get(entry.request_id) is not entry:
            self.get(entry.request_id)                   # says why it went
            raise HandleExpired(f"KV handle of request {entry.request_id!r} was replaced "
                                "while it was being pulled")
        self.check_start(entry, first)
        return entry

    async def _materialize(self, entry: BufferEntry, resident: Resident, first: int,
                           on_device: bool = False) -> None:
        made: list[tuple[torch.Tensor, str]] = []

        def alloc(dims: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
            t, name = self.host_alloc(dims, dtype)
            made.append((t, name))
            return t

        try:
            kv = await resident.materialize(first, alloc, on_device)
        except Exception as exc:        # the engine freed it: a pull says why, decode rebuilds
            for _, name in made:
                self._unlink(name)
            self.lose(resident, f"copy-out failed: {exc}; rebuild it")
            return
        backing = ""
        for t, name in made:            # the one the copy landed in backs the entry
            if kv is not None and not backing and t.data_ptr() == kv.data_ptr():
                backing = name
            else:
                self._unlink(name)
        if kv is not None:
            self.fill(resident, kv, first, backing=backing)

    def host_alloc(self, dims: tuple[int, ...], dtype: torch.dtype) -> tuple[torch.Tensor, str]:
        """A contiguous host tensor for a copy-out: with shared memory, a
        mapping of a new private hand-off file (its name returned), so the
        copy-out writes the file a same-host pull reads; else plain memory
        (name ""). Safe from a worker thread."""
        nbytes = int(np.prod(dims)) * dtype.itemsize
        if self._shm_dir is None or nbytes < 1:
            return torch.empty(dims, dtype=dtype), ""
        try:
            name, mapped = kv_shm.create_mapped(self._shm_dir, nbytes, self._names)
        except OSError:                 # /dev/shm full: plain memory, streamed or written later
            return torch.empty(dims, dtype=dtype), ""
        with warnings.catch_warnings():     # torch warns that an mmap is writable: it is
            warnings.simplefilter("ignore", UserWarning)
            flat = torch.frombuffer(mapped, dtype=torch.uint8)
        return flat.view(dtype).view(dims), name

    def _unlink(self, name: str) -> None:
        if name and self._shm_dir is not None:
            (self._shm_dir / name).unlink(missing_ok=True)

    def _make_room(self, nbytes: int) -> None:
        """Drop the oldest host-held entries until ``nbytes`` more fit; resident
        ones hold no host bytes, so dropping them would free none."""
        while self._bytes + nbytes > self._max_bytes:
            oldest = next(rid for rid, e in self._entries.items() if e.kv is not None)
            self._drop(oldest, "evicted")

    def _resident_entry(self, resident: Resident) -> BufferEntry | None:
        return next((e for e in self._entries.values() if e.resident is resident), None)

    def get(self, request_id: str) -> BufferEntry:
        entry = self._entries.get(request_id)
        if entry is None:
            gone = self._gone.get(request_id)
            if gone is not None:
                raise HandleExpired(f"KV handle of request {request_id!r} is no longer "
                                    f"buffered here ({gone[1]})")
            raise HandleExpired(f"no KV buffered for request {request_id!r} on this prefill "
                                "instance (never prefilled here, or the instance restarted)")
        return entry

    @staticmethod
    def check_start(entry: BufferEntry, start: int) -> None:
        """A pull from ``start`` on: decode holds the tokens before it already."""
        if not 0 <= start < entry.n_tokens:
            raise InvalidRequest(f"start_token {start} is outside the {entry.n_tokens} "
                                 f"buffered tokens of request {entry.request_id!r}")
        if entry.kv is not None and start < entry.start:
            # An earlier pull copied out only its tail; the engine has freed the rest.
            raise HandleExpired(f"KV of request {entry.request_id!r} is held from token "
                                f"{entry.start} on only (an earlier pull took the tail); "
                                f"tokens from {start} must be rebuilt")

    def ipc_piece(self, entry: BufferEntry, first: int, peer: str) -> KVPiece | None:
        """The entry's device KV (from ``first`` = its start) shared with the
        pulling process ``peer`` (kv_ipc.peer_id), with its device digest;
        shared once, however many pull it. None when the entry holds no device
        copy of exactly those tokens (the pull takes the host path)."""
        self.check_start(entry, first)
        if not entry.on_device or first != entry.start:
            return None
        assert entry.kv is not None
        if entry.ipc is None:
            with CAPTURE.copy():        # the digest allocates on the device
                digest = kv_ipc.device_digest(entry.kv, entry.seed)
            entry.ipc = (kv_ipc.share(entry.kv), peer, digest, self._clock(), entry.kv.device)
        share, _, digest, _, _ = entry.ipc
        n = entry.n_tokens - first
        return KVPiece(first, n, size=n * KVShape.of(entry.kv).token_nbytes, checksum=digest,
                       ipc=share)

    def _on_host(self, entry: BufferEntry) -> None:
        """A host pull of an entry held on the device (its same-device pull fell
        back): the copy moves to the host, once (same bytes: the bound holds)."""
        if entry.on_device:
            assert entry.kv is not None
            entry.kv = entry.kv.cpu()

    def pieces(self, entry: BufferEntry, first: int = 0) -> Iterator[KVPiece]:
        """The entry's KV from token ``first`` on, as byte pieces of about
        ``chunk_bytes`` each."""
        self.check_start(entry, first)
        self._on_host(entry)
        assert entry.kv is not None, "pulled entries are held (KVBuffer.hold)"
        step = max(1, self._chunk_bytes // KVShape.of(entry.kv).token_nbytes)
        for start in range(first, entry.n_tokens, step):
            end = min(entry.n_tokens, start + step)
            data = _raw(entry.tail(start, end).contiguous()).tobytes()
            yield KVPiece(start, end - start, data=data,
                          checksum=kv_shm.piece_checksum(data, entry.seed))

    def shm_piece(self, entry: BufferEntry, first: int = 0) -> KVPiece:
        """The entry's KV from token ``first`` on as one private shared-memory
        file (written on first use; its checksum taken from memory, never from
        the file). Safe to call from a worker thread (the write is long: the
        event loop need not wait)."""
        if self._shm_dir is None:
            raise InvalidRequest("this prefill instance offers no shared-memory pulls")
        self.check_start(entry, first)
        assert entry.kv is not None, "pulled entries are held (KVBuffer.hold)"
        with entry.shm_lock:
            self._on_host(entry)
            if first not in entry.shm and first == entry.start and entry.backing:
                # The copy-out wrote the file: only its checksum, from this
                # process's mapping (decode checks the bytes it reads against it).
                entry.shm[first] = (entry.backing, kv_shm.piece_checksum(_raw(entry.kv),
                                                                         entry.seed))
                if self._entries.get(entry.request_id) is not entry:    # dropped: file gone
                    raise HandleExpired(f"KV handle of request {entry.request_id!r} was "
                                        "released while it was being pulled")
            if first not in entry.shm:
                tail = entry.kv if first == entry.start else entry.tail(first).contiguous()
                raw = _raw(tail)
                checksum = kv_shm.piece_checksum(raw, entry.seed)
                name = kv_shm.create_private(self._shm_dir, memoryview(raw), self._names)
                # Name first, then look: a drop after this line unlinks the file
                # itself, one before it is seen here.
                entry.shm[first] = (name, checksum)
                if self._entries.get(entry.request_id) is not entry:
                    (self._shm_dir / name).unlink(missing_ok=True)
                    raise HandleExpired(f"KV handle of request {entry.request_id!r} was "
                                        "released while it was being pulled")
        name, checksum = entry.shm[first]
        n = entry.n_tokens - first
        return KVPiece(first, n, shm_name=name, size=n * KVShape.of(entry.kv).token_nbytes,
                       checksum=checksum)

    def release(self, request_id: str) -> bool:
        """Free a handle's KV; False when it was not held (released or dropped before)."""
        if request_id not in self._entries:
            return False
        self._drop(request_id, "released")
        return True

    def sweep(self) -> int:
        """Drop entries nobody pulled within ``abandon_s``, and shared device
        copies decode did not release within ``ipc_hold_s``; returns how many."""
        now = self._clock()
        old = [rid for rid, e in self._entries.items() if now - e.put_at > self._abandon_s]
        for rid in old:
            self._drop(rid, "abandoned")
        for rid in [rid for rid, e in self._entries.items()
                    if e.ipc is not None and now - e.ipc[3] > self._ipc_hold_s]:
            self._counts["ipc_expired"] += 1
            self._drop(rid, "abandoned")
            old.append(rid)
        for rid in [rid for rid, (t, _) in self._gone.items() if now - t > _TOMBSTONE_S]:
            del self._gone[rid]
        return len(old)

    def close(self) -> None:
        for rid in list(self._entries):
            self._drop(rid, "released")

    def stats(self) -> BufferStats:
        shm = sum(len(e.shm) for e in self._entries.values())
        resident = sum(e.resident is not None for e in self._entries.values())
        c = self._counts
        device = sum(e.on_device for e in self._entries.values())
        return BufferStats(len(self._entries), self._bytes, c["released"], c["evicted"],
                           c["abandoned"], c["unbuffered"], shm, resident, device,
                           c["ipc_expired"], c["ipc_orphans"])

    def _drop(self, request_id: str, why: str) -> None:
        entry = self._entries.pop(request_id)
        self._bytes -= entry.nbytes
        self._counts[why] += 1
        self._remember(request_id, {"evicted": "dropped for room; rebuild it",
                                    "abandoned": "never pulled; rebuild it"}.get(why, why))
        if self._shm_dir is not None:
            for name, _ in entry.shm.values():
                (self._shm_dir / name).unlink(missing_ok=True)
        self._unlink(entry.backing)
        if entry.ipc is not None:
            # A decode that died before closing its mapping never counts it down:
            # then the block would sit in torch's limbo for this process's life.
            share, peer, _, _, device = entry.ipc
            if kv_ipc.release_orphan(share, peer, device):
                self._counts["ipc_orphans"] += 1
        if entry.resident is not None:
            entry.resident, resident = None, entry.resident
            resident.release()          # the engine frees the sequence

    def _remember(self, request_id: str, why: str) -> None:
        if len(self._gone) >= _MAX_TOMBSTONES:
            del self._gone[next(iter(self._gone))]
        self._gone[request_id] = (self._clock(), why)


@dataclass(frozen=True, slots=True)
class Upload:
    """Where a whole-prompt hand-off file goes straight to: the engine's device,
    through ``chunks`` (engine.staging.upload_file), while ``budget`` allows."""

    device: torch.device
    chunks: PinnedChunks
    budget: DeviceBudget


class KVAssembler:
    """Decode side: verifies each piece against its checksum and places it into
    one ``[layers, 2, kv_heads, n, head_dim]`` tensor.

    Shared-memory bytes are copied into this process before they are checked,
    so what was verified is what is adopted (a mapping of the file could still
    change under the reader). A whole-prompt file is read straight into the
    result tensor: one copy, as the byte stream makes; with ``upload``, that
    tensor is on the device (read into pinned chunks, checksummed there, then
    DMA'd), so the adopt on the engine thread copies nothing from the host."""

    def __init__(self, shape: KVShape, n_tokens: int, *, seed: int,
                 shm_dir: str = "/dev/shm", first: int = 0,
                 upload: Upload | None = None) -> None:
        """Tokens [``first``, ``n_tokens``) of a prompt (decode holds the ones before)."""
        if not 0 <= first < n_tokens:
            raise ValueError(f"first token {first} is outside a prompt of {n_tokens} tokens")
        self._upload = upload
        self._shape = shape
        self._n = n_tokens
        self._first = first
        self._seed = seed
        self._shm_dir = Path(shm_dir)
        self._kv: torch.Tensor | None = None
        self._filled = first
        self.path = ""                  # how the pieces came: "ipc" | "shm" | "stream"

    @property
    def kv(self) -> torch.Tensor:
        """Tokens [first, n): index 0 is token ``first``."""
        if self._kv is None:
            self._kv = torch.empty(self._shape.dims(self._n - self._first),
                                   dtype=self._shape.dtype)
        return self._kv

    def add(self, piece: KVPiece) -> None:
        start, count = piece.start_token, piece.token_count
        if start != self._filled or count <= 0 or start + count > self._n:
            raise ValueError(f"KV piece [{start}, {start + count}) out of order or out of range "
                             f"(have {self._filled} of {self._n} tokens)")
        at = start - self._first
        want = count * self._shape.token_nbytes
        self.path = "ipc" if piece.ipc else "shm" if piece.shm_name else "stream"
        if piece.ipc is not None:
            if start != self._first or count != self._n - self._first or piece.size != want:
                raise ValueError(f"a same-device piece must be the whole [{self._first}, "
                                 f"{self._n}) of {want} bytes, got [{start}, {start + count}) "
                                 f"of {piece.size}")
            self._kv = self._copied(piece, want)
            self._filled += count
            return
        if piece.shm_name:
            if piece.size != want:
                raise ValueError(f"shared-memory region of {piece.size} bytes, expected {want}")
            whole = start == self._first and count == self._n - self._first
            if whole and self._upload is not None and self._upload.budget.take(want):
                try:
                    self._kv = self._uploaded(piece, want)
                except torch.OutOfMemoryError:  # the device is full after all: via the host
                    pass
                else:
                    self._filled += count
                    return
            dest = self.kv if whole else torch.empty(self._shape.dims(count),
                                                     dtype=self._shape.dtype)
            raw = _raw(dest)
            kv_shm.read_private(self._shm_dir, piece.shm_name, piece.shm_offset,
                                memoryview(raw))
            self._verify(raw, piece)
            if not whole:
                self.kv[:, :, :, at:at + count, :].copy_(dest)
            self._filled += count
            return
        if len(piece.data) != want:
            raise ValueError(f"KV piece of {count} tokens has {len(piece.data)} bytes, "
                             f"expected {want}")
        self._verify(piece.data, piece)
        with warnings.catch_warnings():
            # a read-only bytes object: we only copy out of it
            warnings.simplefilter("ignore", UserWarning)
            part = torch.frombuffer(piece.data, dtype=torch.uint8)
        self.kv[:, :, :, at:at + count, :].copy_(
            part.view(self._shape.dtype).view(self._shape.dims(count)))
        self._filled += count

    def _copied(self, piece: KVPiece, want: int) -> torch.Tensor:
        """A same-device piece copied device to device into a tensor of this
        process (to the host past the device budget), the mapping closed, then
        the copy verified against its device digest: what was verified is what
        is adopted, and prefill's staging copy is no longer needed."""
        assert piece.ipc is not None
        up = self._upload
        if up is None or up.device.type != "cuda":
            raise IpcUnusable("no CUDA device here for a same-device piece")
        dims = self._shape.dims(self._n - self._first)
        on_device = up.budget.take(want)
        dest: torch.Tensor | None = None
        try:
            with CAPTURE.copy():        # mapping, allocation and digest: no capture meanwhile
                try:
                    src = kv_ipc.open_shared(piece.ipc, up.device, self._shape.dtype, dims)
                except RuntimeError as exc:
                    kv_ipc.release_unopened(piece.ipc, up.device)
                    raise IpcUnusable(f"cannot map the same-device handle: {exc}") from exc
                try:
                    if on_device:
                        dest = up.budget.hold(torch.empty(dims, dtype=self._shape.dtype,
                                                          device=up.device), want)
                    else:
                        dest = torch.empty(dims, dtype=self._shape.dtype, pin_memory=True)
                    stream = torch.cuda.Stream(up.device)
                    with torch.cuda.stream(stream):
                        dest.copy_(src, non_blocking=True)
                    stream.synchronize()
                finally:
                    del src             # closes the mapping: prefill may free its copy
                digest = kv_ipc.device_digest(dest, self._seed)
        except BaseException:
            if on_device and dest is None:
                up.budget.give(want)
            raise
        if not piece.checksum or digest != piece.checksum:
            raise KVIntegrityError(
                f"KV piece [{piece.start_token}, {piece.start_token + piece.token_count}) from "
                "the same-device handle does not match its digest")
        return dest

    def _uploaded(self, piece: KVPiece, want: int) -> torch.Tensor:
        """The whole file on the device, verified (``want`` bytes of budget taken:
        the tensor gives them back when it goes, adopted or not)."""
        assert self._upload is not None
        up = self._upload
        dest: torch.Tensor | None = None
        try:
            fd = kv_shm.open_private(self._shm_dir, piece.shm_name)
            try:
                if piece.shm_offset < 0 or os.fstat(fd).st_size < piece.shm_offset + want:
                    raise ValueError(f"shared-memory file {piece.shm_name} is shorter than "
                                     f"{want} bytes from {piece.shm_offset}")
                with CAPTURE.copy():        # the allocation too: no graph capture meanwhile
                    dest = up.budget.hold(torch.empty(self._shape.dims(self._n - self._first),
                                                      dtype=self._shape.dtype,
                                                      device=up.device), want)
                    digest = upload_file(fd, piece.shm_offset, dest, up.chunks, self._seed)
            finally:
                os.close(fd)
        except BaseException:
            if dest is None:                # no tensor will give the budget back
                up.budget.give(want)
            raise
        if not piece.checksum or digest != piece.checksum:
            raise KVIntegrityError(
                f"KV piece [{piece.start_token}, {piece.start_token + piece.token_count}) from "
                f"the file {piece.shm_name} does not match its checksum")
        return dest

    def _verify(self, data: object, piece: KVPiece) -> None:
        if not piece.checksum or kv_shm.piece_checksum(data, self._seed) != piece.checksum:
            where = f"file {piece.shm_name}" if piece.shm_name else "stream"
            raise KVIntegrityError(
                f"KV piece [{piece.start_token}, {piece.start_token + piece.token_count}) from "
                f"the {where} does not match its checksum")

    def shm_usable(self, name: str) -> bool:
        return kv_shm.usable(self._shm_dir, name)

    def done(self) -> torch.Tensor:
        if self._filled != self._n:
            raise ValueError(f"KV pull ended after {self._filled} of {self._n} tokens")
        return self.kv
