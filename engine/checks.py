"""Input checks of the engine's entry points: a prompt's token ids and a
block tensor's shape, each failing with an ``EngineInputError`` that names
the problem (services map it to INVALID_ARGUMENT in one place)."""

from __future__ import annotations

from collections.abc import Sequence as Seq

import numpy as np
import torch

from engine.config import ModelConfig
from engine.errors import EngineInputError
from engine.kv_pool import KVLayout
from engine.layer_restore import HostRuns


def check_prompt(tokens: Seq[int] | torch.Tensor, mc: ModelConfig) -> list[int]:
    """The prompt as ints: non-empty, in the vocabulary, leaving room to generate."""
    src = tokens.tolist() if isinstance(tokens, torch.Tensor) else tokens
    vocab = mc.vocab_size
    # One conversion and one range check in C: a Python loop of int() and range
    # tests over a 32k-token prompt (3.5-5.6 ms on a CPU) was the largest part
    # found of the 7-9 ms the host spent before a 99 %-restored prefill's first
    # copy on the H200 (benchmarks/ttft_profile.py), and the copy bounds that TTFT.
    try:
        arr = np.asarray(src, dtype=np.int64)
    except (OverflowError, TypeError, ValueError):
        arr = None                  # ids past int64 or odd entries: the loop names them
    if arr is not None and arr.ndim == 1:
        if not arr.size:
            raise EngineInputError("empty prompt: need at least one token")
        bad = (arr < 0) | (arr >= vocab)
        if bad.any():
            i = int(bad.argmax())
            raise EngineInputError(f"token id {int(arr[i])} at position {i} is outside the "
                                   f"vocabulary [0, {vocab})")
        toks: list[int] = arr.tolist()
    else:
        toks = [int(t) for t in src]
        if not toks:
            raise EngineInputError("empty prompt: need at least one token")
        for i, t in enumerate(toks):
            if not 0 <= t < vocab:
                raise EngineInputError(f"token id {t} at position {i} is outside the "
                                       f"vocabulary [0, {vocab})")
    ctx = mc.max_position
    if len(toks) >= ctx:
        raise EngineInputError(f"prompt of {len(toks)} tokens is too long: the context "
                               f"is {ctx} tokens (at most {ctx - 1} leave room to generate)")
    return toks


def check_blocks(blocks: torch.Tensor | HostRuns, layout: KVLayout, dtype: torch.dtype,
                 what: str) -> int:
    """Number of blocks in ``blocks`` ([n, *layout.block_shape], ``dtype``)."""
    want = layout.block_shape
    if isinstance(blocks, HostRuns):
        if blocks.block_shape != want or blocks.dtype != dtype:
            raise EngineInputError(f"{what} blocks are {blocks.block_shape} {blocks.dtype}; "
                                   f"expected [n, {', '.join(map(str, want))}] {dtype}")
        return blocks.n_blocks
    if (not isinstance(blocks, torch.Tensor) or blocks.dim() != 6
            or tuple(blocks.shape[1:]) != want or blocks.dtype != dtype):
        got = (f"{tuple(blocks.shape)} {blocks.dtype}" if isinstance(blocks, torch.Tensor)
               else type(blocks).__name__)
        raise EngineInputError(f"{what} blocks are {got}; expected "
                               f"[n, {', '.join(map(str, want))}] {dtype}")
    return int(blocks.shape[0])
