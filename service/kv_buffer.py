"""Per-request host buffer of a prompt's KV, served to decode by PullKV, and
decode's side that places and verifies the pieces.

After prefill the whole prompt's KV (the partial last block included) is
copied out of the engine once and kept here until decode pulls and releases
it. The wire format of a piece is the raw bytes of
``[layers, 2, kv_heads, token_count, head_dim]`` in the engine dtype
(docs/engine.md): pieces are cut along the token axis so a reader can place
them into one preallocated tensor.

Lifetime: there is no expiry clock, since a backlogged decode is no reason to
throw finished work away. The buffer is bounded by bytes instead: a put that
needs room drops the oldest entries, and an entry nobody pulled for
``abandon_s`` (its router went away) is swept. Dropping is always safe
because decode can rebuild any prompt's KV (restore what the warehouse holds,
recompute the rest); a pull of a dropped handle says so and decode rebuilds.

Same-host pulls skip the byte stream: the buffer writes the tensor once into
a private file under ``/dev/shm`` (service.kv_shm: 0600, exclusive create, an
unguessable name) and the reader copies it out with one read. Every piece,
file or bytes, carries a checksum prefill took from its own memory, seeded
with the handle's secret ``kv_seed``; the assembler verifies it before the KV
goes anywhere, and a mismatch is a ``KVIntegrityError`` (decode recomputes).
"""

from __future__ import annotations

import os
import secrets
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from service import kv_shm
from service.errors import HandleExpired, InvalidRequest

# Dropped entries are remembered (without their tensors) for a while so that a
# late pull says why the KV is gone rather than "unknown".
_TOMBSTONE_S = 600.0
_MAX_TOMBSTONES = 65_536


class KVIntegrityError(ValueError):
    """A hand-off piece does not match the checksum prefill sent for it."""


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


@dataclass(slots=True)
class BufferEntry:
    request_id: str
    kv: torch.Tensor                # [layers, 2, kv_heads, n_tokens, head_dim], host, contiguous
    seed: int                       # the handle's kv_seed: keys the pieces' checksums
    put_at: float                   # buffer clock
    # start token -> (file name, checksum): the KV from that token on, written on first use
    shm: dict[int, tuple[str, bytes]] = field(default_factory=dict)

    @property
    def n_tokens(self) -> int:
        return int(self.kv.shape[3])

    @property
    def nbytes(self) -> int:
        return self.kv.numel() * self.kv.element_size()


@dataclass(frozen=True, slots=True)
class BufferStats:
    entries: int
    bytes: int
    released: int
    evicted: int                    # dropped to make room (decode rebuilds them)
    abandoned: int                  # never pulled within abandon_s
    unbuffered: int                 # larger than the whole buffer: never held
    shm_files: int


def _raw(t: torch.Tensor) -> np.ndarray:
    """The bytes of a contiguous tensor as a uint8 array, without a copy."""
    return t.reshape(-1).view(torch.uint8).numpy()


