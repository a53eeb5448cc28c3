"""Staged copies of a prompt's KV between the GPU and host memory, for the
prefill -> decode hand-off (issue 18, run 7: 0.34 GB/s a pull on the H200).

Each side of a hand-off moved the whole prompt through freshly allocated,
pageable host memory: prefill's ``.cpu()`` of the gathered KV, then a write of
it into the /dev/shm file; decode's read of the file into a fresh tensor, then
``.to(device)`` on its engine thread. Pageable copies go through the driver's
own bounce buffer at a fraction of DMA speed, and every fresh page is faulted
in (and zeroed) by the kernel first.

Here a copy runs in chunks through a few page-locked buffers that live as long
as the process (``PinnedChunks``, allocated once: pinning per pull was tried in
run 8 and is suspected of stalling the stack), on a side stream, so the DMA of
one chunk overlaps the host copy of the other:

* ``export_rows``: pool rows -> device gather -> pinned -> the destination
  host tensor (prefill: a mapping of the hand-off file itself, so the file is
  written by that one copy);
* ``upload_file``: file -> pinned (one ``preadv``, the checksum taken over the
  pinned bytes as they arrive) -> the device tensor decode adopts. The bytes
  that were verified are the bytes that were copied: the pinned chunk is this
  process's private memory and is not reused before its DMA completed.

On CPU (tests, dry runs) the same loops run with ordinary buffers.
"""

from __future__ import annotations

import os
import queue
import threading
import weakref
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import xxhash

CHUNK_BYTES = 32 << 20      # a DMA this size runs near the link's speed, two fit any L3


