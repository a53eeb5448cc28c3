"""Batch-invariant GPU kernels (kernel family ``triton_bi``): a row's bits depend
on that row's inputs alone, never on how many rows share the call.

- GEMM: one Triton matmul whose tile shape, warps and stages are a function of
  the weight's shape only (never of M), with no split-K: every output element is
  the same fp32 accumulation over the same K tiles in the same order whether
  the call has 1 row or 4096. The block N shrinks for narrow weights so a
  one-row decode GEMM still launches about a GPU's worth of programs.
  cuBLAS cannot be used: it picks a different kernel (tiles, split-K) per M.
- RMSNorm, SwiGLU, RoPE: engine/triton_kernels.py as it is. RMSNorm is one
  program per row whose block and warp count depend on the hidden size only,
  so its reduction tree is fixed; the other two are element-wise.
- Attention: one kernel for prefill chunks and decode rows. A program takes a
  tile of ``TQ`` query tokens of one sequence times the ``G`` query heads of
  one KV head (GQA without repeating K/V) and walks key tiles of ``BN`` keys
  aligned to absolute position 0 with an online softmax. A decode row is a
  tile with one valid token: same tile sizes, same key tiles, same order. A
  tile a row cannot see (past its position, or before its sliding window)
  leaves that row's state unchanged bit for bit: its scores are -inf, so
  ``alpha = exp(m - m) = 1`` and every ``e = exp(-inf) = 0``; a row with no
  key yet subtracts 0 instead of -inf, so it stays at (m=-inf, l=0, acc=0).
  The only trace such a tile can leave is the sign of an exactly-zero
  accumulator, which the final ``+ 0.0`` folds to +0.

Attention reads K/V from the paged pool through each sequence's block table
(one key row gathered per slot), not from the per-sequence mirror: the bits are
the same, and a decode step then costs one kernel per layer instead of two
mirror copies per sequence per layer. Decode runs in the paged runner's CUDA
graphs (``DecodeAttention``): a bucket's padding rows change no real row's bits.

Only imported on CUDA (Triton is not a CPU dependency).
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from engine.kv_pool import KVStorage
from engine.paged_decode import StepBuffers

# Part of the model fingerprint (engine/kernels.py): bump when any tile or
# arithmetic choice below changes, so blocks of two versions never mix.
KERNEL_ID = "tbi1"

GEMM_BM, GEMM_BK = 64, 64
ATTN_BN = 64                      # keys per tile
ATTN_ROWS = 64                    # query rows (tokens x padded group) per tile


def _prec(dtype: torch.dtype) -> str:
    # fp32 models stay fp32 (Triton's default for an fp32 dot is tf32)
    return "ieee" if dtype == torch.float32 else "tf32"


@dataclass(frozen=True, slots=True)
class GemmTiles:
    bn: int
    warps: int
    stages: int


def gemm_tiles(n: int) -> GemmTiles:
    """Tile choice by the weight's output width (never by the row count): about
    one program per SM at one row, wider tiles for wide weights (LM head, MLP)."""
    bn = 128 if n >= 128 * 128 else 64 if n >= 64 * 128 else 32
    return GemmTiles(bn, 4, 4)


# M is not specialised: Triton would otherwise compile a separate kernel for
# M == 1 or M % 16 == 0, and the row-count independence rests on one binary.
@triton.jit(do_not_specialize=["M"])
def _gemm_kernel(A, B, BIAS, C, M, N, K, s_am, s_ak, s_bk, s_bn, s_cm,
                 HAS_BIAS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                 BK: tl.constexpr, PREC: tl.constexpr):
    pm = tl.program_id(0)
    pn = tl.program_id(1)
    rm = pm * BM + tl.arange(0, BM)
    rn = pn * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    row_ok = rm < M
    col_ok = rn < N
    acc = tl.zeros([BM, BN], tl.float32)
    for k0 in range(0, K, BK):
        kk = k0 + rk
        a = tl.load(A + rm[:, None].to(tl.int64) * s_am + kk[None, :] * s_ak,
                    mask=row_ok[:, None] & (kk < K)[None, :], other=0.0)
        b = tl.load(B + kk[:, None] * s_bk + rn[None, :].to(tl.int64) * s_bn,
                    mask=(kk < K)[:, None] & col_ok[None, :], other=0.0)
        acc = tl.dot(a, b, acc, input_precision=PREC)
    if HAS_BIAS:
        acc += tl.load(BIAS + rn, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(C + rm[:, None].to(tl.int64) * s_cm + rn[None, :],
             acc.to(C.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def linear(x: torch.Tensor, w_t: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    # x: [M, K] @ w_t: [K, N] (+ bias [N]) -> [M, N] in x's dtype, fp32 accumulation
    m, k = x.shape
    n = w_t.shape[1]
    if w_t.shape[0] != k:
        raise ValueError(f"linear: x has {k} columns, weight expects {w_t.shape[0]}")
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    t = gemm_tiles(n)
    grid = (triton.cdiv(m, GEMM_BM), triton.cdiv(n, t.bn))
    b = bias.contiguous() if bias is not None else out
    _gemm_kernel[grid](x, w_t, b, out, m, n, k, x.stride(0), x.stride(1), w_t.stride(0),
                       w_t.stride(1), out.stride(0), HAS_BIAS=bias is not None, BM=GEMM_BM,
                       BN=t.bn, BK=GEMM_BK, PREC=_prec(x.dtype), num_warps=t.warps,
                       num_stages=t.stages)
    return out


@triton.jit
def _attn_kernel(Q, KP, VP, TBL, SEG, TILE, OUT,
                 s_qm, s_qh, s_kh, s_om, window, scale, block_tokens,
                 G: tl.constexpr, GP: tl.constexpr, TQ: tl.constexpr, D: tl.constexpr,
                 BN: tl.constexpr, PREC: tl.constexpr):
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
    hi = q_start + tl.minimum(t0 + TQ, rows) - 1     # last key any row of the tile sees
    lo = 0
    if window > 0:
        lo = tl.maximum(q_start + t0 - window + 1, 0)
    m = tl.full([TQ * GP], float("-inf"), tl.float32)
    lsum = tl.zeros([TQ * GP], tl.float32)
    acc = tl.zeros([TQ * GP, D], tl.float32)
    kb = KP + hk * s_kh
    vb = VP + hk * s_kh
    for kt in range(lo // BN, hi // BN + 1):         # key tiles aligned to position 0
        k_pos = kt * BN + tl.arange(0, BN)
        k_ok = k_pos <= hi
        blk = tl.load(TBL + t_off + k_pos // block_tokens, mask=k_ok, other=0).to(tl.int64)
        slot = blk * block_tokens + k_pos % block_tokens
        k = tl.load(kb + slot[:, None] * D + d[None, :], mask=k_ok[:, None], other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=PREC) * scale           # [R, BN]
        see = k_pos[None, :] <= q_pos[:, None]
        if window > 0:
            see &= k_pos[None, :] > q_pos[:, None] - window
        s = tl.where(see, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m - m_sub)
        e = tl.exp(s - m_sub[:, None])
        lsum = lsum * alpha + tl.sum(e, 1)
        v = tl.load(vb + slot[:, None] * D + d[None, :], mask=k_ok[:, None], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(e.to(v.dtype), v, input_precision=PREC)
        m = m_new
    o = acc / tl.where(row_ok, lsum, 1.0)[:, None] + 0.0
    tl.store(OUT + qrow[:, None] * s_om + (hk * G + g)[:, None] * D + d[None, :],
             o.to(OUT.dtype.element_ty), mask=row_ok[:, None])


@dataclass(frozen=True, slots=True)
class AttnSegment:
    row0: int                  # first query row of this sequence in the call
    rows: int
    q_start: int               # absolute position of its first row
    table: torch.Tensor        # its block ids (int64, on the device)


def _attend(pool: torch.Tensor, layer: int, q: torch.Tensor, tables: torch.Tensor,
            seg_meta: torch.Tensor, tiles: torch.Tensor, n_tiles: int, group: int,
            window: int, out: torch.Tensor) -> None:
    """One launch: every tile of every segment for one layer (prefill and decode)."""
    _, _, kv_heads, _, block_tokens, dim = pool.shape
    if q.stride(2) != 1:
        q = q.contiguous()
    gp = triton.next_power_of_2(group)
    kp, vp = pool[layer, 0], pool[layer, 1]                      # [Hkv, nb, B, D]
    _attn_kernel[(n_tiles, kv_heads)](
        q, kp, vp, tables, seg_meta, tiles, out,
        q.stride(0), q.stride(1), kp.stride(0), out.stride(0), window,
        1.0 / dim ** 0.5, block_tokens,
        G=group, GP=gp, TQ=_tile_tokens(group), D=dim, BN=ATTN_BN,
        PREC=_prec(q.dtype), num_warps=4)


def _tile_tokens(group: int) -> int:
    """Query tokens per tile: a function of the model (its GQA group) alone."""
    return max(1, ATTN_ROWS // triton.next_power_of_2(group))


class InvariantAttention:
    """The per-forward plan (segments, tiles, block tables on the device) and one
    attention launch per layer; K/V come from the paged pool."""

    def __init__(self, pool: torch.Tensor, segments: Seq[AttnSegment], num_heads: int) -> None:
        # pool: [L, 2, Hkv, num_blocks, B, D] (engine.kv_pool.KVStorage.data)
        self.pool = pool
        self.group = num_heads // pool.shape[2]
        tq = _tile_tokens(self.group)
        seg_meta: list[int] = []
        tiles: list[int] = []
        off = 0
        for i, s in enumerate(segments):
            seg_meta += [s.row0, s.rows, s.q_start, off]
            off += int(s.table.numel())
            for t0 in range(0, s.rows, tq):
                tiles += [i, t0]
        dev = pool.device
        self.n_tiles = len(tiles) // 2
        self.tables = (torch.cat([s.table for s in segments]).to(torch.int32) if segments
                       else torch.zeros(1, dtype=torch.int32, device=dev))
        meta = torch.tensor(seg_meta + tiles, dtype=torch.int32).to(dev, non_blocking=True)
        self.seg_meta, self.tiles = meta[:len(seg_meta)], meta[len(seg_meta):]

    def __call__(self, layer: int, q: torch.Tensor, window: int, out: torch.Tensor) -> None:
        # q: [M, H, D] (unit stride in D); out: [M, H * D]
        if self.n_tiles:
            _attend(self.pool, layer, q, self.tables, self.seg_meta, self.tiles, self.n_tiles,
                    self.group, window, out)


class DecodeAttention:
    """The attend callback of a CUDA-graph decode bucket (engine/paged_decode.py
    DecodeRunner, ``attention=``) through the same kernel: row i is a one-token
    segment at position ``lens[i] - 1`` over block table ``tables[i]``; padding
    rows point at the scratch block. Everything it reads lives in the bucket's
    static buffers, so a captured graph replays it."""

    def __init__(self, storage: KVStorage, windows: tuple[int, ...], num_heads: int,
                 buf: StepBuffers) -> None:
        self.storage, self.windows, self.buf = storage, windows, buf
        self.group = num_heads // storage.layout.kv_heads
        b, max_blocks = buf.tables.shape
        dev = buf.tables.device
        rows = torch.arange(b, dtype=torch.int32, device=dev)
        self.seg_meta = torch.stack([rows, torch.ones_like(rows), torch.zeros_like(rows),
                                     rows * max_blocks], 1).contiguous()      # [b, 4]
        self.tiles = torch.stack([rows, torch.zeros_like(rows)], 1).contiguous()
        self.width = num_heads * storage.layout.head_dim

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor,
                 v: torch.Tensor) -> torch.Tensor:
        # q: [b, H, D]; k, v: [b, Hkv, D] -> [b, H * D]
        b = self.buf
        self.storage.write(layer, b.slots, k, v)
        if layer == 0:             # positions change every step: once per forward
            self.seg_meta[:, 2].copy_(b.lens - 1)
        out = q.new_empty(q.shape[0], self.width)
        _attend(self.storage.data, layer, q, b.tables, self.seg_meta, self.tiles,
                q.shape[0], self.group, self.windows[layer], out)
        return out
