"""engine/draw.py's draw on CUDA: every row of a step in one launch.

Each program takes one range of one row's vocabulary and keeps the first
largest score of it; a second launch picks, per row, the first range with the
largest. The logits are read in their own dtype (bf16 from a decode graph) and
widened in registers: the same fp32 values as a widened copy, without the copy.
Scores are element-wise and the max is exact, so how the vocabulary is split
(which follows the batch size, to fill the GPU) never changes a row's token. The
hash is engine/draw.py's, in uint32 arithmetic.

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
def _draw_kernel(X, s_x, T, s_t, CUT, s_cut, WORDS, s_w, VALS, IDX, vocab, per_split,
                 BLOCK: tl.constexpr):
    row = tl.program_id(0)
    sp = tl.program_id(1)
    # the per-row inputs in whatever dtype they came (fp32 / int64, or the packed
    # fp64 rows of engine/draw.py): every value is exact in fp64
    t = tl.load(T + row * s_t).to(tl.float32)
    cut = tl.load(CUT + row * s_cut).to(tl.float32)
    k0 = tl.load(WORDS + row * s_w).to(tl.int64).to(tl.uint32)       # words < 2**32
    k1 = tl.load(WORDS + row * s_w + 1).to(tl.int64).to(tl.uint32)
    lo = sp * per_split
    hi = tl.minimum(lo + per_split, vocab)
    best = tl.full([], float("-inf"), tl.float32)
    best_i = lo.to(tl.int64)
    if t == 0.0:
        # greedy: the first largest logit, no noise to compute
        for start in range(lo, hi, BLOCK):
            j = start + tl.arange(0, BLOCK)
            ok = j < hi
            x = tl.load(X + row * s_x + j, mask=ok, other=float("-inf")).to(tl.float32)
            score = tl.where(ok & (x >= cut) & (x == x), x, float("-inf"))
            m = tl.max(score, 0)
            i = tl.argmax(score, 0, tie_break_left=True)
            take = m > best
            best_i = tl.where(take, start + i.to(tl.int64), best_i)
            best = tl.where(take, m, best)
    else:
        for start in range(lo, hi, BLOCK):
            j = start + tl.arange(0, BLOCK)
            ok = j < hi
            x = tl.load(X + row * s_x + j, mask=ok, other=float("-inf")).to(tl.float32)
            h = _mix32(_mix32(j.to(tl.uint32) ^ k0) + k1)
            # engine.draw.unit_open: the top 23 bits, so k + 0.5 is exact and u < 1
            u = ((h >> 9).to(tl.float32) + 0.5) * 1.1920928955078125e-07      # 2**-23
            g = -tl.log(-tl.log(u))
            score = x / t + g
            score = tl.where(ok & (x >= cut) & (score == score), score, float("-inf"))
            m = tl.max(score, 0)
            i = tl.argmax(score, 0, tie_break_left=True)
            take = m > best
            best_i = tl.where(take, start + i.to(tl.int64), best_i)
            best = tl.where(take, m, best)
    tl.store(VALS + row * tl.num_programs(1) + sp, best)
    tl.store(IDX + row * tl.num_programs(1) + sp, best_i)


@triton.jit
def _pick_kernel(VALS, IDX, OUT, splits, SP: tl.constexpr):
    # one row: the first range holding the row's largest score (torch.argmax's
    # first maximum), one launch instead of an argmax and a gather
    row = tl.program_id(0)
    s = tl.arange(0, SP)
    v = tl.load(VALS + row * splits + s, mask=s < splits, other=float("-inf"))
    first = tl.argmax(v, 0, tie_break_left=True)
    tl.store(OUT + row, tl.load(IDX + row * splits + first))


def splits_for(rows: int, vocab: int, sms: int) -> int:
    """Vocabulary ranges per row: about two programs per SM, each at least a block."""
    return max(1, min(-(-vocab // BLOCK), -(-2 * sms // rows)))


def draw(x: torch.Tensor, t: torch.Tensor, cut: torch.Tensor, words: torch.Tensor, *,
         fused: bool = True) -> torch.Tensor:
    """x: [n, V] logits in any float dtype (unit stride in V; read as fp32); t [n]
    (0: greedy); cut [n] (logits below it are out; -inf: none); words [n, 2] (the
    key's halves, unit stride). Per-row inputs may be strided views of any dtype
    that holds them exactly. -> [n] int64 token ids, on x's device.
    ``fused=False``: the ranges' pick in torch (argmax and gather), as before issue 21."""
    if x.stride(1) != 1:
        x = x.contiguous()
    if words.stride(1) != 1:
        words = words.contiguous()
    n, vocab = x.shape
    sms = torch.cuda.get_device_properties(x.device).multi_processor_count \
        if x.is_cuda else 4
    splits = splits_for(n, vocab, sms)
    per = -(-vocab // splits)
    per = -(-per // BLOCK) * BLOCK              # ranges start on a block
    splits = -(-vocab // per)
    vals = torch.empty(n, splits, dtype=torch.float32, device=x.device)
    idx = torch.empty(n, splits, dtype=torch.int64, device=x.device)
    _draw_kernel[(n, splits)](x, x.stride(0), t, t.stride(0), cut, cut.stride(0), words,
                              words.stride(0), vals, idx, vocab, per, BLOCK=BLOCK, num_warps=4)
    if splits == 1:
        return idx[:, 0]
    if not fused:
        first = torch.argmax(vals, dim=1, keepdim=True)     # the first range with the max
        return idx.gather(1, first).squeeze(1)
    out = torch.empty(n, dtype=torch.int64, device=x.device)
    _pick_kernel[(n,)](vals, idx, out, splits, SP=triton.next_power_of_2(splits), num_warps=1)
    return out
