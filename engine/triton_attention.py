"""Batch-invariant attention on the GPU (Triton): one arithmetic for prefill
chunks, batched prefill (several sequences, any lengths) and decode rows, read
from the paged pool through each sequence's block table.

A row's result is defined by its keys alone, cut two ways at absolute
positions (never relative to a chunk, a tile of rows or a batch):

- key tiles of ``KEY_TILE`` keys: within a tile, one score per key (a dot over
  the head dimension), then an online-softmax step (running max, rescale, and
  two matrix-unit accumulations of the probabilities: x values and x ones, the
  latter the row sum, so no sum over keys is left to a layout's shuffle tree);
- splits of ``KEY_SPLIT`` keys: each split's tiles run from a fresh state
  (max -inf, sum 0, accumulator 0) and the split is then folded into the row's
  total, splits in ascending order, with explicit FMAs (``_fold``).

A prefill program (``PREFILL_ROWS`` rows: query tokens x the GQA group of one KV
head, so K/V are never repeated) walks all its splits itself. A decode program
(one token, the GQA group of one KV head) puts each tile's 64 keys on the
matrix instruction's row side and the group's few query heads on its narrow
side (with the group on the row side, 4 of 64 rows were live at GQA 4). With
one program a row it folds all the row's splits itself; with several
(``parts``, flash-decoding at small batch), a row of several splits has them
dealt round the programs, each split's own state goes to a slot of the
scratch, and a second kernel folds the slots in ascending order
(``_fold_splits``), while a row of one split is done by its first program
alone, as with one program a row (no scratch round trip: which way a row goes
follows from its own position and window, and both ways give its bits). The
transposed products are the same numbers: a matrix-unit output does not depend
on which operand side its inputs came from, and the only reduction over keys
left is a maximum. Both give the prefill bits: a split's state is the same
numbers wherever it is computed, and folding into the fresh state is exact
(0 x 0 + a x 1 = a), so the fold pass repeats the prefill's left fold
((fresh + A) + B) + C exactly. Only the order of the folds matters — a fold is
not associative ((A + B) + (C + D) is not ((A + B) + C) + D: programs that
folded their own shares of two splits broke decode rows' bits at batch 8 past
4k keys, found on the H200), which is why no program folds a share of splits
itself; the version before this one (same bits) let the first share take all
but one split a program, and a 32k-key row at 4 programs then cost one program
29 splits. So decode at batch 1 spreads a 32k context over the whole GPU and
still returns the bits a prefill of the same token would.

Tiles or splits a row cannot see (past its position, before its sliding window,
or beyond its own keys inside a shared tile) leave its state unchanged bit for
bit: scores -inf give ``alpha = exp2(m - m) = 1`` and ``p = 0``; a row with no
key yet subtracts 0 instead of -inf and stays at (-inf, 0, 0). The only trace
is the sign of an exactly-zero accumulator, folded by the final ``+ 0.0``.

Tiles every row of a program sees in full skip the mask (``MASK=False``): the
same numbers, fewer instructions. A decode program (``DECODE``, a
``DecodeSchedule``) may instead take all its tiles through the masked step in
one loop, so that Triton pipelines the whole split in one go, with each tile's
pool slots read a tile ahead so the copies run two tiles ahead of the
arithmetic: a schedule changes loads, never numbers. Prefill programs run longest first. Both
kernels compile with ``enable_fp_fusion=False``: with fusion on, the compiler
contracts ``dot * scale - m`` into an FMA in the unmasked path but not through
the masked path's ``where``, and which path a tile takes depends on the rows
sharing its program (seen on the H200: chunked prefill and decode rows differed
from a whole prefill). Every FMA that matters is written out (``tl.fma``).

Only imported on CUDA (or under ``TRITON_INTERPRET=1`` for CPU checks).
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence as Seq
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from engine import triton_pdl
from engine.triton_pdl import pdl_enter

KEY_TILE = 64                 # keys per tile
KEY_SPLIT = 1024              # keys per split (a multiple of KEY_TILE)
PREFILL_ROWS = 128            # rows per prefill program: 8 warps, 2 warpgroups along M
# A decode program puts the tile's 64 keys on the instruction's row side and the
# GQA group on its narrow side, padded to DECODE_COLS (Triton's narrowest dot
# operand), in one warpgroup.
DECODE_COLS = 16
LOG2E = 1.4426950408889634


@dataclass(frozen=True, slots=True)
class DecodeSchedule:
    """How a decode program loads and pipelines its key tiles; never what it
    computes (every schedule gives the same bits: tests/engine/test_gpu_interpreted.py
    and ``benchmarks.decode_attn`` check it). ``loop``: 0 ``_split_tiles`` (a
    masked and an unmasked loop a split), 1 one masked loop, 2 one masked loop
    with each tile's pool slots read a tile ahead (``_tiles_ahead``);
    ``stages``: Triton's pipeline stages; ``warps``; ``maxnreg``: a register
    cap (0: none). Written ``l0s2w4`` (``r128`` appended for a cap). The
    defaults are the shipped decode program's."""

    loop: int = 0
    stages: int = 2
    warps: int = 4
    maxnreg: int = 0

    def __post_init__(self) -> None:
        if self.loop not in (0, 1, 2) or not 1 <= self.stages <= 6 or self.warps not in (4, 8) \
                or not (self.maxnreg == 0 or 32 <= self.maxnreg <= 255):
            raise ValueError(f"bad decode schedule {self!r}")

    def __str__(self) -> str:
        return f"l{self.loop}s{self.stages}w{self.warps}" + (
            f"r{self.maxnreg}" if self.maxnreg else "")

    @classmethod
    def parse(cls, spec: str) -> DecodeSchedule:
        m = re.fullmatch(r"l(\d)s(\d)w(\d)(?:r(\d+))?", spec)
        if m is None:
            raise ValueError(f"decode schedule {spec!r} is not like l0s2w4 or l0s1w4r128")
        return cls(int(m[1]), int(m[2]), int(m[3]), int(m[4] or 0))


