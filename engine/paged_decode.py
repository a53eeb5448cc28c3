"""GPU decode: one paged-attention kernel for every sequence of a step, and CUDA
graphs of the whole decode forward per batch bucket.

The kernel (Triton) reads K/V straight from the paged pool through each
sequence's block table, so decode needs neither the per-sequence contiguous
mirror nor a Python loop of SDPA calls. One program handles one (sequence, KV
head, split): the g query heads of that KV head become the rows of one small
matrix product (GQA without repeating K/V); sliding-window layers start at
``pos - window + 1``. Long contexts at small batch split the keys into
``splits`` ranges (flash-decoding) that a second pass merges.

Graphs: every per-step input (tokens, positions, write slots, block tables,
lengths) lives in static device buffers, so one ``CUDAGraph.replay`` runs the
32-layer forward with no launch gaps; engine/step_inputs.py fills them in at
most two copies a step. Padding rows of a bucket point at a
reserved scratch block, never at a live sequence's KV.

Only imported on CUDA (Triton is not a CPU dependency).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
import triton
import triton.language as tl

from engine import triton_pdl
from engine.kv_pool import KVStorage
from engine.staging import CAPTURE
from engine.step_inputs import StagedInputs
from engine.triton_pdl import pdl_enter

BUCKETS = (1, 2, 4, 8, 16, 32, 64)


@triton.jit
def _paged_decode_kernel(Q, K, V, TBL, LENS, ACC, ML, OUT,
                         s_qb, s_qh, s_kh, s_kb, s_kt, s_tb, s_ob,
                         s_ab, s_as, s_ah, s_mb, s_ms, s_mh,
                         window, scale,
                         G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr,
                         BT: tl.constexpr, SPLITS: tl.constexpr, PREC: tl.constexpr,
                         PDL: tl.constexpr = False):
    pdl_enter(PDL)
    b = tl.program_id(0)
    hk = tl.program_id(1)
    sp = tl.program_id(2)
    n_keys = tl.load(LENS + b)                          # keys [lo, n_keys) of this row
    lo = 0
    if window > 0:
        lo = tl.maximum(n_keys - window, 0)
    first = lo // BT
    last = tl.cdiv(n_keys, BT)
    per = tl.cdiv(last - first, SPLITS)
    p0 = first + sp * per
    p1 = tl.minimum(last, p0 + per)
    g = tl.arange(0, GP)
    d = tl.arange(0, D)
    t = tl.arange(0, BT)
    heads = hk * G + g
    q = tl.load(Q + b * s_qb + heads[:, None] * s_qh + d[None, :],
                mask=(g < G)[:, None], other=0.0)                    # [GP, D]
    m = tl.full([GP], float("-inf"), tl.float32)
    lsum = tl.zeros([GP], tl.float32)
    acc = tl.zeros([GP, D], tl.float32)
    for p in range(p0, p1):
        blk = tl.load(TBL + b * s_tb + p).to(tl.int64)
        base = hk * s_kh + blk * s_kb + t[:, None] * s_kt + d[None, :]
        k = tl.load(K + base)                                        # [BT, D]
        s = tl.dot(q, tl.trans(k), input_precision=PREC) * scale     # [GP, BT] fp32
        pos = p * BT + t
        valid = (pos < n_keys) & (pos >= lo)
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        alpha = tl.exp(m - m_new)
        e = tl.exp(s - m_new[:, None])
        lsum = lsum * alpha + tl.sum(e, 1)
        v = tl.load(V + base)
        acc = acc * alpha[:, None] + tl.dot(e.to(v.dtype), v, input_precision=PREC)
        m = m_new
    row = g < G
    if SPLITS == 1:                 # one range: normalise here, no merge pass
        o = acc / lsum[:, None]
        tl.store(OUT + b * s_ob + heads[:, None] * D + d[None, :], o.to(OUT.dtype.element_ty),
                 mask=row[:, None])
        return
    tl.store(ACC + b * s_ab + sp * s_as + heads[:, None] * s_ah + d[None, :], acc,
             mask=row[:, None])
    tl.store(ML + b * s_mb + sp * s_ms + heads * s_mh, m, mask=row)
    tl.store(ML + b * s_mb + sp * s_ms + heads * s_mh + 1, lsum, mask=row)


def splits_for(batch: int, kv_heads: int, sms: int) -> int:
    """Key splits so the grid fills the GPU about twice; 1 at large batch."""
    return max(1, min(32, (2 * sms) // max(1, batch * kv_heads)))


def paged_decode(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                 tables: torch.Tensor, lens: torch.Tensor, window: int, splits: int,
                 acc: torch.Tensor, ml: torch.Tensor) -> torch.Tensor:
    """q: [B, H, D]; k_pool, v_pool: [Hkv, num_blocks, BT, D] (one layer of the pool);
    tables: [B, max_blocks] int32; lens: [B] int32 keys per row (position + 1);
    acc: [B, splits, H, D] fp32 and ml: [B, splits, H, 2] fp32 scratch.
    Returns [B, H * D] in q's dtype."""
    bsz, heads, dim = q.shape
    kv_heads, _, bt, _ = k_pool.shape
    group = heads // kv_heads
    out = torch.empty(bsz, heads * dim, dtype=q.dtype, device=q.device)
    _paged_decode_kernel[(bsz, kv_heads, splits)](
        q, k_pool, v_pool, tables, lens, acc, ml, out,
        q.stride(0), q.stride(1), k_pool.stride(0), k_pool.stride(1), k_pool.stride(2),
        tables.stride(0), out.stride(0), acc.stride(0), acc.stride(1), acc.stride(2),
        ml.stride(0), ml.stride(1), ml.stride(2), window, 1.0 / dim ** 0.5,
        G=group, GP=max(16, triton.next_power_of_2(group)), D=dim, BT=bt, SPLITS=splits,
        # fp32 models stay fp32 (Triton's default for an fp32 dot is tf32)
        PREC="ieee" if q.dtype == torch.float32 else "tf32", num_warps=4, **triton_pdl.opts())
    if splits > 1:
        _merge_splits_kernel[(bsz, heads)](acc, ml, out, acc.stride(0), acc.stride(1),
                                           acc.stride(2), ml.stride(0), ml.stride(1),
                                           ml.stride(2), out.stride(0), splits, D=dim,
                                           SP=triton.next_power_of_2(splits),
                                           **triton_pdl.opts())
    return out


