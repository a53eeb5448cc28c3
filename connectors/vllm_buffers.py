"""Reused host buffers for the connector's loads and saves.

A warm request moves tens of MB per step (SmolLM2: 23 blocks x 2.9 MB). A
fresh ``torch.empty`` of that size is a fresh mmap: the first write into it
takes a page fault and a zero-fill per 4 KiB page, which on these machines
cost as much as the copy itself. So buffers are leased from a small pool and
given back: pages are faulted once per buffer's life (``prefault``), and on
CUDA they are pinned once (``cudaHostAlloc`` is slow; a pinned buffer is what
makes the host-to-device copies asynchronous).

A lease is a view ``[n, layers, *block]`` of a buffer with room for at least
``n`` blocks; capacities are powers of two so a few buffers serve all sizes.
At most ``keep`` idle buffers are kept (the smallest are dropped first: a large
one serves every size), so the pool is bounded by what concurrent steps used.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

MIN_BLOCKS = 8


@dataclass(slots=True)
class Lease:
    base: torch.Tensor          # [capacity, layers, *block]
    view: torch.Tensor          # base[:n]


class HostBuffers:
    def __init__(self, block_shape: tuple[int, ...], dtype: torch.dtype, *, pinned: bool,
                 keep: int = 4) -> None:
        self.block_shape = block_shape          # (layers, *one layer's block)
        self.dtype = dtype
        self.pinned = pinned
        self.keep = keep
        self._free: list[torch.Tensor] = []
        self._lock = threading.Lock()
        self.allocated = 0                      # buffers made (tests, stats)

    def take(self, n: int) -> Lease:
        if n < 1:
            raise ValueError(f"a lease needs at least one block, got {n}")
        with self._lock:
            # By position, never list.remove: tensors compare element-wise.
            fits = [i for i, b in enumerate(self._free) if b.shape[0] >= n]
            if fits:
                base = self._free.pop(min(fits, key=lambda i: self._free[i].shape[0]))
                return Lease(base, base[:n])
        cap = max(MIN_BLOCKS, 1 << (n - 1).bit_length())
        base = torch.empty((cap, *self.block_shape), dtype=self.dtype, pin_memory=self.pinned)
        if not self.pinned:
            base.view(-1).view(torch.uint8).zero_()   # prefault: pages mapped once, now
        self.allocated += 1
        return Lease(base, base[:n])

    def give(self, lease: Lease) -> None:
        with self._lock:
            self._free.append(lease.base)
            if len(self._free) > self.keep:
                self._free.pop(min(range(len(self._free)), key=lambda i: self._free[i].shape[0]))

    @property
    def idle(self) -> int:
        with self._lock:
            return len(self._free)
