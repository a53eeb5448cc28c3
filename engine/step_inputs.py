"""A CUDA decode bucket's per-step inputs, written on the host and sent in at
most two asynchronous copies from pinned memory (issue 21).

Between two graph replays the device waits for the host: the tokens come back,
then the next step's inputs are built and sent before the replay starts. On
main that was a fresh ``[b, max_blocks]`` block table filled row by row (512
blocks a row for a 32k context, 128 KiB at b64), one pageable copy for it, one
for the per-row integers and four device copies out of that. Here the per-row
integers (tokens, positions, write slots, key counts) live in one byte buffer
whose views are the bucket's static inputs, so one copy refreshes them all; the
block table keeps, per row, the block list it was last given and is written
and sent only when a row's list changed (a new block, another sequence).

The decode runner builds these on CUDA only (pinned host buffers, an event
guarding their reuse); on a CPU device the same code runs with plain memory and
synchronous copies, which is how the CPU tests check what it sends.
"""

from __future__ import annotations

import numpy as np
import torch


class StagedInputs:
    """Pinned host copies of a bucket's inputs and the device tensors they fill.

    ``tokens``, ``positions``, ``slots`` (int64) and ``lens`` (int32) are views
    of one device byte buffer; ``tables`` is the ``[b, max_blocks]`` int32 block
    table. A captured graph reads these tensors, so they are never replaced."""

    def __init__(self, rows: int, max_blocks: int, scratch: int, block_tokens: int,
                 device: torch.device) -> None:
        self.rows, self.scratch, self.block_tokens = rows, scratch, block_tokens
        cuda = device.type == "cuda"
        nbytes = 8 * 3 * rows + 4 * rows
        self._dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
        self._host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=cuda)
        i64 = 8 * 3 * rows
        words = self._dev[:i64].view(torch.int64).view(3, rows)
        self.tokens, self.positions, self.slots = words[0], words[1], words[2]
        self.lens = self._dev[i64:].view(torch.int32)
        host = self._host.numpy()
        self._ints = host[:i64].view(np.int64).reshape(3, rows)
        self._lens = host[i64:].view(np.int32)
        self.tables = torch.full((rows, max_blocks), scratch, dtype=torch.int32, device=device)
        self._tables_host = torch.full((rows, max_blocks), scratch, dtype=torch.int32,
                                       pin_memory=cuda)
        self._table = self._tables_host.numpy()
        # the block list each table row holds (None: the scratch block only)
        self._held: list[list[int] | None] = [None] * rows
        self.table_sends = 0            # steps that sent the table (for tests and profiles)
        # the last copies out of the pinned buffers: rewritten only once these ran
        self._sent = torch.cuda.Event() if cuda else None
        self._pad(0)
        self._dev.copy_(self._host)

    def _pad(self, n: int) -> None:
        """Rows n.. of the integers: padding, which writes and reads the scratch block."""
        self._ints[0, n:] = 0
        self._ints[1, n:] = 0
        self._ints[2, n:] = self.scratch * self.block_tokens
        self._lens[n:] = 1

    def stage(self, pending: list[int], positions: list[int], blocks: list[list[int]]) -> bool:
        """Queue the copies of one step's inputs (``len(pending)`` <= rows live
        rows, the rest padding) on the current stream; True when the block
        table was sent too."""
        n, bt = len(pending), self.block_tokens
        if not n <= self.rows or not len(positions) == len(blocks) == n:
            raise ValueError(f"{n} tokens, {len(positions)} positions, {len(blocks)} block "
                             f"lists for a bucket of {self.rows} rows")
        # A no-op once the previous step's tokens were read (that waited for more).
        if self._sent is not None:
            self._sent.synchronize()
        ints = self._ints
        ints[0, :n] = pending
        ints[1, :n] = positions
        ints[2, :n] = [blk[p // bt] * bt + p % bt for p, blk in zip(positions, blocks, strict=True)]
        self._lens[:n] = ints[1, :n] + 1
        self._pad(n)
        changed = False
        for i, blk in enumerate(blocks):
            if self._held[i] != blk:
                self._table[i, :len(blk)] = blk
                self._table[i, len(blk):] = self.scratch
                self._held[i] = list(blk)
                changed = True
        for i in range(n, self.rows):
            if self._held[i] is not None:
                self._table[i] = self.scratch
                self._held[i] = None
                changed = True
        self._dev.copy_(self._host, non_blocking=True)
        if changed:
            self.tables.copy_(self._tables_host, non_blocking=True)
            self.table_sends += 1
        if self._sent is not None:
            self._sent.record()
        return changed

    def forget(self) -> None:
        """Something else wrote ``tables``: send every row again next step."""
        self._held = [[-1]] * self.rows