@triton.jit
def _merge_splits_kernel(ACC, ML, OUT, s_ab, s_as, s_ah, s_mb, s_ms, s_mh, s_ob, splits,
                         D: tl.constexpr, SP: tl.constexpr, PDL: tl.constexpr = False):
    pdl_enter(PDL)
    # one (row, head): the splits' partial softmax states merged in one pass
    # (one launch per layer instead of the seven of the torch expression)
    b = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.arange(0, SP)
    d = tl.arange(0, D)
    ok = s < splits
    m = tl.load(ML + b * s_mb + s * s_ms + h * s_mh, mask=ok, other=float("-inf"))
    lsum = tl.load(ML + b * s_mb + s * s_ms + h * s_mh + 1, mask=ok, other=0.0)
    w = tl.exp(m - tl.max(m, 0))                    # empty splits: m = -inf, weight 0
    acc = tl.load(ACC + b * s_ab + s[:, None] * s_as + h * s_ah + d[None, :],
                  mask=ok[:, None], other=0.0)
    o = tl.sum(acc * w[:, None], 0) / tl.sum(lsum * w, 0)
    tl.store(OUT + b * s_ob + h * D + d, o.to(OUT.dtype.element_ty))


@triton.jit
def _write_kv_kernel(K, V, SLOTS, KP, VP, s_km, s_kh, s_vm, s_vh, s_ph,
                     D: tl.constexpr, PDL: tl.constexpr = False):
    pdl_enter(PDL)
    row = tl.program_id(0)
    h = tl.program_id(1)
    d = tl.arange(0, D)
    slot = tl.load(SLOTS + row).to(tl.int64)
    dst = h * s_ph + slot * D + d
    tl.store(KP + dst, tl.load(K + row * s_km + h * s_kh + d))
    tl.store(VP + dst, tl.load(V + row * s_vm + h * s_vh + d))


