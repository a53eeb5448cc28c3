"""A size-class allocator over one byte range (the G2 shared-memory arena).

Sizes round up to a class: 64-byte multiples below 4 KiB, 4 KiB pages above.
A deployment writes blocks of one layout, so nearly every request has the
same class and is served in O(1) from that class's free list (a freed slot is
reused as is). Other sizes take the smallest free extent that fits (best fit)
and split it; frees coalesce with their neighbours so mixed sizes do not
strand memory forever. The allocator holds offsets only, never the bytes.

Invariant: free extents never overlap or touch (touching ones are merged), and
``free_bytes + allocated bytes == size``.
"""

from __future__ import annotations

from bisect import bisect_left, insort
from collections import deque
from collections.abc import Callable

SMALL_GRAIN = 64
PAGE = 4096


def class_size(nbytes: int) -> int:
    """The slot size a payload of ``nbytes`` occupies."""
    if nbytes < 0:
        raise ValueError(f"size must be >= 0, got {nbytes}")
    grain = SMALL_GRAIN if nbytes < PAGE else PAGE
    return max(grain, -(-nbytes // grain) * grain)


class SizeClassArena:
    __slots__ = ("_bins", "_by_end", "_by_start", "_sizes", "free_bytes", "size")

    def __init__(self, size: int) -> None:
        if size < 0:
            raise ValueError(f"arena size must be >= 0, got {size}")
        self.size = size - size % SMALL_GRAIN
        self.free_bytes = 0
        self._by_start: dict[int, int] = {}         # free extent start -> length
        self._by_end: dict[int, int] = {}           # free extent end -> start
        self._bins: dict[int, dict[int, None]] = {}  # length -> starts (insertion-ordered set)
        self._sizes: list[int] = []                 # sorted lengths with a non-empty bin
        if self.size:
            self._add(0, self.size)

    def alloc(self, nbytes: int) -> int | None:
        """Offset of a slot of ``class_size(nbytes)`` bytes, or None when no extent fits."""
        need = class_size(nbytes)
        i = bisect_left(self._sizes, need)
        if i == len(self._sizes):
            return None
        length = self._sizes[i]
        start = next(iter(self._bins[length]))
        self._remove(start, length)
        if length > need:
            self._add(start + need, length - need)
        return start

    def free(self, start: int, nbytes: int) -> None:
        """Return a slot obtained from ``alloc(nbytes)``."""
        length = class_size(nbytes)
        if start < 0 or start + length > self.size or start in self._by_start:
            raise ValueError(f"free of a slot not allocated here: [{start}, {start + length})")
        prev_start = self._by_end.get(start)
        if prev_start is not None:
            prev_len = self._by_start[prev_start]
            self._remove(prev_start, prev_len)
            start, length = prev_start, length + prev_len
        next_len = self._by_start.get(start + length)
        if next_len is not None:
            self._remove(start + length, next_len)
            length += next_len
        self._add(start, length)

    def largest_free(self) -> int:
        return self._sizes[-1] if self._sizes else 0

    def _add(self, start: int, length: int) -> None:
        self._by_start[start] = length
        self._by_end[start + length] = start
        bin_ = self._bins.get(length)
        if bin_ is None:
            bin_ = self._bins[length] = {}
            insort(self._sizes, length)
        bin_[start] = None
        self.free_bytes += length

    def _remove(self, start: int, length: int) -> None:
        del self._by_start[start]
        del self._by_end[start + length]
        bin_ = self._bins[length]
        del bin_[start]
        if not bin_:
            del self._bins[length]
            self._sizes.pop(bisect_left(self._sizes, length))
        self.free_bytes -= length


class GraceArena:
    """A ``SizeClassArena`` whose freed slots wait ``grace_s`` before reuse.

    Same-host readers copy slots out of shared memory without a lock; a slot
    handed out at time t is guaranteed not to be rewritten before t + grace_s
    unless the arena runs out of space, in which case it reuses quarantined
    slots early and calls ``on_early_reuse`` *before* handing any of them out
    (the host tier bumps a generation counter readers check after copying).
    """

    __slots__ = ("_arena", "_quarantine", "early_reuses", "grace_s", "on_early_reuse")

    def __init__(self, size: int, grace_s: float, on_early_reuse: Callable[[], None]) -> None:
        if grace_s < 0:
            raise ValueError(f"grace_s must be >= 0, got {grace_s}")
        self._arena = SizeClassArena(size)
        self._quarantine: deque[tuple[float, int, int]] = deque()  # (freed_at, start, nbytes)
        self.grace_s = grace_s
        self.on_early_reuse = on_early_reuse
        self.early_reuses = 0

    @property
    def size(self) -> int:
        return self._arena.size

    def alloc(self, nbytes: int, now: float) -> int | None:
        self._drain(now - self.grace_s)
        start = self._arena.alloc(nbytes)
        if start is None and self._quarantine:
            self.early_reuses += 1
            self.on_early_reuse()
            self._drain(float("inf"))
            start = self._arena.alloc(nbytes)
        return start

    def free(self, start: int, nbytes: int, now: float) -> None:
        if self.grace_s == 0:
            self._arena.free(start, nbytes)
        else:
            self._quarantine.append((now, start, nbytes))

    def _drain(self, freed_before: float) -> None:
        q = self._quarantine
        while q and q[0][0] <= freed_before:
            _, start, nbytes = q.popleft()
            self._arena.free(start, nbytes)