# The slots-ahead loop at three stages: Triton keeps K/V two tiles ahead (three
# 32 KB buffers, 104 KB of shared memory: two programs an SM) and waits for the
# oldest only, so a program's copies overlap its arithmetic (read in the TTGIR
# Triton 3.6 builds for sm_90: engine/triton_static.py). On the H200 at b64
# (benchmarks.decode_attn, 2026-12-03): 138.9 against 175.1 us a layer at
# 2,064 keys (3.90 against 3.09 TB/s), but 55.1 against 35.9 at 272 keys (two
# waves of two programs an SM where the shipped one fits 1.3 waves of three).
# Not shipped: slower at the benchmark's 256-key contexts.
AHEAD_DECODE = DecodeSchedule(loop=2, stages=3)
# Shipped: DecodeSchedule() (the K/V copies one stage ahead, each issued after
# the tile before's dots). KVSERVE_DECODE_ATTN=<spec> picks another (measurements).
DECODE = DecodeSchedule.parse(os.environ.get("KVSERVE_DECODE_ATTN", str(DecodeSchedule())))


def _prec(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"


@triton.jit
def _fold(m, lsum, acc, m2, l2, acc2):
    """State (m, l, acc) followed by state (m2, l2, acc2), in the exp2 domain."""
    m_new = tl.maximum(m, m2)
    m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m - m_sub)
    beta = tl.exp2(m2 - m_sub)
    lsum = tl.fma(lsum, alpha, l2 * beta)
    acc = tl.fma(acc, alpha[:, None], acc2 * beta[:, None])
    return m_new, lsum, acc


@triton.jit
def _tile_keys(kb, vb, TBL, t_off, kt, hi, block_tokens, D: tl.constexpr, BN: tl.constexpr,
               MASK: tl.constexpr):
    """Key tile ``kt`` (keys kt*BN .. kt*BN+BN-1, none past ``hi`` read): K, V [BN, D]."""
    k_pos = kt * BN + tl.arange(0, BN)
    d = tl.arange(0, D)
    if MASK:
        k_ok = k_pos <= hi
        blk = tl.load(TBL + t_off + k_pos // block_tokens, mask=k_ok, other=0).to(tl.int64)
        slot = blk * block_tokens + k_pos % block_tokens
        k = tl.load(kb + slot[:, None] * D + d[None, :], mask=k_ok[:, None], other=0.0)
        v = tl.load(vb + slot[:, None] * D + d[None, :], mask=k_ok[:, None], other=0.0)
    else:
        blk = tl.load(TBL + t_off + k_pos // block_tokens).to(tl.int64)
        slot = blk * block_tokens + k_pos % block_tokens
        k = tl.load(kb + slot[:, None] * D + d[None, :])
        v = tl.load(vb + slot[:, None] * D + d[None, :])
    return k_pos, k, v


@triton.jit
def _key_tile(q, m, lsum, acc, kb, vb, TBL, t_off, kt, q_pos, hi, window, qk_scale,
              block_tokens, D: tl.constexpr, BN: tl.constexpr, MASK: tl.constexpr,
              PREC: tl.constexpr):
    """One online-softmax step over key tile ``kt``, rows on the matrix
    instruction's row side. ``lsum`` is [R, 16], its 16 columns equal: the row
    sum of the tile's probabilities is a matrix-unit product with ones, so that
    ``_key_tile_t`` (keys on the row side) forms it from the same numbers in the
    same order; a ``tl.sum`` over keys would follow each layout's own tree."""
    k_pos, k, v = _tile_keys(kb, vb, TBL, t_off, kt, hi, block_tokens, D, BN, MASK)
    s = tl.dot(q, tl.trans(k), input_precision=PREC) * qk_scale        # [R, BN], log2 units
    if MASK:
        see = k_pos[None, :] <= q_pos[:, None]
        if window > 0:
            see &= k_pos[None, :] > q_pos[:, None] - window
        s = tl.where(see, s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, 1))
    m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m - m_sub)
    p = tl.exp2(s - m_sub[:, None]).to(v.dtype)
    ones = tl.full([BN, 16], 1.0, v.dtype)
    lsum = tl.dot(p, ones, lsum * alpha[:, None], input_precision=PREC)
    acc = tl.dot(p, v, acc * alpha[:, None], input_precision=PREC)
    return m_new, lsum, acc