def write_kv(data: torch.Tensor, layer: int, slots: torch.Tensor, k: torch.Tensor,
             v: torch.Tensor) -> None:
    """The decode step's new K/V rows into the pool in one launch (what
    ``KVStorage.write`` does with two ``index_copy_``): data [L, 2, Hkv, nb, B, D];
    k, v: [b, Hkv, D] with unit stride in D; slots: [b] (block * B + offset)."""
    rows, kv_heads, dim = k.shape
    kp, vp = data[layer, 0], data[layer, 1]
    if k.stride(2) != 1 or v.stride(2) != 1:
        k, v = k.contiguous(), v.contiguous()
    _write_kv_kernel[(rows, kv_heads)](k, v, slots, kp, vp, k.stride(0), k.stride(1),
                                       v.stride(0), v.stride(1), kp.stride(0), D=dim,
                                       **triton_pdl.opts())


@dataclass(slots=True)
class StepBuffers:
    """Static device inputs of one decode bucket (what a captured graph reads)."""

    tokens: torch.Tensor        # [b] int64
    positions: torch.Tensor     # [b] int64
    slots: torch.Tensor         # [b] int64 pool slot of each row's new K/V
    tables: torch.Tensor        # [b, max_blocks] int32
    lens: torch.Tensor          # [b] int32
    acc: torch.Tensor           # [b, splits, H, D] fp32
    ml: torch.Tensor            # [b, splits, H, 2] fp32
    splits: int


class PagedDecodeAttention:
    """The ``attend`` callback of a decode forward over StepBuffers."""

    def __init__(self, storage: KVStorage, windows: tuple[int, ...], num_heads: int,
                 buf: StepBuffers) -> None:
        self.storage, self.windows, self.buf = storage, windows, buf
        self.heads = num_heads

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor,
                 v: torch.Tensor) -> torch.Tensor:
        # q: [b, H, D]; k, v: [b, Hkv, D] -> [b, H * D]
        b = self.buf
        data = self.storage.data                     # [L, 2, Hkv, nb, BT, D]
        write_kv(data, layer, b.slots, k, v)
        return paged_decode(q, data[layer, 0], data[layer, 1], b.tables, b.lens,
                            self.windows[layer], b.splits, b.acc, b.ml)


# (storage, windows, num_heads, buffers) -> the attend callback of a bucket's forward
AttentionFactory = Callable[[KVStorage, tuple[int, ...], int, StepBuffers],
                            Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]]
ForwardFn = Callable[[torch.Tensor, torch.Tensor, object], torch.Tensor]


