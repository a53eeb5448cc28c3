"""Batch-invariant GEMM on the GPU (Triton): a row's bits never depend on how
many rows share the call, yet each row count gets a tile that suits it.

What fixes a row's bits is the order of its reduction, not the tile: every
output element is one fp32 accumulator per K split that the matrix units
advance by the same 16-deep K steps, in order from the split's start, and the
splits' sums are added in order (split 0 + split 1 + ...), then the bias. How
many splits a weight has is fixed by its shape alone (``k_splits``), never by
M. Shipped: one split for every weight (``SPLITS = 1``, the arithmetic of
``tbi4``). Two splits for the narrow 16-bit outputs (qkv, o, down), meant to
spread their b64 decode GEMMs over twice the programs (64-96 programs leave
most of the H200's 132 SMs idle), measured slower in the engine on the H200
(docs/benchmarks-history.md, "A fixed K split for the narrow decode GEMMs"),
so they stay an option for engine/triton_tune.py and benchmarks/gemm_splits.py.
The tile's rows and
columns (``BM``, ``BN``), which operand side of the instruction the weight
takes, how many K steps one pipeline stage loads (a multiple of ``BK``), warps,
stages and the order programs run in only decide *which* elements a program
computes and how fast, so the plan is chosen per row count:

- up to 64 rows (decode, bound by reading the weights): weight-major tiles
  (``swap``: the instruction's 64-row side walks the weight's columns, its
  narrow side the 16 or 32 input rows) or 64-row tiles with 128-deep K stages,
  each program streaming its weight panel through a deep pipeline; for the
  weight shapes measured faster otherwise, the plan of ``DECODE_PLANS``
  (engine/triton_gemm_table.py, e.g. TMA-loaded weight-major tiles for
  llama-8b's down and o at 33-64 rows);
- up to 512 rows: 128 x 128 tiles, 8 warps;
- more (prefill chunks): 128 x 256 tiles, 8 warps, 3 stages, programs grouped so
  neighbours share the A rows in L2 (what the Triton matmul tutorial found
  fastest on Hopper).

Every 16-bit plan keeps the matrix units on one instruction family (warpgroup
MMA: 64-row multiples on the instruction's row side, warps along it only, so an
accumulator never spans two warps' shuffles), which is what makes the plans
agree bit for bit; that is
a property of the hardware, measured rather than assumed:
tests/engine/test_gpu_invariant.py compares rows across M = 1..64, 65, 512,
513 and 2,048, and engine/triton_tune.py checks every candidate plan against
the others before timing it. fp32 models keep one plan for every M (the FMA
path; they are not the speed target).

Only imported on CUDA (or under ``TRITON_INTERPRET=1`` for CPU checks).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from engine import triton_pdl
from engine.triton_gemm_table import TABLE as DECODE_TABLE
from engine.triton_pdl import pdl_enter

BK = 64                       # the K tile: part of the arithmetic (triton_invariant.KERNEL_ID)
# The K-split rule, part of the arithmetic too: 16-bit weights narrower than
# SPLIT_MAX_N columns whose K is a multiple of SPLIT_K_UNIT take SPLITS sums.
# 1: no weight is split. 2 measured slower on the H200 twice: through fp32
# scratch, and as shipped here (a program a split folded by the last one at
# <= 64 rows, the sums in registers past that): -5.4 / -6.9 / -6.7 % decode tok/s
# at b1 / 8 / 64 and -7.4 % prefill at 4k against one split in one engine
# (docs/benchmarks-history.md; benchmarks/gemm_splits.py sets 2 to measure it).
SPLITS, SPLIT_MAX_N, SPLIT_K_UNIT = 1, 16384, 512
SPLIT_ID = f"ks{SPLITS}n{SPLIT_MAX_N}u{SPLIT_K_UNIT}"


def k_splits(dtype: torch.dtype, n: int, k: int) -> int:
    """How many K splits a [K, N] weight's GEMM sums (a function of the weight
    alone, so a row's bits never depend on M). fp32 models keep one."""
    if dtype in (torch.bfloat16, torch.float16) and n < SPLIT_MAX_N and k % SPLIT_K_UNIT == 0:
        return SPLITS            # read at each call: benchmarks/gemm_splits.py changes it
    return 1


