"""Batch-invariant GEMM on the GPU (Triton): a row's bits never depend on how
many rows share the call, yet each row count gets a tile that suits it.

What fixes a row's bits is the order of its reduction, not the tile: every
output element is one fp32 accumulator that the matrix units advance by the
same 16-deep K steps, in order from k = 0, with no split-K. The tile's rows and
columns (``BM``, ``BN``), which operand side of the instruction the weight
takes, how many K steps one pipeline stage loads (a multiple of ``BK``), warps,
stages and the order programs run in only decide *which* elements a program
computes and how fast, so the plan is chosen per row count:

- up to 64 rows (decode, bound by reading the weights): weight-major tiles
  (``swap``: the instruction's 64-row side walks the weight's columns, its
  narrow side the 16 or 32 input rows) or 64-row tiles with 128-deep K stages,
  each program streaming its weight panel through a deep pipeline;
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
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from engine import triton_pdl
from engine.triton_pdl import pdl_enter

BK = 64                       # the K tile: part of the arithmetic (triton_invariant.KERNEL_ID)


@dataclass(frozen=True, slots=True)
class GemmPlan:
    bm: int
    bn: int
    warps: int
    stages: int
    group_m: int = 8          # programs of GROUP_M row tiles walk N together (L2 reuse)
    persistent: bool = False  # one program per SM looping over tiles, TMA loads (16-bit)
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


# 33-64 rows on outputs narrower than 16,384 columns (qkv, o, down at b64): 64-96
# programs at 2.9 TB/s on the H200, yet 64 x 32 and 64 x 16 tiles (more programs)
# measured slower in the engine's b64 graph, each program re-reading the 64 input
# rows from L2 (docs/benchmarks-history.md, dependent launches in the decode graphs)
NARROW_64 = GemmPlan(64, 64, 4, 6, bk=128)


def x_tile(m: int) -> int:
    """The input-row side of a weight-major tile: 16, 32 or 64 rows."""
    return 16 if m <= 16 else 32 if m <= 32 else 64


def plan_16bit(m: int, n: int) -> GemmPlan:
    if m <= 64:
        # Decode streams the weights. Up to 32 rows: weight-major tiles, whose
        # 16- or 32-row input side wastes little matrix work, and on narrow
        # outputs (few programs, each a long panel) a 10-stage pipeline to keep
        # enough of the weight in flight. 33-64 rows: 64-row tiles with 128-deep
        # K stages. (engine/triton_tune.py ``decode`` and the engine's decode on
        # the H200, llama-8b shapes; all bit-identical, as the tests check.)
        if n >= 128 * 128:
            return GemmPlan(x_tile(m), 128, 4, 4, swap=True)
        if m <= 32:
            return GemmPlan(x_tile(m), 64, 4, 10, swap=True)
        return NARROW_64
    if m <= 512:
        return GemmPlan(128, 128, 8, 4)
    return GemmPlan(128, 256, 8, 3)


def plan_fp32(m: int, n: int) -> GemmPlan:
    # one plan for every M, as measured invariant on the H200 (engine.md); a
    # weight-major 16-row tile at decode M was bit-identical too but no faster
    # (docs/BENCHMARKS.md, issue 21)
    return GemmPlan(64, _decode_bn(n), 4, 4)


PlanFn = Callable[[int, int], GemmPlan]
# by dtype; engine/triton_tune.py swaps in candidates to time them
PLANS: dict[torch.dtype, PlanFn] = {torch.bfloat16: plan_16bit, torch.float16: plan_16bit,
                                    torch.float32: plan_fp32}


def _prec(dtype: torch.dtype) -> str:
    # fp32 models stay fp32 (Triton's default for an fp32 dot is tf32)
    return "ieee" if dtype == torch.float32 else "tf32"


# M is not specialised: Triton would compile another binary for M == 1 or
# M % 16 == 0, and nothing is gained.
@triton.jit(do_not_specialize=["M"])
def _gemm_kernel(A, B, BIAS, C, M, N, K, s_am, s_ak, s_bk, s_bn, s_cm,
                 HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr, BM: tl.constexpr,
                 BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
                 PREC: tl.constexpr, PDL: tl.constexpr = False):
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
    if HAS_BIAS:
        acc += tl.load(BIAS + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    tl.store(C + rm[:, None].to(tl.int64) * s_cm + rn[None, :],
             acc.to(C.dtype.element_ty), mask=row_ok[:, None] & (rn < N)[None, :])


@triton.jit(do_not_specialize=["M"])
def _gemm_tma_kernel(a_desc, b_desc, BIAS, C, M, N, K, s_cm, HAS_BIAS: tl.constexpr,
                     BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                     GROUP_M: tl.constexpr, NUM_SMS: tl.constexpr):
    """Persistent variant: each program walks tiles pid, pid + NUM_SMS, ... with
    the tensor-copy engine loading A [BM, BK] and the weight [BN, BK] (zeros
    past the edges). The same K chain per output as ``_gemm_kernel``."""
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
            b = b_desc.load([pn * BN, k0])
            acc = tl.dot(a, b.T, acc)
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
def _gemm_swap_kernel(A, B, BIAS, C, M, N, K, s_am, s_ak, s_bk, s_bn, s_cm,
                      HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr, BM: tl.constexpr,
                      BN: tl.constexpr, BK: tl.constexpr, PREC: tl.constexpr,
                      PDL: tl.constexpr = False):
    """C^T = W^T A^T tile by tile: the weight panel [BN, BK] is the instruction's
    row operand and A^T [BK, BM] its column operand. Each output element is still
    one fp32 accumulator advanced by the same 16-deep K steps from k = 0 (the
    product of two numbers and the sum over 16 of them do not care which operand
    side they came from; tests/engine/test_gpu_invariant.py checks it)."""
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
    _store_swap(acc, BIAS, C, M, N, s_cm, pn, pm, HAS_BIAS, BM, BN)


@triton.jit(do_not_specialize=["M"])
def _gemm_swap_tma_kernel(x_desc, w_desc, BIAS, C, M, N, K, s_cm, HAS_BIAS: tl.constexpr,
                          BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """``_gemm_swap_kernel`` with the tensor-copy engine loading the weight panel
    [BN, BK] and the input rows [BM, BK] (zeros past the edges)."""
    pn = tl.program_id(0)
    pm = tl.program_id(1)
    acc = tl.zeros([BN, BM], tl.float32)
    for k0 in range(0, K, BK):
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
    w = w_t.t()                                    # [N, K], unit stride in K (weights.py)
    if x.stride(1) != 1 or w.stride(1) != 1:
        raise ValueError("the TMA plan needs unit stride along K")
    a_desc = TensorDescriptor(x, [m, k], [x.stride(0), 1], [p.bm, p.bk])
    b_desc = TensorDescriptor(w, [n, k], [w.stride(0), 1], [p.bn, p.bk])
    b = bias.contiguous() if bias is not None else out
    if p.swap:
        _gemm_swap_tma_kernel[(triton.cdiv(n, p.bn), triton.cdiv(m, p.bm))](
            a_desc, b_desc, b, out, m, n, k, out.stride(0), HAS_BIAS=bias is not None,
            BM=p.bm, BN=p.bn, BK=p.bk, num_warps=p.warps, num_stages=p.stages)
        return
    tiles = triton.cdiv(m, p.bm) * triton.cdiv(n, p.bn)
    sms = _sms(x.device)
    _gemm_tma_kernel[(min(sms, tiles),)](a_desc, b_desc, b, out, m, n, k, out.stride(0),
                                         HAS_BIAS=bias is not None, BM=p.bm, BN=p.bn, BK=p.bk,
                                         GROUP_M=p.group_m, NUM_SMS=sms, num_warps=p.warps,
                                         num_stages=p.stages)


def linear(x: torch.Tensor, w_t: torch.Tensor, bias: torch.Tensor | None = None,
           plan: GemmPlan | None = None) -> torch.Tensor:
    """x: [M, K] @ w_t: [K, N] (+ bias [N]) -> [M, N] in x's dtype, fp32 accumulation.
    ``plan`` overrides the table (for engine/triton_tune.py)."""
    m, k = x.shape
    n = w_t.shape[1]
    if w_t.shape[0] != k:
        raise ValueError(f"linear: x has {k} columns, weight expects {w_t.shape[0]}")
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    p = plan or PLANS[x.dtype](m, n)
    if p.persistent:
        _linear_tma(x, w_t, bias, out, p)
        return out
    b = bias.contiguous() if bias is not None else out
    extra = triton_pdl.opts()         # inside a decode graph's capture: PDL
    if p.swap:
        _gemm_swap_kernel[(triton.cdiv(n, p.bn), triton.cdiv(m, p.bm))](
            x, w_t, b, out, m, n, k, x.stride(0), x.stride(1), w_t.stride(0), w_t.stride(1),
            out.stride(0), HAS_BIAS=bias is not None, EVEN_K=k % p.bk == 0, BM=p.bm, BN=p.bn,
            BK=p.bk, PREC=_prec(x.dtype), num_warps=p.warps, num_stages=p.stages, **extra)
        return out
    grid = (triton.cdiv(m, p.bm) * triton.cdiv(n, p.bn),)
    _gemm_kernel[grid](x, w_t, b, out, m, n, k, x.stride(0), x.stride(1), w_t.stride(0),
                       w_t.stride(1), out.stride(0), HAS_BIAS=bias is not None,
                       EVEN_K=k % p.bk == 0, BM=p.bm, BN=p.bn, BK=p.bk, GROUP_M=p.group_m,
                       PREC=_prec(x.dtype), num_warps=p.warps, num_stages=p.stages, **extra)
    return out
