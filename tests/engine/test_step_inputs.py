"""engine/step_inputs.py on the CPU: what a decode bucket's inputs hold after
each step equals what the step asks for (live rows, padding on the scratch
block), through batches that grow blocks, shrink, reorder and reuse rows, and
the block table is sent only when a row's list changed."""

from __future__ import annotations

import pytest
import torch

from engine.step_inputs import StagedInputs

ROWS, MAX_BLOCKS, SCRATCH, BT = 8, 6, 99, 4


def _expect(ins: StagedInputs, pending: list[int], positions: list[int],
            blocks: list[list[int]]) -> None:
    n = len(pending)
    pad = ROWS - n
    assert ins.tokens.tolist() == pending + [0] * pad
    assert ins.positions.tolist() == positions + [0] * pad
    assert ins.slots.tolist() == [b[p // BT] * BT + p % BT for p, b in
                                  zip(positions, blocks, strict=True)] + [SCRATCH * BT] * pad
    assert ins.lens.tolist() == [p + 1 for p in positions] + [1] * pad
    assert ins.lens.dtype == torch.int32 and ins.tokens.dtype == torch.int64
    want = [b + [SCRATCH] * (MAX_BLOCKS - len(b)) for b in blocks] + [[SCRATCH] * MAX_BLOCKS] * pad
    assert ins.tables.tolist() == want


def test_inputs_follow_growing_shrinking_and_reordered_batches() -> None:
    ins = StagedInputs(ROWS, MAX_BLOCKS, SCRATCH, BT, torch.device("cpu"))
    _expect(ins, [], [], [])                               # all padding at the start
    a, b, c = [3, 7], [11], [20, 21, 22]
    a2, b2 = [*a, 40], [*b, 41]
    steps = [
        ([5, 6, 7], [6, 2, 9], [a, b, c], True),           # first step: every row new
        ([8, 9, 10], [7, 3, 10], [a, b, c], False),        # same lists: no table copy
        ([1, 2, 3], [8, 4, 11], [a2, b2, c], True),   # two rows grew a block
        ([4, 5], [9, 5], [a2, b2], True),      # row 2 left: back to scratch
        ([6, 7], [5, 9], [b2, a2], True),      # the rows swapped places
        ([6, 7], [5, 9], [b2, a2], False),
    ]
    for pending, positions, blocks, sent in steps:
        assert ins.stage(pending, positions, blocks) is sent, (pending, sent)
        _expect(ins, pending, positions, blocks)
    # a held list is a copy: the caller's list growing afterwards is a change
    grow = [50]
    assert ins.stage([1], [0], [grow]) is True
    grow.append(51)
    assert ins.stage([1], [4], [grow]) is True
    _expect(ins, [1], [4], [[50, 51]])
    # another writer of the table (main's rebuild): every row is sent again
    ins.tables.fill_(-7)
    ins.forget()
    assert ins.stage([1], [4], [grow]) is True
    _expect(ins, [1], [4], [[50, 51]])


def test_a_step_that_does_not_fit_the_bucket_is_refused() -> None:
    ins = StagedInputs(2, MAX_BLOCKS, SCRATCH, BT, torch.device("cpu"))
    with pytest.raises(ValueError, match="3 tokens"):
        ins.stage([1, 2, 3], [0, 0, 0], [[1], [2], [3]])
    with pytest.raises(ValueError, match="2 positions"):
        ins.stage([1], [0, 0], [[1]])
