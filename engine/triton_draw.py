"""engine/draw.py's draw on CUDA: every row of a step in one launch.

Each program takes one range of one row's vocabulary and keeps the first
largest score of it; a few torch ops then pick, per row, the first range with
the largest. Scores are element-wise and the max is exact, so how the
vocabulary is split (which follows the batch size, to fill the GPU) never
changes a row's token. The hash is engine/draw.py's, in uint32 arithmetic.

Only imported on CUDA (or under ``TRITON_INTERPRET=1`` for CPU checks).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024


@triton.jit
def _mix32(x):
    x = x ^ (x >> 16)
    x = x * 0x7FEB352D
    x = x ^ (x >> 15)
    x = x * 0x846CA68B
    x = x ^ (x >> 16)
    return x


@triton.jit
def _draw_kernel(X, s_x, T, CUT, WORDS, VALS, IDX, vocab, per_split, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    sp = tl.program_id(1)
    t = tl.load(T + row)
    cut = tl.load(CUT + row)
    k0 = tl.load(WORDS + row * 2).to(tl.uint32)      # int64 words < 2**32
    k1 = tl.load(WORDS + row * 2 + 1).to(tl.uint32)
    greedy = t == 0.0
    inv = tl.where(greedy, 1.0, t)
    lo = sp * per_split
    hi = tl.minimum(lo + per_split, vocab)
    best = tl.full([], float("-inf"), tl.float32)
    best_i = lo.to(tl.int64)
    for start in range(lo, hi, BLOCK):
        j = start + tl.arange(0, BLOCK)
        ok = j < hi
        x = tl.load(X + row * s_x + j, mask=ok, other=float("-inf"))
        h = _mix32(_mix32(j.to(tl.uint32) ^ k0) + k1)
        u = ((h >> 8).to(tl.float32) + 0.5) * 5.9604644775390625e-08      # 2**-24
        g = -tl.log(-tl.log(u))
        score = tl.where(greedy, x, x / inv + g)
        score = tl.where(ok & (x >= cut) & (score == score), score, float("-inf"))
        m = tl.max(score, 0)
        i = tl.argmax(score, 0, tie_break_left=True)
        take = m > best
        best_i = tl.where(take, start + i.to(tl.int64), best_i)
        best = tl.where(take, m, best)
    tl.store(VALS + row * tl.num_programs(1) + sp, best)
    tl.store(IDX + row * tl.num_programs(1) + sp, best_i)


def splits_for(rows: int, vocab: int, sms: int) -> int:
    """Vocabulary ranges per row: about two programs per SM, each at least a block."""
    return max(1, min(-(-vocab // BLOCK), -(-2 * sms // rows)))


def draw(x: torch.Tensor, t: torch.Tensor, cut: torch.Tensor, words: torch.Tensor) -> torch.Tensor:
    """x: [n, V] fp32 (unit stride in V); t [n] fp32 (0: greedy); cut [n] fp32
    (logits below it are out; -inf: none); words [n, 2] int64 (the key's halves).
    -> [n] int64 token ids, on x's device."""
    if x.stride(1) != 1:
        x = x.contiguous()
    n, vocab = x.shape
    sms = torch.cuda.get_device_properties(x.device).multi_processor_count \
        if x.is_cuda else 4
    splits = splits_for(n, vocab, sms)
    per = -(-vocab // splits)
    per = -(-per // BLOCK) * BLOCK              # ranges start on a block
    splits = -(-vocab // per)
    vals = torch.empty(n, splits, dtype=torch.float32, device=x.device)
    idx = torch.empty(n, splits, dtype=torch.int64, device=x.device)
    _draw_kernel[(n, splits)](x, x.stride(0), t, cut, words.contiguous(), vals, idx, vocab, per,
                              BLOCK=BLOCK, num_warps=4)
    first = torch.argmax(vals, dim=1, keepdim=True)         # the first range with the max
    return idx.gather(1, first).squeeze(1)