@triton.jit
def _key_tile_t(qt, m, lsum_t, acc_t, kb, vb, TBL, t_off, kt, q_pos, window, qk_scale,
                block_tokens, D: tl.constexpr, BN: tl.constexpr, MASK: tl.constexpr,
                PREC: tl.constexpr):
    """``_key_tile`` for one decode token, transposed: the tile's keys on the
    instruction's 64-row side and the GQA group's few rows on its narrow side
    (``qt`` [D, NQ]), so a 4-head group no longer pays a 64-row instruction.
    Scores, probabilities and sums are the same numbers: a matrix-unit output
    does not depend on which operand side a number came from (checked on the
    H200 by the GEMM's weight-major plans and tests/engine/test_gpu_invariant.py),
    and maxima are exact in any order. ``lsum_t`` [BN, NQ] has equal rows."""
    k_pos, k, v = _tile_keys(kb, vb, TBL, t_off, kt, q_pos, block_tokens, D, BN, MASK)
    return _key_step_t(qt, m, lsum_t, acc_t, k_pos, k, v, q_pos, window, qk_scale, BN, MASK,
                       PREC)


@triton.jit
def _key_step_t(qt, m, lsum_t, acc_t, k_pos, k, v, q_pos, window, qk_scale, BN: tl.constexpr,
                MASK: tl.constexpr, PREC: tl.constexpr):
    """``_key_tile_t``'s arithmetic on a loaded tile (K, V [BN, D] at ``k_pos``)."""
    s = tl.dot(k, qt, input_precision=PREC) * qk_scale                 # [BN, NQ]
    if MASK:
        see = k_pos <= q_pos
        if window > 0:
            see &= k_pos > q_pos - window
        s = tl.where(see[:, None], s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, 0))
    m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m - m_sub)
    p = tl.exp2(s - m_sub[None, :]).to(v.dtype)
    ones = tl.full([BN, BN], 1.0, v.dtype)
    lsum_t = tl.dot(ones, p, lsum_t * alpha[None, :], input_precision=PREC)
    acc_t = tl.dot(tl.trans(v), p, acc_t * alpha[None, :], input_precision=PREC)
    return m_new, lsum_t, acc_t


@triton.jit
def _tiles(q, m, lsum, acc, kb, vb, TBL, t_off, a, b, q_pos, hi, window, qk_scale,
           block_tokens, D: tl.constexpr, BN: tl.constexpr, MASK: tl.constexpr,
           PREC: tl.constexpr, KEYS_MAJOR: tl.constexpr):
    for kt in range(a, b):
        if KEYS_MAJOR:
            m, lsum, acc = _key_tile_t(q, m, lsum, acc, kb, vb, TBL, t_off, kt, q_pos, window,
                                       qk_scale, block_tokens, D, BN, MASK, PREC)
        else:
            m, lsum, acc = _key_tile(q, m, lsum, acc, kb, vb, TBL, t_off, kt, q_pos, hi, window,
                                     qk_scale, block_tokens, D, BN, MASK, PREC)
    return m, lsum, acc