class CaptureGuard:
    """CUDA graph captures against the staged copies of other threads.

    A capture (torch's default, global error mode) fails if any thread of the
    process makes a capture-unsafe CUDA call meanwhile (an allocation, a
    stream or event sync), and a failed capture leaves the graph pool
    recording: every later capture and decode step fails (seen on the H200
    in this change's first stack run). So a staged copy runs inside
    ``copy()`` (many at once), a capture inside ``capture()``, which waits
    for the copies in progress and holds new ones back. Not re-entrant."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._copies = 0
        self._captures = 0

    @contextmanager
    def copy(self) -> Iterator[None]:
        with self._cond:
            self._cond.wait_for(lambda: self._captures == 0)
            self._copies += 1
        try:
            yield
        finally:
            with self._cond:
                self._copies -= 1
                self._cond.notify_all()

    @contextmanager
    def capture(self) -> Iterator[None]:
        with self._cond:
            self._captures += 1             # new copies wait from here
            self._cond.wait_for(lambda: self._copies == 0)
        try:
            yield
        finally:
            with self._cond:
                self._captures -= 1
                self._cond.notify_all()


CAPTURE = CaptureGuard()                # one per process: graphs and copies share the device


class PinnedChunks:
    """``sets`` pairs of ``chunk_bytes`` host buffers (page-locked on CUDA),
    made on first use and kept; a copy takes one pair for its duration."""

    def __init__(self, *, sets: int, chunk_bytes: int = CHUNK_BYTES, pin: bool) -> None:
        if sets < 1 or chunk_bytes < 1:
            raise ValueError(f"need sets >= 1 and chunk_bytes >= 1, got {sets}, {chunk_bytes}")
        self.chunk_bytes = chunk_bytes
        self._sets = sets
        self._pin = pin
        self._free: queue.SimpleQueue[tuple[torch.Tensor, torch.Tensor]] = queue.SimpleQueue()
        self._made = 0
        self._lock = threading.Lock()

    @contextmanager
    def take(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """A pair of uint8 buffers; blocks while every pair is in use."""
        with self._lock:
            make = self._made < self._sets
            self._made += make
        pair = self._new() if make else self._free.get()
        try:
            yield pair
        finally:
            self._free.put(pair)

    def _new(self) -> tuple[torch.Tensor, torch.Tensor]:
        return (torch.empty(self.chunk_bytes, dtype=torch.uint8, pin_memory=self._pin),
                torch.empty(self.chunk_bytes, dtype=torch.uint8, pin_memory=self._pin))


def _stream(device: torch.device) -> torch.cuda.Stream | None:
    return torch.cuda.Stream(device) if device.type == "cuda" else None


def _event(stream: torch.cuda.Stream | None) -> torch.cuda.Event | None:
    if stream is None:
        return None
    ev = torch.cuda.Event()
    ev.record(stream)
    return ev


def export_rows(rows: torch.Tensor, slots: torch.Tensor, out: torch.Tensor,
                chunks: PinnedChunks) -> torch.Tensor:
    """``out[r] = rows[r].index_select(0, slots)`` for every row: ``rows`` is
    the pool as ``[R, slots, D]`` (one row per layer, K/V and head), ``out`` a
    contiguous host tensor of ``[R, n, D]``. Groups of rows go through the
    pinned pair in turn; one group's DMA overlaps the previous one's host copy.

    The caller guarantees the slots' KV is written and stays (a finished,
    claimed sequence: its last token was read on the host after the writes)."""
    R, n, D = out.shape
    row_bytes = n * D * out.element_size()
    group = max(1, chunks.chunk_bytes // max(1, row_bytes))
    if row_bytes > chunks.chunk_bytes:          # one row alone overflows a chunk
        out.copy_(rows.index_select(1, slots.to(rows.device)))
        return out
    stream = _stream(rows.device)
    with chunks.take() as pair, torch.cuda.stream(stream) if stream else _nothing():
        slots = slots.to(rows.device)       # on this stream: ordered before the gathers
        pending: tuple[torch.Tensor, torch.cuda.Event | None, int, int] | None = None
        for k, r0 in enumerate(range(0, R, group)):
            r1 = min(R, r0 + group)
            part = rows[r0:r1].index_select(1, slots)
            buf = pair[k % 2][:part.numel() * part.element_size()].view(part.dtype)
            buf = buf.view(part.shape)
            buf.copy_(part, non_blocking=stream is not None)
            done = _event(stream)
            if pending is not None:
                _land(out, *pending)
            pending = (buf, done, r0, r1)
        if pending is not None:
            _land(out, *pending)
    return out


def _land(out: torch.Tensor, buf: torch.Tensor, done: torch.cuda.Event | None,
          r0: int, r1: int) -> None:
    if done is not None:
        done.synchronize()
    out[r0:r1].copy_(buf)


@contextmanager
def _nothing() -> Iterator[None]:
    yield


def upload_file(fd: int, offset: int, dest: torch.Tensor, chunks: PinnedChunks,
                seed: int) -> bytes:
    """Read ``dest``'s size in bytes from ``fd`` at ``offset`` into ``dest``
    (contiguous, any device) through the pinned pair; returns the xxh3-128
    of the bytes read, seeded with ``seed`` (service.kv_shm.piece_checksum
    of the whole range). Raises ValueError when the file is short."""
    flat = dest.view(-1).view(torch.uint8)
    total = flat.numel()
    digest = xxhash.xxh3_128(seed=seed)
    stream = _stream(dest.device)
    with chunks.take() as pair, torch.cuda.stream(stream) if stream else _nothing():
        busy: list[torch.cuda.Event | None] = [None, None]
        pos = 0
        for k in range(-(-total // chunks.chunk_bytes)):
            size = min(chunks.chunk_bytes, total - pos)
            buf = pair[k % 2]
            if busy[k % 2] is not None:
                busy[k % 2].synchronize()       # its last DMA is done: refill it
            view = memoryview(buf.numpy())[:size]
            got = 0
            while got < size:
                n = os.preadv(fd, [view[got:]], offset + pos + got)
                if n <= 0:
                    raise ValueError(f"hand-off file is short at byte {offset + pos + got}")
                got += n
            digest.update(view)
            flat[pos:pos + size].copy_(buf[:size], non_blocking=stream is not None)
            busy[k % 2] = _event(stream)
            pos += size
        for ev in busy:
            if ev is not None:
                ev.synchronize()
    return digest.digest()


class DeviceBudget:
    """Bytes of device memory that pulled KV may hold between its pull and
    its adopt (outside the engine's capped pool); past it a pull lands on the
    host as before and the adopt uploads it."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._used = 0
        self._lock = threading.Lock()

    @property
    def used(self) -> int:
        return self._used

    def take(self, nbytes: int) -> bool:
        with self._lock:
            if self._used + nbytes > self.max_bytes:
                return False
            self._used += nbytes
            return True

    def hold(self, t: torch.Tensor, nbytes: int) -> torch.Tensor:
        """Give ``nbytes`` back once ``t`` is garbage (adopted, or dropped on any
        path: a pull whose request went away cannot leak the budget)."""
        weakref.finalize(t, self.give, nbytes)
        return t

    def give(self, nbytes: int) -> None:
        """Bytes taken but never held by a tensor (its allocation failed)."""
        with self._lock:
            self._used -= nbytes


class HostCopy:
    """A device tensor on its way to page-locked host memory, copied by a
    thread other than the engine's.

    ``start`` runs on the engine thread right after the work that fills the
    tensor was queued (a gather of a finished sequence's blocks): it only
    records an event on the current stream. ``wait`` (any other thread) makes
    a side stream wait for that event, copies into pinned memory there and
    waits for that copy alone. The engine thread never waits for the copy nor
    for the stream work queued before it: ``KVStorage.export`` synchronized the
    whole stream on the engine thread, and the decode steps queued behind
    every answer's canonical export (issue 18, run 14: each answer's end held
    1.55 s, steps waited 2.5 ms each on other engine jobs).

    The source stays referenced until the copy is done, so its device memory
    is not handed to later work while the side stream still reads it. On CPU
    the tensor is already on the host: ``wait`` returns it."""

    __slots__ = ("_ready", "_src")

    def __init__(self, src: torch.Tensor, ready: torch.cuda.Event | None) -> None:
        self._src: torch.Tensor | None = src
        self._ready = ready

    @classmethod
    def start(cls, src: torch.Tensor) -> HostCopy:
        if src.device.type != "cuda":
            return cls(src, None)
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(src.device))
        return cls(src, ready)

    @classmethod
    def within(cls, src: torch.Tensor, budget: DeviceBudget) -> HostCopy:
        """``start``, while ``budget`` holds the device tensor until it is garbage;
        past the budget the copy is made here, on the calling thread, as before:
        gathers that end together (a batch's answers, a burst's prompts) would each
        hold their device memory until copied."""
        copy = cls.start(src)
        if src.device.type == "cpu":
            return copy
        if budget.take(copy.nbytes):
            budget.hold(src, copy.nbytes)
            return copy
        return cls.start(copy.wait())

    @property
    def nbytes(self) -> int:
        src = self._src
        return 0 if src is None else src.numel() * src.element_size()

    def wait(self) -> torch.Tensor:
        """The tensor on the host (pinned on CUDA). Once only."""
        src, self._src = self._src, None
        if src is None:
            raise RuntimeError("HostCopy.wait called twice")
        if self._ready is None:
            return src
        stream = _side_stream(src.device)
        with CAPTURE.copy(), torch.cuda.stream(stream):
            stream.wait_event(self._ready)
            out = torch.empty(src.shape, dtype=src.dtype, pin_memory=True)
            out.copy_(src, non_blocking=True)
            done = torch.cuda.Event()
            done.record(stream)
            done.synchronize()      # this copy only, not others queued on the side stream
        return out


_SIDE: dict[torch.device, torch.cuda.Stream] = {}
_SIDE_LOCK = threading.Lock()


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    """One side stream per device for host copies (made once: a stream per
    copy would cost a driver call each)."""
    with _SIDE_LOCK:
        if device not in _SIDE:
            _SIDE[device] = torch.cuda.Stream(device)
        return _SIDE[device]