@dataclass(frozen=True, slots=True)
class GemmPlan:
    bm: int
    bn: int
    warps: int
    stages: int
    group_m: int = 8          # programs of GROUP_M row tiles walk N together (L2 reuse)
    # TMA loads (16-bit); with 64-row-side tiles one program an SM looping over
    # tiles, weight-major a program a tile
    persistent: bool = False
    # weight-major tile (M <= 64): the matrix instruction's 64-row side walks the
    # weight's columns (bn of them) and its narrow side the bm <= 64 input rows,
    # so one decode row costs a 16-wide instruction, not a 64-row one
    swap: bool = False
    bk: int = BK              # K per pipeline stage: a multiple of BK (same 16-deep steps)

    def __post_init__(self) -> None:
        if self.bk % BK:
            raise ValueError(f"GEMM plan {self}: K stage not a multiple of {BK}")
        if self.swap:
            if self.bn % 64 or self.bm % 16 or self.bm > 64 or self.warps % 4 \
                    or self.bn // 16 < self.warps:
                raise ValueError(f"GEMM plan {self} leaves the warpgroup MMA layout")
        elif self.bm % 64 or self.warps % 4 or self.bm // 16 < self.warps:
            # fewer than 16 rows per warp would put warps along N (a row split
            # across warps) or off the warpgroup instruction
            raise ValueError(f"GEMM plan {self} leaves the warpgroup MMA layout")


def _decode_bn(n: int) -> int:
    """Narrow columns for narrow weights: about one program per SM at one row."""
    return 128 if n >= 128 * 128 else 64 if n >= 64 * 128 else 32


# 33-64 rows on outputs narrower than 16,384 columns (qkv, o, down at b64) without
# a K split: 64-96 programs at 2.9 TB/s on the H200, yet 64 x 32 and 64 x 16 tiles
# (more programs) measured slower in the engine's b64 graph, each program
# re-reading the 64 input rows from L2 (docs/benchmarks-history.md, dependent
# launches in the decode graphs). The K-split option (``k_splits``) doubles the
# programs instead, each over half of K, so the input rows are read no more often.
NARROW_64 = GemmPlan(64, 64, 4, 6, bk=128)
# the option's plan: pipelines of about 96 KB of shared memory, two programs an
# SM (128-192 programs on 132 SMs); measured slower at b64 than NARROW_64 unsplit
NARROW_64_SPLIT = GemmPlan(64, 64, 4, 3, bk=128)


def x_tile(m: int) -> int:
    """The input-row side of a weight-major tile: 16, 32 or 64 rows."""
    return 16 if m <= 16 else 32 if m <= 32 else 64


# Decode plans by weight shape and row bucket, where engine/triton_tune.py-style
# timing (benchmarks/gemm_sweep.py: PDL graphs over weights larger than the L2,
# rows checked against a 2,048-row call) found one faster than the rule below:
# {(K, N, x_tile(m)): plan}. Only one-split weights: a split changes the sums.
# A swap plan's ``bm`` is set per call to ``x_tile(m)``.
DECODE_PLANS: dict[tuple[int, int, int], GemmPlan] = {
    key: GemmPlan(**spec) for key, spec in DECODE_TABLE.items()}  # type: ignore[arg-type]


def plan_16bit(m: int, n: int, splits: int = 1, k: int = 0) -> GemmPlan:
    if m <= 64 and splits == 1:
        by_shape = DECODE_PLANS.get((k, n, x_tile(m)))
        if by_shape is not None:
            return replace(by_shape, bm=x_tile(m)) if by_shape.swap else by_shape
    if m <= 64:
        # Decode streams the weights. Up to 32 rows: weight-major tiles, whose
        # 16- or 32-row input side wastes little matrix work, and on narrow
        # outputs (few programs, each a long panel) a deep pipeline to keep
        # enough of the weight in flight. 33-64 rows: 64-row tiles with 128-deep
        # K stages. (engine/triton_tune.py ``decode`` and the engine's decode on
        # the H200, llama-8b shapes; all bit-identical, as the tests check.)
        if n >= 128 * 128:
            return GemmPlan(x_tile(m), 128, 4, 4, swap=True)
        if m <= 32:
            # about 96-100 KB of stages: two programs an SM once split
            stages = 10 if m <= 16 or splits == 1 else 8
            return GemmPlan(x_tile(m), 64, 4, stages, swap=True)
        return NARROW_64 if splits == 1 else NARROW_64_SPLIT
    if m <= 512 or splits > 1:
        # a split GEMM of many rows holds two accumulators (``LOOP``): 128 x 256
        # would not fit the registers
        return GemmPlan(128, 128, 8, 4)
    return GemmPlan(128, 256, 8, 3)


