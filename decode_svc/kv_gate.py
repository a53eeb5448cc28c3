"""Decode admission: a batch slot *and* the KV blocks a sequence can grow to.

A sequence joins the batch only once it holds a slot and a reservation of
every block it may ever use (its prompt's, the tokens it may generate, the
canonical recomputation of its output: ``Engine.kv_blocks_for``). The sum of
reservations never exceeds the pool's capacity, so an admitted sequence never
meets a full pool mid-answer: ``decode_step`` allocates all-or-nothing for
the whole batch, and one sequence's missing block used to fail every
sequence in the step (PoolExhaustedError after tokens were streamed).

Capacity is what the pool can hand out when no sequence is live
(``BlockPool.num_free``: free blocks plus cached blocks nobody references,
which ``allocate`` evicts from G1 on demand), so a reservation counts only
blocks that cannot be reclaimed. Grants are FIFO: a large sequence at the
head is not overtaken forever by small ones behind it. The queue itself is
bounded by the service (``max_seqs + max_waiting`` calls taken), which
refuses beyond that with RESOURCE_EXHAUSTED before any work.
"""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass


class NeverFits(ValueError):
    """A sequence needs more KV blocks than the whole pool holds."""


@dataclass(slots=True)
class _Waiter:
    blocks: int
    granted: asyncio.Future[None]


class KVGate:
    """FIFO grants of (one slot, n blocks); runs on the event loop only."""

    def __init__(self, *, slots: int, blocks: int) -> None:
        if slots < 1 or blocks < 1:
            raise ValueError(f"slots and blocks must be >= 1, got {slots}, {blocks}")
        self.slots, self.capacity = slots, blocks
        self.slots_used = 0
        self.reserved = 0                  # blocks promised to admitted sequences
        self.waits_for_blocks_total = 0    # grants that had to wait while a slot was free
        self._queue: deque[_Waiter] = deque()

    @property
    def waiting(self) -> int:
        return len(self._queue)

    @property
    def unreserved(self) -> int:
        return self.capacity - self.reserved

    def check(self, blocks: int) -> None:
        if blocks > self.capacity:
            raise NeverFits(f"needs {blocks} KV blocks but the whole pool holds "
                            f"{self.capacity}")

    async def acquire(self, blocks: int, *, held: int = 0) -> None:
        """Wait for a slot and ``blocks`` blocks, ``held`` of them reserved
        already (``reserve_now``); a caller cancelled while waiting leaves the
        queue (or gives back a grant it had not seen yet), and gives back
        ``held`` either way, so the grant holds all ``blocks`` or none."""
        if not 0 <= held <= blocks:
            raise ValueError(f"held must be within 0..{blocks}, got {held}")
        try:
            await self._acquire(blocks - held)
        except BaseException:
            if held:
                self.release_blocks(held)
            raise

    async def _acquire(self, blocks: int) -> None:
        self.check(blocks)
        if not self._queue and self._fits(blocks):
            self._take(blocks)
            return
        if self.slots_used < self.slots:
            self.waits_for_blocks_total += 1
        waiter = _Waiter(blocks, asyncio.get_running_loop().create_future())
        self._queue.append(waiter)
        try:
            await waiter.granted
        except BaseException:
            if waiter.granted.done() and not waiter.granted.cancelled():
                self.release(blocks)       # granted just as the caller left
            else:
                if waiter in self._queue:  # not when _pump already dropped it
                    self._queue.remove(waiter)
                self._pump()               # it may have been the head holding others back
            raise

    def reserve_now(self, blocks: int) -> bool:
        """Reserve ``blocks`` at once, without a slot and ahead of the queue, or
        refuse (False): blocks a waiting call pins in the pool (decode's G1
        prefix of its prompt) must be counted before anything else is promised.
        They join that call's grant later (``acquire(..., held=blocks)``)."""
        if blocks < 0 or self.reserved + blocks > self.capacity:
            return False
        self.reserved += blocks
        return True

    def release_slot(self) -> None:
        self.slots_used -= 1
        assert self.slots_used >= 0, "slot released more often than taken"
        self._pump()

    def release_blocks(self, blocks: int) -> None:
        self.reserved -= blocks
        assert self.reserved >= 0, "KV blocks released more often than reserved"
        self._pump()

    def release(self, blocks: int) -> None:
        self.slots_used -= 1
        self.release_blocks(blocks)

    def _fits(self, blocks: int) -> bool:
        return self.slots_used < self.slots and self.reserved + blocks <= self.capacity

    def _take(self, blocks: int) -> None:
        self.slots_used += 1
        self.reserved += blocks

    def _pump(self) -> None:
        while self._queue and self._fits(self._queue[0].blocks):
            waiter = self._queue.popleft()
            if waiter.granted.done():      # its caller was cancelled and has not run yet
                continue
            self._take(waiter.blocks)
            waiter.granted.set_result(None)