@triton.jit
def _tile_slots(TBL, t_off, kt, hi, block_tokens, BN: tl.constexpr):
    """Pool slots of key tile ``kt``'s keys (those past ``hi``: slot of block 0, never read)."""
    k_pos = kt * BN + tl.arange(0, BN)
    blk = tl.load(TBL + t_off + k_pos // block_tokens, mask=k_pos <= hi, other=0).to(tl.int64)
    return blk * block_tokens + k_pos % block_tokens


@triton.jit
def _tiles_ahead(qt, m, lsum, acc, kb, vb, TBL, t_off, a, b, q_pos, window, qk_scale,
                 block_tokens, D: tl.constexpr, BN: tl.constexpr, PREC: tl.constexpr):
    """Decode key tiles [a, b) in one loop, every tile through the masked step
    (a tile the row sees whole keeps every score: the same numbers as the
    unmasked step), each tile's pool slots read one tile ahead. Why: with the
    block-table read inside the tile, Triton's pipeliner (3.6, sm_90) keeps K/V
    one stage ahead and issues the next tile's copies after this tile's dots,
    so a program's copies never overlapped its arithmetic; and each of
    ``_split_tiles``' three loops drained and refilled its own pipeline."""
    d = tl.arange(0, D)
    slot = _tile_slots(TBL, t_off, a, q_pos, block_tokens, BN)
    for kt in range(a, b):
        k_pos = kt * BN + tl.arange(0, BN)
        k_ok = k_pos <= q_pos
        k = tl.load(kb + slot[:, None] * D + d[None, :], mask=k_ok[:, None], other=0.0)
        v = tl.load(vb + slot[:, None] * D + d[None, :], mask=k_ok[:, None], other=0.0)
        slot = _tile_slots(TBL, t_off, kt + 1, q_pos, block_tokens, BN)
        m, lsum, acc = _key_step_t(qt, m, lsum, acc, k_pos, k, v, q_pos, window, qk_scale, BN,
                                   True, PREC)
    return m, lsum, acc


@triton.jit
def _decode_split(qt, m, lsum, acc, kb, vb, TBL, t_off, a, b, fa, fb, q_pos, window, qk_scale,
                  block_tokens, D: tl.constexpr, BN: tl.constexpr, PREC: tl.constexpr,
                  LOOP: tl.constexpr):
    """One decode split's tiles [a, b): LOOP 0 ``_split_tiles`` (masked and
    unmasked loops), 1 one masked loop, 2 ``_tiles_ahead``. The same numbers
    every way (only loads and their schedule differ)."""
    if LOOP == 0:
        m, lsum, acc = _split_tiles(qt, m, lsum, acc, kb, vb, TBL, t_off, a, b, fa, fb, q_pos,
                                    q_pos, window, qk_scale, block_tokens, D, BN, PREC, True)
    elif LOOP == 1:
        m, lsum, acc = _tiles(qt, m, lsum, acc, kb, vb, TBL, t_off, a, b, q_pos, q_pos, window,
                              qk_scale, block_tokens, D, BN, True, PREC, True)
    else:
        m, lsum, acc = _tiles_ahead(qt, m, lsum, acc, kb, vb, TBL, t_off, a, b, q_pos, window,
                                    qk_scale, block_tokens, D, BN, PREC)
    return m, lsum, acc


@triton.jit
def _split_tiles(q, m, lsum, acc, kb, vb, TBL, t_off, a, b, fa, fb, q_pos, hi, window,
                 qk_scale, block_tokens, D: tl.constexpr, BN: tl.constexpr,
                 PREC: tl.constexpr, KEYS_MAJOR: tl.constexpr):
    """Key tiles [a, b) of one split: the masked ones before ``fa``, the
    unmasked ones in [fa, fb), the masked ones from ``fb`` on (``_key_range``)."""
    m, lsum, acc = _tiles(q, m, lsum, acc, kb, vb, TBL, t_off, a, tl.minimum(fa, b), q_pos,
                          hi, window, qk_scale, block_tokens, D, BN, True, PREC, KEYS_MAJOR)
    m, lsum, acc = _tiles(q, m, lsum, acc, kb, vb, TBL, t_off, tl.maximum(fa, a),
                          tl.minimum(fb, b), q_pos, hi, window, qk_scale, block_tokens, D, BN,
                          False, PREC, KEYS_MAJOR)
    return _tiles(q, m, lsum, acc, kb, vb, TBL, t_off, tl.maximum(fb, a), b, q_pos, hi,
                  window, qk_scale, block_tokens, D, BN, True, PREC, KEYS_MAJOR)


@triton.jit
def _key_range(p_first, hi, window, BN: tl.constexpr):
    """Key tiles [ta, tb) of rows at positions p_first..hi and [fa, fb), those
    every row sees whole (no mask needed)."""
    lo = 0
    if window > 0:
        lo = tl.maximum(p_first - window + 1, 0)
    ta = lo // BN
    tb = hi // BN + 1
    fa = ta
    if window > 0:
        fa = tl.cdiv(tl.maximum(hi - window + 1, 0), BN)
    fa = tl.minimum(tl.maximum(fa, ta), tb)
    fb = tl.minimum(tl.maximum((p_first + 1) // BN, fa), tb)
    return ta, tb, fa, fb


@triton.jit
def _attn_kernel(Q, KP, VP, TBL, SEG, TILE, OUT,
                 s_qm, s_qh, s_kh, s_om, window, qk_scale, block_tokens,
                 G: tl.constexpr, GP: tl.constexpr, TQ: tl.constexpr, D: tl.constexpr,
                 BN: tl.constexpr, TPS: tl.constexpr, PREC: tl.constexpr):
    """A prefill tile (TQ tokens x the GQA group of KV head ``program_id(1)``):
    folds all its splits and stores the output."""
    tile = tl.program_id(0)
    hk = tl.program_id(1)
    seg = tl.load(TILE + 2 * tile)
    t0 = tl.load(TILE + 2 * tile + 1)                # first token of the tile in its segment
    row0 = tl.load(SEG + 4 * seg)
    rows = tl.load(SEG + 4 * seg + 1)
    q_start = tl.load(SEG + 4 * seg + 2)
    t_off = tl.load(SEG + 4 * seg + 3)               # its block table's offset in TBL
    r = tl.arange(0, TQ * GP)
    tok = t0 + r // GP
    g = r % GP
    row_ok = (tok < rows) & (g < G)
    q_pos = q_start + tok                            # [R] absolute position of each row
    d = tl.arange(0, D)
    qrow = (row0 + tok).to(tl.int64)
    q = tl.load(Q + qrow[:, None] * s_qm + (hk * G + g)[:, None] * s_qh + d[None, :],
                mask=row_ok[:, None], other=0.0)     # [R, D]
    p_first = q_start + t0                           # the tile's first and last positions
    hi = q_start + tl.minimum(t0 + TQ, rows) - 1
    ta, tb, fa, fb = _key_range(p_first, hi, window, BN)
    kb = KP + hk * s_kh
    vb = VP + hk * s_kh
    zero_m = tl.full([TQ * GP], float("-inf"), tl.float32)
    zero_l = tl.zeros([TQ * GP, 16], tl.float32)
    zero_acc = tl.zeros([TQ * GP, D], tl.float32)
    m, lsum, acc = zero_m, tl.zeros([TQ * GP], tl.float32), zero_acc     # the row's total
    for sp in range(ta // TPS, tl.cdiv(tb, TPS)):
        a = tl.maximum(ta, sp * TPS)
        b = tl.minimum(tb, sp * TPS + TPS)
        ms, ls, accs = zero_m, zero_l, zero_acc      # this split, from a fresh state
        ms, ls, accs = _split_tiles(q, ms, ls, accs, kb, vb, TBL, t_off, a, b, fa, fb, q_pos,
                                    hi, window, qk_scale, block_tokens, D, BN, PREC, False)
        # the 16 columns are equal: the maximum picks that number exactly
        m, lsum, acc = _fold(m, lsum, acc, ms, tl.max(ls, 1), accs)
    o = acc / tl.where(row_ok, lsum, 1.0)[:, None] + 0.0
    tl.store(OUT + qrow[:, None] * s_om + (hk * G + g)[:, None] * D + d[None, :],
             o.to(OUT.dtype.element_ty), mask=row_ok[:, None])


@triton.jit
def _decode_whole(qt, kb, vb, TBL, t_off, ta, tb, fa, fb, q_pos, window, qk_scale,
                  block_tokens, OUT, qrow, s_om, heads, g_ok, d, NQ: tl.constexpr,
                  D: tl.constexpr, BN: tl.constexpr, TPS: tl.constexpr, PREC: tl.constexpr,
                  LOOP: tl.constexpr):
    """One program takes all the row's splits, folds them in order and stores the
    output (main's one-share decode, unchanged: the fold in the [NQ, D] layout)."""
    zero_m = tl.full([NQ], float("-inf"), tl.float32)
    zero_l = tl.zeros([BN, NQ], tl.float32)
    zero_acc = tl.zeros([D, NQ], tl.float32)
    m, lsum, acc = zero_m, tl.zeros([NQ], tl.float32), tl.zeros([NQ, D], tl.float32)
    for sp in range(ta // TPS, tl.cdiv(tb, TPS)):
        a = tl.maximum(ta, sp * TPS)
        b = tl.minimum(tb, sp * TPS + TPS)
        ms, ls, accs = zero_m, zero_l, zero_acc
        ms, ls, accs = _decode_split(qt, ms, ls, accs, kb, vb, TBL, t_off, a, b, fa, fb, q_pos,
                                     window, qk_scale, block_tokens, D, BN, PREC, LOOP)
        m, lsum, acc = _fold(m, lsum, acc, ms, tl.max(ls, 0), tl.trans(accs))
    o = acc / tl.where(g_ok, lsum, 1.0)[:, None] + 0.0
    tl.store(OUT + qrow * s_om + heads[:, None] * D + d[None, :],
             o.to(OUT.dtype.element_ty), mask=g_ok[:, None])


@triton.jit
def _decode_kernel(Q, KP, VP, TBL, SEG, OUT, ACC, ML,
                   s_qm, s_qh, s_kh, s_om, s_ab, s_ap, s_ah, s_mb, s_mp, s_mh,
                   window, qk_scale, block_tokens,
                   G: tl.constexpr, NQ: tl.constexpr, D: tl.constexpr, BN: tl.constexpr,
                   TPS: tl.constexpr, PARTS: tl.constexpr, PREC: tl.constexpr,
                   LOOP: tl.constexpr = 0, PDL: tl.constexpr = False):
    """Decode row ``program_id(0)`` (a one-token segment), the GQA group of KV
    head ``program_id(1)``. PARTS 1, or a row of one split: one program takes all
    its splits, folds them and stores the output (``_decode_whole``). PARTS > 1
    and a row of several splits: share ``program_id(2)`` takes every PARTS-th
    split (balanced to one split) and stores each split's own state in its slot
    of the scratch, for ``_fold_splits``. Keys on the instruction's row side
    (``_key_tile_t``); the same numbers as a prefill row."""
    pdl_enter(PDL)
    seg = tl.program_id(0)
    hk = tl.program_id(1)
    qrow = tl.load(SEG + 4 * seg).to(tl.int64)
    q_pos = tl.load(SEG + 4 * seg + 2)
    t_off = tl.load(SEG + 4 * seg + 3)
    g = tl.arange(0, NQ)
    g_ok = g < G
    heads = hk * G + g
    d = tl.arange(0, D)
    qt = tl.load(Q + qrow * s_qm + heads[None, :] * s_qh + d[:, None], mask=g_ok[None, :],
                 other=0.0)                          # [D, NQ]
    ta, tb, fa, fb = _key_range(q_pos, q_pos, window, BN)
    kb = KP + hk * s_kh
    vb = VP + hk * s_kh
    if PARTS <= 1:
        _decode_whole(qt, kb, vb, TBL, t_off, ta, tb, fa, fb, q_pos, window, qk_scale,
                      block_tokens, OUT, qrow, s_om, heads, g_ok, d, NQ, D, BN, TPS, PREC, LOOP)
    else:
        # Which path a row takes is decided by the row alone: its split count
        # comes from its own position and window (_key_range), never from the
        # batch, the bucket or PARTS. And both paths give the same bits anyway:
        # a split's state is the same numbers wherever it is computed, and a fold
        # into or of the fresh state is exact (see the module docstring), so one
        # split folded here equals that split stored and folded by _fold_splits.
        # A row of one split (a short context, e.g. 256 keys) skips the scratch
        # round trip: share 0 stores its output, the other shares and its
        # _fold_splits program do nothing (the 3 % a layer the second pass cost
        # at 256 keys on the H200, b1 / b8).
        s_first = ta // TPS
        s_end = tl.cdiv(tb, TPS)
        if s_end - s_first <= 1:
            if tl.program_id(2) == 0:
                _decode_whole(qt, kb, vb, TBL, t_off, ta, tb, fa, fb, q_pos, window, qk_scale,
                              block_tokens, OUT, qrow, s_om, heads, g_ok, d, NQ, D, BN, TPS,
                              PREC, LOOP)
        else:
            # A split's state is the same numbers wherever it is computed; only
            # the fold order matters, and _fold_splits keeps the prefill's. So
            # the shares need not be contiguous: the row's i-th split goes to
            # share i % PARTS, and a 32-split row at 4 shares costs a program 8
            # splits (29 when a share's splits were folded in the program).
            zero_m = tl.full([NQ], float("-inf"), tl.float32)
            zero_l = tl.zeros([BN, NQ], tl.float32)
            zero_acc = tl.zeros([D, NQ], tl.float32)
            for sp in range(s_first + tl.program_id(2), s_end, PARTS):
                a = tl.maximum(ta, sp * TPS)
                b = tl.minimum(tb, sp * TPS + TPS)
                ms, ls, accs = zero_m, zero_l, zero_acc
                ms, ls, accs = _decode_split(qt, ms, ls, accs, kb, vb, TBL, t_off, a, b, fa,
                                             fb, q_pos, window, qk_scale, block_tokens, D, BN,
                                             PREC, LOOP)
                slot = seg * s_ab + sp * s_ap
                tl.store(ACC + slot + heads[None, :] * s_ah + d[:, None], accs,
                         mask=g_ok[None, :])
                mslot = seg * s_mb + sp * s_mp + heads * s_mh
                tl.store(ML + mslot, ms, mask=g_ok)
                tl.store(ML + mslot + 1, tl.max(ls, 0), mask=g_ok)


@triton.jit
def _split_state(ACC, ML, acc_row, ml_row, sp, s_end, heads, d, ok, s_ap, s_ah, s_mp, s_mh):
    """Split ``sp``'s stored state ([GP], [GP], [GP, D]); past the row's last
    split the fresh state (-inf, 0, 0), which a fold leaves unchanged."""
    # A [GP] vector compare, not a scalar one: under the Triton 3.9 interpreter
    # int1 & a broadcast scalar int1 makes a mask tl.load refuses.
    live = ok & (heads * 0 + sp < s_end)
    mp = ML + ml_row + sp * s_mp + heads * s_mh
    m2 = tl.load(mp, mask=live, other=float("-inf"))
    l2 = tl.load(mp + 1, mask=live, other=0.0)
    a2 = tl.load(ACC + acc_row + sp * s_ap + heads[:, None] * s_ah + d[None, :],
                 mask=live[:, None], other=0.0)
    return m2, l2, a2


@triton.jit
def _fold_splits(SEG, ACC, ML, OUT, s_ab, s_ap, s_ah, s_mb, s_mp, s_mh, s_om, window,
                 G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, BN: tl.constexpr,
                 TPS: tl.constexpr, PDL: tl.constexpr = False):
    """Decode row ``program_id(0)``, KV head ``program_id(1)``: the split states
    ``_decode_kernel`` stored, folded in ascending order from a fresh state and
    normalised: the prefill's bits. Four splits are loaded before the four
    folds (one memory round trip for four, not one each: 8 for a 32k-key row);
    a split past the row's last loads as the fresh state, which a fold leaves
    unchanged (the sign of a zero aside, which the final ``+ 0.0`` folds)."""
    pdl_enter(PDL)
    seg = tl.program_id(0)
    hk = tl.program_id(1)
    qrow = tl.load(SEG + 4 * seg).to(tl.int64)
    q_pos = tl.load(SEG + 4 * seg + 2)
    ta, tb, _, _ = _key_range(q_pos, q_pos, window, BN)
    s_first = ta // TPS
    s_end = tl.cdiv(tb, TPS)
    # A row of one split was finished by _decode_kernel's share 0 (its own rule,
    # from the row's position and window alone): nothing stored, nothing to fold.
    if s_end - s_first > 1:
        g = tl.arange(0, GP)
        d = tl.arange(0, D)
        ok = g < G
        heads = hk * G + g
        acc_row = seg * s_ab
        ml_row = seg * s_mb
        m = tl.full([GP], float("-inf"), tl.float32)
        lsum = tl.zeros([GP], tl.float32)
        acc = tl.zeros([GP, D], tl.float32)
        for s0 in range(s_first, s_end, 4):
            m0, l0, a0 = _split_state(ACC, ML, acc_row, ml_row, s0, s_end, heads, d, ok, s_ap,
                                      s_ah, s_mp, s_mh)
            m1, l1, a1 = _split_state(ACC, ML, acc_row, ml_row, s0 + 1, s_end, heads, d, ok,
                                      s_ap, s_ah, s_mp, s_mh)
            m2, l2, a2 = _split_state(ACC, ML, acc_row, ml_row, s0 + 2, s_end, heads, d, ok,
                                      s_ap, s_ah, s_mp, s_mh)
            m3, l3, a3 = _split_state(ACC, ML, acc_row, ml_row, s0 + 3, s_end, heads, d, ok,
                                      s_ap, s_ah, s_mp, s_mh)
            m, lsum, acc = _fold(m, lsum, acc, m0, l0, a0)
            m, lsum, acc = _fold(m, lsum, acc, m1, l1, a1)
            m, lsum, acc = _fold(m, lsum, acc, m2, l2, a2)
            m, lsum, acc = _fold(m, lsum, acc, m3, l3, a3)
        o = acc / tl.where(ok, lsum, 1.0)[:, None] + 0.0
        tl.store(OUT + qrow * s_om + heads[:, None] * D + d[None, :],
                 o.to(OUT.dtype.element_ty), mask=ok[:, None])


def tile_tokens(group: int, rows: int) -> int:
    """Query tokens per program: a function of the model (its GQA group) alone."""
    gp = triton.next_power_of_2(group)
    if gp > rows:
        raise ValueError(f"a GQA group of {group} heads does not fit {rows} rows")
    return rows // gp


def decode_scratch(rows: int, max_keys: int, heads: int, dim: int, device: torch.device,
                   split: int = KEY_SPLIT) -> tuple[torch.Tensor, torch.Tensor]:
    """The split states of ``rows`` decode rows of up to ``max_keys`` keys:
    ``acc`` [rows, splits, H, D] and ``ml`` [rows, splits, H, 2], fp32, one slot
    per key split (by absolute position), whatever the number of shares."""
    n = -(-max_keys // split)
    return (torch.empty(rows, n, heads, dim, dtype=torch.float32, device=device),
            torch.empty(rows, n, heads, 2, dtype=torch.float32, device=device))


def attend(pool: torch.Tensor, layer: int, q: torch.Tensor, tables: torch.Tensor,
           seg_meta: torch.Tensor, tiles: torch.Tensor, n_tiles: int, group: int,
           window: int, out: torch.Tensor, parts: int = 0,
           acc: torch.Tensor | None = None, ml: torch.Tensor | None = None,
           split: int = KEY_SPLIT, schedule: DecodeSchedule | None = None) -> None:
    """One launch for every tile of every segment of one layer. ``parts`` 0:
    prefill tiles; >= 1: one-token decode rows (program i = segment i; ``tiles``
    is read by prefill only), their splits dealt over ``parts`` programs a row
    whose split states go to ``acc`` and ``ml`` (``decode_scratch``: a slot for
    every split a row can have) and are folded here by a second kernel.
    ``split`` (keys, a multiple of KEY_TILE) is part of the arithmetic: other
    values are for checks and timings only; ``parts`` and ``schedule`` (a
    decode program's ``DecodeSchedule``, None: ``DECODE``) are not."""
    if split % KEY_TILE:
        raise ValueError(f"key split {split} is not a multiple of {KEY_TILE}")
    _, _, kv_heads, _, block_tokens, dim = pool.shape
    if q.stride(2) != 1:
        q = q.contiguous()
    gp = triton.next_power_of_2(group)
    kp, vp = pool[layer, 0], pool[layer, 1]                      # [Hkv, nb, B, D]
    scale = LOG2E / dim ** 0.5
    tps = split // KEY_TILE
    if not parts:
        _attn_kernel[(n_tiles, kv_heads)](
            q, kp, vp, tables, seg_meta, tiles, out, q.stride(0), q.stride(1), kp.stride(0),
            out.stride(0), window, scale, block_tokens, G=group, GP=gp,
            TQ=tile_tokens(group, PREFILL_ROWS), D=dim, BN=KEY_TILE, TPS=tps,
            PREC=_prec(q.dtype), num_warps=PREFILL_ROWS // 16, num_stages=3,
            enable_fp_fusion=False)
        return
    if parts > 1:
        assert acc is not None and ml is not None
        sa, sm = acc.stride(), ml.stride()
    else:
        acc = ml = out
        sa = sm = (0, 0, 0, 0)
    sch = schedule or DECODE
    extra = {"maxnreg": sch.maxnreg} if sch.maxnreg else {}
    _decode_kernel[(n_tiles, kv_heads, parts)](
        q, kp, vp, tables, seg_meta, out, acc, ml,
        q.stride(0), q.stride(1), kp.stride(0), out.stride(0), sa[0], sa[1], sa[2],
        sm[0], sm[1], sm[2], window, scale, block_tokens,
        G=group, NQ=max(DECODE_COLS, gp), D=dim, BN=KEY_TILE, TPS=tps,
        PARTS=parts, PREC=_prec(q.dtype), LOOP=sch.loop, num_warps=sch.warps,
        num_stages=sch.stages, enable_fp_fusion=False, **extra, **triton_pdl.opts())
    if parts > 1:
        _fold_splits[(n_tiles, kv_heads)](seg_meta, acc, ml, out, sa[0], sa[1], sa[2], sm[0],
                                          sm[1], sm[2], out.stride(0), window, G=group, GP=gp,
                                          D=dim, BN=KEY_TILE, TPS=tps, enable_fp_fusion=False,
                                          **triton_pdl.opts())


@dataclass(frozen=True, slots=True)
class AttnSegment:
    row0: int                  # first query row of this sequence in the call
    rows: int
    q_start: int               # absolute position of its first row
    table: torch.Tensor        # its block ids (on the device)


class InvariantAttention:
    """The per-forward plan (segments, tiles, block tables on the device) and one
    attention launch per layer; K/V come from the paged pool. Segments are the
    sequences of a (batched) prefill, or one-token decode rows."""

    def __init__(self, pool: torch.Tensor, segments: Seq[AttnSegment], num_heads: int,
                 parts: int = 0, split: int = KEY_SPLIT,
                 schedule: DecodeSchedule | None = None) -> None:
        # pool: [L, 2, Hkv, num_blocks, B, D] (engine.kv_pool.KVStorage.data)
        self.pool, self.split, self.schedule = pool, split, schedule
        self.group = num_heads // pool.shape[2]
        self.parts = parts
        if parts and any(s.rows != 1 for s in segments):
            raise ValueError("decode segments are one token each")
        tq = 1 if parts else tile_tokens(self.group, PREFILL_ROWS)
        seg_meta: list[int] = []
        work: list[tuple[int, int, int]] = []        # (-last key, segment, first token)
        off = 0
        for i, s in enumerate(segments):
            seg_meta += [s.row0, s.rows, s.q_start, off]
            off += int(s.table.numel())
            for t0 in range(0, s.rows, tq):
                work.append((-(s.q_start + min(t0 + tq, s.rows)), i, t0))
        if not parts:
            work.sort()               # longest first: the last programs are the short ones
        tiles = [x for _, i, t0 in work for x in (i, t0)]
        dev = pool.device
        self.n_tiles = len(work)
        self.tables = (torch.cat([s.table for s in segments]).to(torch.int32) if segments
                       else torch.zeros(1, dtype=torch.int32, device=dev))
        meta = torch.tensor(seg_meta + tiles, dtype=torch.int32).to(dev, non_blocking=True)
        self.seg_meta, self.tiles = meta[:len(seg_meta)], meta[len(seg_meta):]

    def __call__(self, layer: int, q: torch.Tensor, window: int, out: torch.Tensor,
                 acc: torch.Tensor | None = None, ml: torch.Tensor | None = None) -> None:
        # q: [M, H, D] (unit stride in D); out: [M, H * D]
        if self.n_tiles:
            attend(self.pool, layer, q, self.tables, self.seg_meta, self.tiles, self.n_tiles,
                   self.group, window, out, self.parts, acc, ml, self.split, self.schedule)