class DecodeRunner:
    """Batched paged decode with a CUDA graph per bucket (captured on first use)."""

    def __init__(self, storage: KVStorage, windows: tuple[int, ...], num_heads: int,
                 max_blocks: int, scratch_block: int, forward: ForwardFn,
                 use_graphs: bool, attention: AttentionFactory = PagedDecodeAttention,
                 pdl: bool = triton_pdl.WANTED) -> None:
        # attention: PagedDecodeAttention, or the batch-invariant kernel's decode
        # callback (engine/triton_invariant.py) when the engine's kernels are invariant
        self.attention = attention
        self.storage, self.windows, self.heads = storage, windows, num_heads
        self.max_blocks, self.scratch = max_blocks, scratch_block
        self.forward, self.use_graphs = forward, use_graphs
        # the graphs' Triton kernels start while their predecessors finish
        # (engine/triton_pdl.py); eager steps launch plainly
        self.pdl = pdl
        self.device = storage.device
        lay = storage.layout
        self.block_tokens, self.head_dim = lay.block_tokens, lay.head_dim
        self.kv_heads = lay.kv_heads
        self.sms = torch.cuda.get_device_properties(self.device).multi_processor_count
        self._bufs: dict[int, StepBuffers] = {}
        self._inputs: dict[int, StagedInputs] = {}
        # False: main's host-side inputs before issue 21 (benchmarks.decode_profile's
        # ``host0`` mode times the two in one process)
        self.staged = True
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        # a bucket's attend callback may own device tensors its graph reads: kept alive
        self._attends: dict[int, object] = {}
        self._pool = torch.cuda.graph_pool_handle() if use_graphs else None

    def bucket(self, n: int) -> int:
        for b in BUCKETS:
            if n <= b:
                return b
        return BUCKETS[-1]

    def _buffers(self, b: int) -> StepBuffers:
        if b not in self._bufs:
            dev, sp = self.device, splits_for(b, self.kv_heads, self.sms)
            ins = StagedInputs(b, self.max_blocks, self.scratch, self.block_tokens, dev)
            self._inputs[b] = ins
            self._bufs[b] = StepBuffers(
                ins.tokens, ins.positions, ins.slots, ins.tables, ins.lens,
                torch.empty(b, sp, self.heads, self.head_dim, dtype=torch.float32, device=dev),
                torch.empty(b, sp, self.heads, 2, dtype=torch.float32, device=dev), sp)
        return self._bufs[b]

    def _graph(self, b: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        if b not in self._graphs:
            buf = self._buffers(b)
            attn = self.attention(self.storage, self.windows, self.heads, buf)
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with triton_pdl.dependent_launches(self.pdl):
                with torch.cuda.stream(side):      # warm-up: Triton compiles, cuBLAS plans
                    for _ in range(2):
                        self.forward(buf.tokens, buf.positions, attn)
                torch.cuda.current_stream(self.device).wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                # No other thread's staged hand-off copy may run during the capture.
                with CAPTURE.capture(), torch.cuda.graph(graph, pool=self._pool):
                    logits = self.forward(buf.tokens, buf.positions, attn)
            self._graphs[b] = (graph, logits)
            self._attends[b] = attn
        return self._graphs[b]

    def capture_all(self) -> int:
        """Capture every bucket's graph now; the number captured. At start-up,
        not at a bucket's first use: a capture (two warm-up forwards, Triton's
        compiles for that row count, the capture) stalls every sequence in the
        batch, and traffic whose batch size wanders met each bucket mid-run."""
        if not self.use_graphs:
            return 0
        for b in BUCKETS:
            self._graph(b)
        return len(BUCKETS)

    def reset_graphs(self) -> None:
        """Drop the captured graphs (recaptured on next use, e.g. after ``pdl``
        changed), with their private memory pool."""
        self._graphs.clear()
        self._attends.clear()
        if self.use_graphs:
            self._pool = torch.cuda.graph_pool_handle()

    def step(self, pending: list[int], positions: list[int],
             blocks: list[list[int]]) -> torch.Tensor:
        """Logits [n, V] of one decode step for n <= 64 sequences."""
        n = len(pending)
        b = self.bucket(n)
        buf = self._buffers(b)
        if self.staged:
            self._inputs[b].stage(pending, positions, blocks)
        else:
            self._rebuild(buf, pending, positions, blocks)
            self._inputs[b].forget()
        if self.use_graphs:
            graph, logits = self._graph(b)
            graph.replay()
        else:
            attn = self.attention(self.storage, self.windows, self.heads, buf)
            logits = self.forward(buf.tokens, buf.positions, attn)
        return logits[:n]

    def _rebuild(self, buf: StepBuffers, pending: list[int], positions: list[int],
                 blocks: list[list[int]]) -> None:
        """main's inputs before issue 21, kept to time against (``staged=False``):
        the whole table filled on the host and sent, the integers in a pageable
        copy and four device copies."""
        b, bt = buf.tokens.shape[0], self.block_tokens
        host = np.zeros((4, b), dtype=np.int64)
        host[2, :] = self.scratch * bt
        host[3, :] = 1
        table = np.full((b, self.max_blocks), self.scratch, dtype=np.int32)
        for i, (tok, pos, blk) in enumerate(zip(pending, positions, blocks, strict=True)):
            host[0, i], host[1, i] = tok, pos
            host[2, i] = blk[pos // bt] * bt + pos % bt
            host[3, i] = pos + 1
            table[i, :len(blk)] = blk
        h = torch.from_numpy(host).to(self.device, non_blocking=True)
        buf.tokens.copy_(h[0])
        buf.positions.copy_(h[1])
        buf.slots.copy_(h[2])
        buf.lens.copy_(h[3])
        buf.tables.copy_(torch.from_numpy(table).to(self.device, non_blocking=True))
