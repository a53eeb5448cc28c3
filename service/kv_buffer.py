"""Per-request host buffer of a prompt's KV, served to decode by PullKV.

After prefill the whole prompt's KV (the partial last block included) is
copied out of the engine once and kept here until decode pulls and releases
it, or until it expires. The wire format of a piece is the raw bytes of
``[layers, 2, kv_heads, token_count, head_dim]`` in the engine dtype
(docs/engine.md): pieces are cut along the token axis so a reader can place
them into one preallocated tensor.

Same-host pulls skip the byte stream: the buffer writes the tensor once into
a file under ``/dev/shm`` (tmpfs, so page cache only) and the reader copies it
out with one read; the file goes away on release or expiry.
"""

from __future__ import annotations

import itertools
import mmap
import os
import re
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from service.errors import HandleExpired, InvalidRequest, Overloaded

_SHM_NAME = re.compile(r"^kvserve-kv-[0-9]+-[0-9]+$")
_counter = itertools.count()
_MAP_POPULATE = getattr(mmap, "MAP_POPULATE", 0)     # Linux; elsewhere pages fault in on use
# Expired entries are remembered (without their tensors) for a while so that a
# late pull says "expired" rather than "unknown".
_TOMBSTONE_S = 600.0


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
    region of a shared-memory file (``shm_name`` set, ``data`` empty)."""

    start_token: int
    token_count: int
    data: bytes = b""
    shm_name: str = ""
    shm_offset: int = 0
    size: int = 0


@dataclass(slots=True)
class BufferEntry:
    request_id: str
    kv: torch.Tensor                # [layers, 2, kv_heads, n_tokens, head_dim], host, contiguous
    expires_at: float               # unix seconds (it travels in the handle)
    shm_name: str = ""

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
    expired: int
    released: int
    shm_files: int


def _raw(t: torch.Tensor) -> np.ndarray:
    """The bytes of a contiguous tensor as a uint8 array, without a copy."""
    return t.reshape(-1).view(torch.uint8).numpy()


class KVBuffer:
    def __init__(self, *, ttl_s: float, max_bytes: int, chunk_bytes: int, shm_dir: str = "",
                 clock: Callable[[], float] = time.time) -> None:
        self._ttl_s = ttl_s
        self._max_bytes = max_bytes
        self._chunk_bytes = chunk_bytes
        usable = bool(shm_dir) and os.path.isdir(shm_dir) and os.access(shm_dir, os.W_OK)
        self._shm_dir = Path(shm_dir) if usable else None
        self._clock = clock
        self._entries: dict[str, BufferEntry] = {}
        self._shm_lock = threading.Lock()
        self._gone: dict[str, tuple[float, str]] = {}   # request id -> (when, "expired"/"released")
        self._bytes = 0
        self._expired = 0
        self._released = 0

    @property
    def shm_capable(self) -> bool:
        return self._shm_dir is not None

    @property
    def bytes(self) -> int:
        return self._bytes

    def expiry(self) -> float:
        """When an entry put now expires (unix seconds)."""
        return self._clock() + self._ttl_s

    def check_room(self, nbytes: int) -> None:
        """Raise Overloaded unless ``nbytes`` more would fit now (asked before
        the handle goes out, while the caller can still be told to retry)."""
        if self._bytes + nbytes > self._max_bytes:
            raise Overloaded(
                f"KV host buffer full: {self._bytes} of {self._max_bytes} bytes held, "
                f"request needs {nbytes}; retry after decode pulls pending handles")

    def put(self, request_id: str, kv: torch.Tensor, *,
            expires_at: float | None = None) -> BufferEntry:
        """Keep ``kv`` (moved to host if needed) for ``request_id``; replaces an
        entry of the same id. Raises Overloaded when the buffer is full.
        ``expires_at``: the expiry already promised in the handle."""
        self.sweep()
        kv = kv.detach().to("cpu").contiguous()
        KVShape.of(kv)
        nbytes = kv.numel() * kv.element_size()
        if request_id in self._entries:
            self._drop(request_id, "released")
        self.check_room(nbytes)
        entry = BufferEntry(request_id, kv, self.expiry() if expires_at is None else expires_at)
        self._entries[request_id] = entry
        self._gone.pop(request_id, None)
        self._bytes += nbytes
        return entry

    def get(self, request_id: str) -> BufferEntry:
        entry = self._entries.get(request_id)
        now = self._clock()
        if entry is not None and entry.expires_at <= now:
            self._drop(request_id, "expired")
            entry = None
        if entry is None:
            gone = self._gone.get(request_id)
            if gone is not None:
                raise HandleExpired(f"KV handle of request {request_id!r} is no longer "
                                    f"buffered here ({gone[1]})")
            raise HandleExpired(f"no KV buffered for request {request_id!r} on this prefill "
                                "instance (never prefilled here, or the instance restarted)")
        return entry

    def pieces(self, entry: BufferEntry) -> Iterator[KVPiece]:
        """The entry's KV as byte pieces of about ``chunk_bytes`` each."""
        step = max(1, self._chunk_bytes // KVShape.of(entry.kv).token_nbytes)
        for start in range(0, entry.n_tokens, step):
            end = min(entry.n_tokens, start + step)
            part = entry.kv[:, :, :, start:end, :].contiguous()
            yield KVPiece(start, end - start, data=_raw(part).tobytes())

    def shm_piece(self, entry: BufferEntry) -> KVPiece:
        """The whole entry as one shared-memory region (written on first use).
        Safe to call from a worker thread (the write is long: the event loop
        need not wait on it)."""
        if self._shm_dir is None:
            raise InvalidRequest("this prefill instance offers no shared-memory pulls")
        with self._shm_lock:
            if not entry.shm_name:
                name = f"kvserve-kv-{os.getpid()}-{next(_counter)}"
                path = self._shm_dir / name
                try:
                    with open(path, "wb") as f:
                        f.write(_raw(entry.kv).data)
                except OSError:
                    path.unlink(missing_ok=True)     # never leave a torn file behind
                    raise
                # Name first, then look: a drop after this line unlinks the file
                # itself, one before it is seen here.
                entry.shm_name = name
                if self._entries.get(entry.request_id) is not entry:
                    path.unlink(missing_ok=True)     # released or expired meanwhile
                    raise HandleExpired(f"KV handle of request {entry.request_id!r} was "
                                        "released while it was being pulled")
        return KVPiece(0, entry.n_tokens, shm_name=entry.shm_name, size=entry.nbytes)

    def release(self, request_id: str) -> bool:
        """Free a handle's KV; False when it was not held (or had expired)."""
        entry = self._entries.get(request_id)
        if entry is None:
            return False
        expired = entry.expires_at <= self._clock()
        self._drop(request_id, "expired" if expired else "released")
        return not expired

    def sweep(self) -> int:
        """Drop expired entries; returns how many."""
        now = self._clock()
        expired = [rid for rid, e in self._entries.items() if e.expires_at <= now]
        for rid in expired:
            self._drop(rid, "expired")
        for rid in [rid for rid, (t, _) in self._gone.items() if now - t > _TOMBSTONE_S]:
            del self._gone[rid]
        return len(expired)

    def close(self) -> None:
        for rid in list(self._entries):
            self._drop(rid, "released")

    def stats(self) -> BufferStats:
        shm = sum(1 for e in self._entries.values() if e.shm_name)
        return BufferStats(len(self._entries), self._bytes, self._expired, self._released, shm)

    def _drop(self, request_id: str, why: str) -> None:
        entry = self._entries.pop(request_id)
        self._bytes -= entry.nbytes
        if why == "expired":
            self._expired += 1
        else:
            self._released += 1
        self._gone[request_id] = (self._clock(), why)
        if entry.shm_name and self._shm_dir is not None:
            (self._shm_dir / entry.shm_name).unlink(missing_ok=True)


class KVAssembler:
    """Decode side: places pieces into one ``[layers, 2, kv_heads, n, head_dim]`` tensor.

    A shared-memory piece that holds the whole prompt is not copied at all:
    ``kv`` is then a private mapping of the file, read once by whoever
    consumes it (``Engine.adopt`` copies it into the KV cache). The mapping
    outlives the file's removal on Release."""

    def __init__(self, shape: KVShape, n_tokens: int, *, shm_dir: str = "/dev/shm") -> None:
        self._shape = shape
        self._n = n_tokens
        self._shm_dir = Path(shm_dir)
        self._kv: torch.Tensor | None = None
        self._filled = 0

    @property
    def kv(self) -> torch.Tensor:
        if self._kv is None:
            self._kv = torch.empty(self._shape.dims(self._n), dtype=self._shape.dtype)
        return self._kv

    def add(self, piece: KVPiece) -> None:
        start, count = piece.start_token, piece.token_count
        if start != self._filled or count <= 0 or start + count > self._n:
            raise ValueError(f"KV piece [{start}, {start + count}) out of order or out of range "
                             f"(have {self._filled} of {self._n} tokens)")
        want = count * self._shape.token_nbytes
        if piece.shm_name and start == 0 and count == self._n:
            raw = self._map_shm(piece, want)
            self._kv = raw.view(self._shape.dtype).view(self._shape.dims(count))
            self._filled = count
            return
        if piece.shm_name:
            raw = self._read_shm(piece, want)
        else:
            if len(piece.data) != want:
                raise ValueError(f"KV piece of {count} tokens has {len(piece.data)} bytes, "
                                 f"expected {want}")
            with warnings.catch_warnings():
                # a read-only bytes object: we only copy out of it
                warnings.simplefilter("ignore", UserWarning)
                raw = torch.frombuffer(piece.data, dtype=torch.uint8)
        part = raw.view(self._shape.dtype).view(self._shape.dims(count))
        self.kv[:, :, :, start:start + count, :].copy_(part)
        self._filled += count

    def _shm_path(self, piece: KVPiece, want: int) -> Path:
        if not _SHM_NAME.match(piece.shm_name):
            raise ValueError(f"bad shared-memory name {piece.shm_name!r}")
        if piece.size != want:
            raise ValueError(f"shared-memory region of {piece.size} bytes, expected {want}")
        if piece.shm_offset < 0:
            raise ValueError(f"shared-memory offset {piece.shm_offset} is negative")
        return self._shm_dir / piece.shm_name

    def _map_shm(self, piece: KVPiece, want: int) -> torch.Tensor:
        """The region as a copy-on-write mapping, its pages populated up front
        (one call instead of a fault per page on first read)."""
        path = self._shm_path(piece, want)
        end = piece.shm_offset + want
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size < end:
                raise ValueError(f"shared-memory file {path} is short: {size} of {end} bytes")
            mm = mmap.mmap(f.fileno(), end, flags=mmap.MAP_PRIVATE | _MAP_POPULATE,
                           prot=mmap.PROT_READ | mmap.PROT_WRITE)
        # frombuffer keeps ``mm`` alive as long as the tensor (and its views) are.
        return torch.frombuffer(mm, dtype=torch.uint8, count=want, offset=piece.shm_offset)

    def _read_shm(self, piece: KVPiece, want: int) -> torch.Tensor:
        path = self._shm_path(piece, want)
        arr = np.fromfile(path, dtype=np.uint8, count=want, offset=piece.shm_offset)
        if arr.size != want:
            raise ValueError(f"shared-memory file {path} is short: {arr.size} of {want} bytes")
        return torch.from_numpy(arr)

    def shm_visible(self, name: str) -> bool:
        return bool(_SHM_NAME.match(name)) and (self._shm_dir / name).exists()

    def done(self) -> torch.Tensor:
        if self._filled != self._n:
            raise ValueError(f"KV pull ended after {self._filled} of {self._n} tokens")
        return self.kv