def plan_fp32(m: int, n: int, splits: int = 1, k: int = 0) -> GemmPlan:
    # one plan for every M, as measured invariant on the H200 (engine.md); a
    # weight-major 16-row tile at decode M was bit-identical too but no faster
    # (docs/BENCHMARKS.md, issue 21)
    return GemmPlan(64, _decode_bn(n), 4, 4)


PlanFn = Callable[..., GemmPlan]      # (m, n, splits=1, k=0)
# by dtype; engine/triton_tune.py swaps in candidates to time them
PLANS: dict[torch.dtype, PlanFn] = {torch.bfloat16: plan_16bit, torch.float16: plan_16bit,
                                    torch.float32: plan_fp32}


def _prec(dtype: torch.dtype) -> str:
    # fp32 models stay fp32 (Triton's default for an fp32 dot is tf32)
    return "ieee" if dtype == torch.float32 else "tf32"


@triton.jit
def _fold(acc, PART, CNT, tile, split, n_tiles, SPLITS: tl.constexpr, X: tl.constexpr,
          Y: tl.constexpr):
    """Split ``split`` of output tile ``tile`` (``acc`` [X, Y], one program a
    split) leaves its sum in scratch; the program that finishes last adds the
    splits' sums in order 0, 1, ... (whoever that is: the order is fixed, the
    arrival is not) and resets the tile's counter for the next call. Returns
    the sum and whether this program stores it."""
    offs = tl.arange(0, X)[:, None] * Y + tl.arange(0, Y)[None, :]
    stride = n_tiles.to(tl.int64) * (X * Y)
    base = PART + tile.to(tl.int64) * (X * Y) + offs
    tl.store(base + split * stride, acc, cache_modifier=".cg")
    # every thread's part is written before one thread's release (the pattern of
    # CUTLASS's split-K semaphore); the acquire orders the reads after it
    tl.debug_barrier()
    done = tl.atomic_add(CNT + tile, 1, sem="acq_rel", scope="gpu")
    last = done == SPLITS - 1
    if last:
        acc = tl.load(base, cache_modifier=".cg")
        for s in tl.static_range(1, SPLITS):
            acc += tl.load(base + s * stride, cache_modifier=".cg")
        tl.atomic_xchg(CNT + tile, 0, sem="relaxed", scope="gpu")
    return acc, last


@triton.jit
def _split_sum(a_ptr, b_ptr, row_ok, ks, s_ak, s_bk, BM: tl.constexpr, BN: tl.constexpr,
               BK: tl.constexpr, PREC: tl.constexpr):
    """One split's sum, from zero, over ``ks`` of K (a multiple of BK: no K
    mask) starting at the given pointers; returns it and the pointers past it."""
    acc = tl.zeros([BM, BN], tl.float32)
    for _k0 in range(0, ks, BK):
        a = tl.load(a_ptr, mask=row_ok[:, None], other=0.0)
        b = tl.load(b_ptr)
        acc = tl.dot(a, b, acc, input_precision=PREC)
        a_ptr += BK * s_ak
        b_ptr += BK * s_bk
    return acc, a_ptr, b_ptr