class KVBuffer:
    def __init__(self, *, max_bytes: int, chunk_bytes: int, shm_dir: str = "",
                 abandon_s: float = 3600.0, clock: Callable[[], float] = time.monotonic,
                 names: Callable[[], str] = kv_shm.new_name) -> None:
        if abandon_s <= 0:
            raise ValueError(f"abandon_s must be > 0, got {abandon_s}")
        self._max_bytes = max_bytes
        self._chunk_bytes = chunk_bytes
        self._abandon_s = abandon_s
        usable = bool(shm_dir) and os.path.isdir(shm_dir) and os.access(shm_dir, os.W_OK)
        self._shm_dir = Path(shm_dir) if usable else None
        self._clock = clock
        self._names = names
        self._entries: dict[str, BufferEntry] = {}       # oldest first (insertion order)
        self._shm_lock = threading.Lock()
        self._gone: dict[str, tuple[float, str]] = {}    # request id -> (when, why)
        self._bytes = 0
        self._counts = {"released": 0, "evicted": 0, "abandoned": 0, "unbuffered": 0}

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
        kv = kv.detach().to("cpu").contiguous()
        KVShape.of(kv)
        nbytes = kv.numel() * kv.element_size()
        if request_id in self._entries:
            self._drop(request_id, "released")
        if nbytes > self._max_bytes:
            self._counts["unbuffered"] += 1
            self._remember(request_id, "larger than the whole buffer")
            return None
        while self._bytes + nbytes > self._max_bytes:
            self._drop(next(iter(self._entries)), "evicted")
        entry = BufferEntry(request_id, kv, seed, self._clock())
        self._entries[request_id] = entry
        self._gone.pop(request_id, None)
        self._bytes += nbytes
        return entry

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

    def pieces(self, entry: BufferEntry, first: int = 0) -> Iterator[KVPiece]:
        """The entry's KV from token ``first`` on, as byte pieces of about
        ``chunk_bytes`` each."""
        self.check_start(entry, first)
        step = max(1, self._chunk_bytes // KVShape.of(entry.kv).token_nbytes)
        for start in range(first, entry.n_tokens, step):
            end = min(entry.n_tokens, start + step)
            data = _raw(entry.kv[:, :, :, start:end, :].contiguous()).tobytes()
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
        with self._shm_lock:
            if first not in entry.shm:
                tail = entry.kv if first == 0 else entry.kv[:, :, :, first:, :].contiguous()
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
        """Drop entries nobody pulled within ``abandon_s``; returns how many."""
        now = self._clock()
        old = [rid for rid, e in self._entries.items() if now - e.put_at > self._abandon_s]
        for rid in old:
            self._drop(rid, "abandoned")
        for rid in [rid for rid, (t, _) in self._gone.items() if now - t > _TOMBSTONE_S]:
            del self._gone[rid]
        return len(old)

    def close(self) -> None:
        for rid in list(self._entries):
            self._drop(rid, "released")

    def stats(self) -> BufferStats:
        shm = sum(len(e.shm) for e in self._entries.values())
        c = self._counts
        return BufferStats(len(self._entries), self._bytes, c["released"], c["evicted"],
                           c["abandoned"], c["unbuffered"], shm)

    def _drop(self, request_id: str, why: str) -> None:
        entry = self._entries.pop(request_id)
        self._bytes -= entry.nbytes
        self._counts[why] += 1
        self._remember(request_id, {"evicted": "dropped for room; rebuild it",
                                    "abandoned": "never pulled; rebuild it"}.get(why, why))
        if self._shm_dir is not None:
            for name, _ in entry.shm.values():
                (self._shm_dir / name).unlink(missing_ok=True)

    def _remember(self, request_id: str, why: str) -> None:
        if len(self._gone) >= _MAX_TOMBSTONES:
            del self._gone[next(iter(self._gone))]
        self._gone[request_id] = (self._clock(), why)


class KVAssembler:
    """Decode side: verifies each piece against its checksum and places it into
    one ``[layers, 2, kv_heads, n, head_dim]`` tensor.

    Shared-memory bytes are copied into this process before they are checked,
    so what was verified is what is adopted (a mapping of the file could still
    change under the reader). A whole-prompt file is read straight into the
    result tensor: one copy, as the byte stream makes."""

    def __init__(self, shape: KVShape, n_tokens: int, *, seed: int,
                 shm_dir: str = "/dev/shm", first: int = 0) -> None:
        """Tokens [``first``, ``n_tokens``) of a prompt (decode holds the ones before)."""
        if not 0 <= first < n_tokens:
            raise ValueError(f"first token {first} is outside a prompt of {n_tokens} tokens")
        self._shape = shape
        self._n = n_tokens
        self._first = first
        self._seed = seed
        self._shm_dir = Path(shm_dir)
        self._kv: torch.Tensor | None = None
        self._filled = first

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
        if piece.shm_name:
            if piece.size != want:
                raise ValueError(f"shared-memory region of {piece.size} bytes, expected {want}")
            whole = start == self._first and count == self._n - self._first
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
