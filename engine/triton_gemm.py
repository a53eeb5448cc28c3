"""Batch-invariant GEMM on the GPU (Triton): a row's bits never depend on how
many rows share the call, yet each row count gets a tile that suits it.

What fixes a row's bits is the order of its reduction, not the tile: every
output element is one fp32 accumulator that the matrix units advance by the
same 16-deep K steps, K tile after K tile from k = 0, with no split-K and a K
tile (``BK``) that never changes. The tile's rows and columns (``BM``, ``BN``),
warps, pipeline stages and the order programs run in only decide *which*
elements a program computes and how fast, so the plan is chosen per row count:

- up to 64 rows (decode): one 64-row tile (the smallest the Hopper warpgroup
  matrix instruction takes) and narrow columns, so even one row launches about a
  GPU's worth of programs, each streaming its weight panel through a deep
  pipeline (decode is bound by reading the weights);
- up to 512 rows: 128 x 128 tiles, 8 warps;
- more (prefill chunks): 128 x 256 tiles, 8 warps, 3 stages, programs grouped so
  neighbours share the A rows in L2 (what the Triton matmul tutorial found
  fastest on Hopper).

Every 16-bit plan keeps the matrix units on one instruction family (warpgroup
MMA: 64-row multiples, warps along M only, so a row's accumulator never spans
two warps' shuffles), which is what makes the plans agree bit for bit; that is
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

BK = 64                       # the K tile: part of the arithmetic (triton_invariant.KERNEL_ID)


@dataclass(frozen=True, slots=True)
class GemmPlan:
    bm: int
    bn: int
    warps: int
    stages: int
    group_m: int = 8          # programs of GROUP_M row tiles walk N together (L2 reuse)
    persistent: bool = False  # one program per SM looping over tiles, TMA loads (16-bit)

    def __post_init__(self) -> None:
        if self.bm % 64 or self.warps % 4 or self.bm // 16 < self.warps:
            # fewer than 16 rows per warp would put warps along N (a row split
            # across warps) or off the warpgroup instruction
            raise ValueError(f"GEMM plan {self} leaves the warpgroup MMA layout")


def _decode_bn(n: int) -> int:
    """Narrow columns for narrow weights: about one program per SM at one row."""
    return 128 if n >= 128 * 128 else 64 if n >= 64 * 128 else 32


def plan_16bit(m: int, n: int) -> GemmPlan:
    if m <= 64:
        bn = _decode_bn(n)
        return GemmPlan(64, bn, 4, 4 if bn == 128 else 6)
    if m <= 512:
        return GemmPlan(128, 128, 8, 4)
    return GemmPlan(128, 256, 8, 3)


def plan_fp32(m: int, n: int) -> GemmPlan:
    # one plan for every M, as measured invariant on the H200 (engine.md)
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
                 PREC: tl.constexpr):
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
    a_desc = TensorDescriptor(x, [m, k], [x.stride(0), 1], [p.bm, BK])
    b_desc = TensorDescriptor(w, [n, k], [w.stride(0), 1], [p.bn, BK])
    tiles = triton.cdiv(m, p.bm) * triton.cdiv(n, p.bn)
    sms = _sms(x.device)
    b = bias.contiguous() if bias is not None else out
    _gemm_tma_kernel[(min(sms, tiles),)](a_desc, b_desc, b, out, m, n, k, out.stride(0),
                                         HAS_BIAS=bias is not None, BM=p.bm, BN=p.bn, BK=BK,
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
    grid = (triton.cdiv(m, p.bm) * triton.cdiv(n, p.bn),)
    b = bias.contiguous() if bias is not None else out
    _gemm_kernel[grid](x, w_t, b, out, m, n, k, x.stride(0), x.stride(1), w_t.stride(0),
                       w_t.stride(1), out.stride(0), HAS_BIAS=bias is not None,
                       EVEN_K=k % BK == 0, BM=p.bm, BN=p.bn, BK=BK, GROUP_M=p.group_m,
                       PREC=_prec(x.dtype), num_warps=p.warps, num_stages=p.stages)
    return out