# M is not specialised: Triton would compile another binary for M == 1 or
# M % 16 == 0, and nothing is gained.
@triton.jit(do_not_specialize=["M"])
def _gemm_kernel(A, B, BIAS, C, PART, CNT, M, N, K, s_am, s_ak, s_bk, s_bn, s_cm,
                 HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr, BM: tl.constexpr,
                 BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
                 PREC: tl.constexpr, SPLITS: tl.constexpr = 1, LOOP: tl.constexpr = False,
                 PDL: tl.constexpr = False):
    """C = A B over K in SPLITS sums (K / SPLITS each, a multiple of BK when
    SPLITS > 1). Split s is program (tile, s) of a 2-D grid, folded by
    ``_fold``, or with LOOP (many rows: the programs are plenty already) the
    program's own s-th pass, the sums added in registers."""
    pid = tl.program_id(0)
    grid_m = tl.cdiv(M, BM)
    grid_n = tl.cdiv(N, BN)
    width = GROUP_M * grid_n
    first_m = (pid // width) * GROUP_M
    size_m = tl.minimum(grid_m - first_m, GROUP_M)
    pm = first_m + (pid % width) % size_m
    pn = (pid % width) // size_m
    rm = pm * BM + tl.arange(0, BM)
    rn = pn * BN + tl.arange(0, BN)
    row_ok = rm < M
    # rows past M are masked (a one-row decode then fetches one row, not 64);
    # columns past N read a valid column again (never stored), mask-free
    bn = (rn % N).to(tl.int64)
    pdl_enter(PDL)
    rk = tl.arange(0, BK)
    a_ptr = A + rm[:, None].to(tl.int64) * s_am + rk[None, :] * s_ak
    b_ptr = B + rk[:, None] * s_bk + bn[None, :] * s_bn
    if SPLITS == 1:
        acc = tl.zeros([BM, BN], tl.float32)
        for k0 in range(0, K, BK):
            if EVEN_K:
                a = tl.load(a_ptr, mask=row_ok[:, None], other=0.0)
                b = tl.load(b_ptr)
            else:                        # zeros past K add +0 to every chain
                kk = k0 + rk
                a = tl.load(a_ptr, mask=row_ok[:, None] & (kk < K)[None, :], other=0.0)
                b = tl.load(b_ptr, mask=(kk < K)[:, None], other=0.0)
            acc = tl.dot(a, b, acc, input_precision=PREC)
            a_ptr += BK * s_ak
            b_ptr += BK * s_bk
        last = True
    elif LOOP:
        # the splits in turn, each from zero, their sums added in registers:
        # two accumulators, so a tile of at most 128 x 128 (``plan_16bit``)
        ks = K // SPLITS
        acc = tl.zeros([BM, BN], tl.float32)
        for s in tl.static_range(SPLITS):
            part, a_ptr, b_ptr = _split_sum(a_ptr, b_ptr, row_ok, ks, s_ak, s_bk, BM, BN, BK,
                                            PREC)
            if s == 0:                   # noqa: SIM108 (s is a constexpr: no select)
                acc = part
            else:                        # (sum 0 + sum 1) + ..., as _fold
                acc = acc + part
        last = True
    else:
        split = tl.program_id(1)
        ks = K // SPLITS
        acc, _, _ = _split_sum(a_ptr + split * ks * s_ak, b_ptr + split * ks * s_bk, row_ok,
                               ks, s_ak, s_bk, BM, BN, BK, PREC)
        acc, last = _fold(acc, PART, CNT, pid, split, tl.num_programs(0), SPLITS, BM, BN)
    if last:
        if HAS_BIAS:
            acc += tl.load(BIAS + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
        tl.store(C + rm[:, None].to(tl.int64) * s_cm + rn[None, :],
                 acc.to(C.dtype.element_ty), mask=row_ok[:, None] & (rn < N)[None, :])


@triton.jit(do_not_specialize=["M"])
def _gemm_tma_kernel(a_desc, b_desc, BIAS, C, M, N, K, s_cm, HAS_BIAS: tl.constexpr,
                     BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                     GROUP_M: tl.constexpr, NUM_SMS: tl.constexpr, PDL: tl.constexpr = False,
                     W_KN: tl.constexpr = False):
    """Persistent variant: each program walks tiles pid, pid + NUM_SMS, ... with
    the tensor-copy engine loading A [BM, BK] and the weight tile, [BN, BK] of
    an [N, K] matrix or with W_KN [BK, BN] of a [K, N] one (the engine's
    weights.py layout), zeros past the edges. The same K chain per output as
    ``_gemm_kernel``."""
    pdl_enter(PDL)
    grid_m = tl.cdiv(M, BM)
    grid_n = tl.cdiv(N, BN)
    width = GROUP_M * grid_n
    for tile in tl.range(tl.program_id(0), grid_m * grid_n, NUM_SMS):
        first_m = (tile // width) * GROUP_M
        size_m = tl.minimum(grid_m - first_m, GROUP_M)
        pm = first_m + (tile % width) % size_m
        pn = (tile % width) // size_m
        acc = tl.zeros([BM, BN], tl.float32)
        for k0 in range(0, K, BK):
            a = a_desc.load([pm * BM, k0])
            if W_KN:
                acc = tl.dot(a, b_desc.load([k0, pn * BN]), acc)
            else:
                acc = tl.dot(a, b_desc.load([pn * BN, k0]).T, acc)
        rm = pm * BM + tl.arange(0, BM)
        rn = pn * BN + tl.arange(0, BN)
        if HAS_BIAS:
            acc += tl.load(BIAS + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
        tl.store(C + rm[:, None].to(tl.int64) * s_cm + rn[None, :],
                 acc.to(C.dtype.element_ty), mask=(rm < M)[:, None] & (rn < N)[None, :])


@triton.jit
def _store_swap(acc, BIAS, C, M, N, s_cm, pn, pm, HAS_BIAS: tl.constexpr, BM: tl.constexpr,
                BN: tl.constexpr):
    """Epilogue of both weight-major kernels: ``acc`` [BN, BM] is tile (pn, pm) of
    C^T, so the bias runs down its rows and the store writes it back transposed.
    One copy, so the TMA variant (which the interpreter cannot run) keeps the
    epilogue the tested kernel has."""
    rn = pn * BN + tl.arange(0, BN)
    rm = pm * BM + tl.arange(0, BM)
    if HAS_BIAS:
        acc += tl.load(BIAS + rn, mask=rn < N, other=0.0).to(tl.float32)[:, None]
    tl.store(C + rm[None, :].to(tl.int64) * s_cm + rn[:, None],
             acc.to(C.dtype.element_ty), mask=(rm < M)[None, :] & (rn < N)[:, None])


@triton.jit(do_not_specialize=["M"])
def _gemm_swap_kernel(A, B, BIAS, C, PART, CNT, M, N, K, s_am, s_ak, s_bk, s_bn, s_cm,
                      HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr, BM: tl.constexpr,
                      BN: tl.constexpr, BK: tl.constexpr, PREC: tl.constexpr,
                      SPLITS: tl.constexpr = 1, PDL: tl.constexpr = False):
    """C^T = W^T A^T tile by tile: the weight panel [BN, BK] is the instruction's
    row operand and A^T [BK, BM] its column operand. Each output element is still
    one fp32 accumulator per K split advanced by the same 16-deep K steps from
    the split's start (the product of two numbers and the sum over 16 of them do
    not care which operand side they came from; tests/engine/test_gpu_invariant.py
    checks it); split s is program (pn, pm, s), folded by ``_fold``."""
    pn = tl.program_id(0)
    pm = tl.program_id(1)
    rn = pn * BN + tl.arange(0, BN)
    rm = pm * BM + tl.arange(0, BM)
    row_ok = rm < M
    bn = (rn % N).to(tl.int64)
    pdl_enter(PDL)
    rk = tl.arange(0, BK)
    w_ptr = B + bn[:, None] * s_bn + rk[None, :] * s_bk           # [BN, BK]
    x_ptr = A + rm[None, :].to(tl.int64) * s_am + rk[:, None] * s_ak  # [BK, BM]
    acc = tl.zeros([BN, BM], tl.float32)
    if SPLITS == 1:
        for k0 in range(0, K, BK):
            if EVEN_K:
                w = tl.load(w_ptr)
                x = tl.load(x_ptr, mask=row_ok[None, :], other=0.0)
            else:
                kk = k0 + rk
                w = tl.load(w_ptr, mask=(kk < K)[None, :], other=0.0)
                x = tl.load(x_ptr, mask=row_ok[None, :] & (kk < K)[:, None], other=0.0)
            acc = tl.dot(w, x, acc, input_precision=PREC)
            w_ptr += BK * s_bk
            x_ptr += BK * s_ak
        last = True
    else:
        split = tl.program_id(2)
        ks = K // SPLITS
        w_ptr += split * ks * s_bk
        x_ptr += split * ks * s_ak
        for _k0 in range(0, ks, BK):
            w = tl.load(w_ptr)
            x = tl.load(x_ptr, mask=row_ok[None, :], other=0.0)
            acc = tl.dot(w, x, acc, input_precision=PREC)
            w_ptr += BK * s_bk
            x_ptr += BK * s_ak
        tile = pn + pm * tl.num_programs(0)
        acc, last = _fold(acc, PART, CNT, tile, split, tl.num_programs(0) * tl.num_programs(1),
                          SPLITS, BN, BM)
    if last:
        _store_swap(acc, BIAS, C, M, N, s_cm, pn, pm, HAS_BIAS, BM, BN)


@triton.jit(do_not_specialize=["M"])
def _gemm_swap_tma_kernel(x_desc, w_desc, BIAS, C, M, N, K, s_cm, HAS_BIAS: tl.constexpr,
                          BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                          PDL: tl.constexpr = False, W_KN: tl.constexpr = False):
    """``_gemm_swap_kernel`` with the tensor-copy engine loading the weight panel
    (as ``_gemm_tma_kernel``: [BN, BK], or [BK, BN] with W_KN, used transposed)
    and the input rows [BM, BK] (zeros past the edges)."""
    pn = tl.program_id(0)
    pm = tl.program_id(1)
    pdl_enter(PDL)
    acc = tl.zeros([BN, BM], tl.float32)
    for k0 in range(0, K, BK):
        if W_KN:                         # noqa: SIM108 (a constexpr: one branch built)
            w = w_desc.load([k0, pn * BN]).T
        else:
            w = w_desc.load([pn * BN, k0])
        x = x_desc.load([pm * BM, k0])
        acc = tl.dot(w, x.T, acc)
    _store_swap(acc, BIAS, C, M, N, s_cm, pn, pm, HAS_BIAS, BM, BN)


def _sms(dev: torch.device) -> int:
    return torch.cuda.get_device_properties(dev).multi_processor_count if dev.type == "cuda" \
        else 4


def _linear_tma(x: torch.Tensor, w_t: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor,
                p: GemmPlan) -> None:
    from triton.tools.tensor_descriptor import TensorDescriptor

    m, k = x.shape
    n = w_t.shape[1]
    if x.stride(1) != 1:              # the copy engine reads rows of unit stride
        x = x.contiguous()
    a_desc = TensorDescriptor(x, [m, k], [x.stride(0), 1], [p.bm, p.bk])
    kn = w_t.stride(1) == 1           # weights.py's [K, N] rows; else an [N, K] matrix's view
    if kn:
        b_desc = TensorDescriptor(w_t, [k, n], [w_t.stride(0), 1], [p.bk, p.bn])
    elif w_t.stride(0) == 1:
        w = w_t.t()
        b_desc = TensorDescriptor(w, [n, k], [w.stride(0), 1], [p.bn, p.bk])
    else:
        raise ValueError("the TMA plan needs a weight of unit stride along K or N")
    b = bias.contiguous() if bias is not None else out
    extra = triton_pdl.opts()         # inside a decode graph's capture: PDL
    if p.swap:
        _gemm_swap_tma_kernel[(triton.cdiv(n, p.bn), triton.cdiv(m, p.bm))](
            a_desc, b_desc, b, out, m, n, k, out.stride(0), HAS_BIAS=bias is not None,
            BM=p.bm, BN=p.bn, BK=p.bk, num_warps=p.warps, num_stages=p.stages, W_KN=kn,
            **extra)
        return
    tiles = triton.cdiv(m, p.bm) * triton.cdiv(n, p.bn)
    sms = _sms(x.device)
    _gemm_tma_kernel[(min(sms, tiles),)](a_desc, b_desc, b, out, m, n, k, out.stride(0),
                                         HAS_BIAS=bias is not None, BM=p.bm, BN=p.bn, BK=p.bk,
                                         GROUP_M=p.group_m, NUM_SMS=sms, num_warps=p.warps,
                                         num_stages=p.stages, W_KN=kn, **extra)


# Split counters: one int32 a (tile, call), zero between calls (the last
# program of a tile resets its own). Each call takes the next unused range of
# its device's buffer, so calls in flight at once on two streams count apart.
_COUNTERS: dict[torch.device, list[object]] = {}
_COUNTER_SLOTS = 1 << 20


def _counters(dev: torch.device, n: int) -> torch.Tensor:
    if n > _COUNTER_SLOTS:
        raise ValueError(f"linear: {n} split tiles in one call, past {_COUNTER_SLOTS}")
    entry = _COUNTERS.get(dev)
    if entry is None:
        entry = _COUNTERS[dev] = [torch.zeros(_COUNTER_SLOTS, dtype=torch.int32, device=dev), 0]
    buf, at = entry
    assert isinstance(buf, torch.Tensor) and isinstance(at, int)
    if at + n > _COUNTER_SLOTS:
        at = 0
    entry[1] = at + n
    return buf[at:at + n]


# past this many rows a split GEMM loops over its splits in one program (the
# grid is large already) instead of a program a split
LOOP_ROWS = 64


def linear(x: torch.Tensor, w_t: torch.Tensor, bias: torch.Tensor | None = None,
           plan: GemmPlan | None = None, splits: int | None = None) -> torch.Tensor:
    """x: [M, K] @ w_t: [K, N] (+ bias [N]) -> [M, N] in x's dtype, fp32 accumulation.
    ``plan`` overrides the table (for engine/triton_tune.py), ``splits`` the
    weight's K split (``k_splits``; the CPU checks force one on tiny shapes)."""
    m, k = x.shape
    n = w_t.shape[1]
    if w_t.shape[0] != k:
        raise ValueError(f"linear: x has {k} columns, weight expects {w_t.shape[0]}")
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    sp = k_splits(x.dtype, n, k) if splits is None else splits
    p = plan or PLANS[x.dtype](m, n, sp, k=k)
    if sp > 1 and (k % (sp * p.bk) or p.persistent):
        raise ValueError(f"linear: K = {k} in {sp} splits does not suit plan {p}")
    if p.persistent:
        _linear_tma(x, w_t, bias, out, p)
        return out
    b = bias.contiguous() if bias is not None else out
    extra = triton_pdl.opts()         # inside a decode graph's capture: PDL
    grid_m, grid_n = triton.cdiv(m, p.bm), triton.cdiv(n, p.bn)
    loop = sp > 1 and m > LOOP_ROWS and not p.swap
    part, cnt = out, out              # not read without splits, nor with them in a loop
    if sp > 1 and not loop:
        tiles = grid_m * grid_n
        part = torch.empty(tiles * sp * p.bm * p.bn, dtype=torch.float32, device=x.device)
        cnt = _counters(x.device, tiles)
    if p.swap:
        _gemm_swap_kernel[(grid_n, grid_m, sp)](
            x, w_t, b, out, part, cnt, m, n, k, x.stride(0), x.stride(1), w_t.stride(0),
            w_t.stride(1), out.stride(0), HAS_BIAS=bias is not None, EVEN_K=k % p.bk == 0,
            BM=p.bm, BN=p.bn, BK=p.bk, PREC=_prec(x.dtype), SPLITS=sp, num_warps=p.warps,
            num_stages=p.stages, **extra)
        return out
    grid = (grid_m * grid_n, 1 if loop else sp)
    _gemm_kernel[grid](x, w_t, b, out, part, cnt, m, n, k, x.stride(0), x.stride(1),
                       w_t.stride(0), w_t.stride(1), out.stride(0), HAS_BIAS=bias is not None,
                       EVEN_K=k % p.bk == 0, BM=p.bm, BN=p.bn, BK=p.bk, GROUP_M=p.group_m,
                       PREC=_prec(x.dtype), SPLITS=sp, LOOP=loop, num_warps=p.warps,
                       num_stages=p.stages, **extra)
    return out
