"""Fused GPU kernels for the element-wise parts of a layer (Triton).

A decode step of a large model at small batch is bound by launches, not by
bytes: in plain torch one RMSNorm is 8 kernels, one RoPE 9, SwiGLU's gate 2,
about 38 per layer. Inside a CUDA graph each still costs a couple of
microseconds, about as much as the layer's GEMMs at batch 1. Here each is one
kernel; the arithmetic is the torch path's (statistics in fp32, one rounding to
the model dtype per output).

Only imported on CUDA (Triton is not a CPU dependency).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine import triton_pdl
from engine.triton_pdl import pdl_enter


@triton.jit
def _rms_norm_kernel(X, W, Y, s_x, s_y, n, eps, BLOCK: tl.constexpr,
                     PDL: tl.constexpr = False):
    pdl_enter(PDL)
    row = tl.program_id(0)
    i = tl.arange(0, BLOCK)
    mask = i < n
    x = tl.load(X + row * s_x + i, mask=mask, other=0.0).to(tl.float32)
    r = tl.rsqrt(tl.sum(x * x, 0) / n + eps)
    y = (x * r).to(Y.dtype.element_ty).to(tl.float32)
    w = tl.load(W + i, mask=mask, other=0.0).to(tl.float32)
    tl.store(Y + row * s_y + i, (w * y).to(Y.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # x: [M, hidden] -> [M, hidden]
    if x.stride(-1) != 1:
        x = x.contiguous()
    m, n = x.shape
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m:
        _rms_norm_kernel[(m,)](x, weight, y, x.stride(0), y.stride(0), n, eps,
                               BLOCK=triton.next_power_of_2(n), num_warps=8 if n >= 2048 else 4,
                               **triton_pdl.opts())
    return y


@triton.jit
def _add_rms_norm_kernel(X, D, W, XO, Y, s_x, s_d, s_xo, s_y, n, eps, BLOCK: tl.constexpr,
                         PDL: tl.constexpr = False):
    pdl_enter(PDL)
    row = tl.program_id(0)
    i = tl.arange(0, BLOCK)
    mask = i < n
    # the residual sum rounds to the model dtype first (what ``x + d`` stores),
    # then the statistic is _rms_norm_kernel's on that stored value
    s = (tl.load(X + row * s_x + i, mask=mask, other=0.0).to(tl.float32)
         + tl.load(D + row * s_d + i, mask=mask, other=0.0).to(tl.float32))
    s = s.to(XO.dtype.element_ty)
    tl.store(XO + row * s_xo + i, s, mask=mask)
    x = s.to(tl.float32)
    r = tl.rsqrt(tl.sum(x * x, 0) / n + eps)
    y = (x * r).to(Y.dtype.element_ty).to(tl.float32)
    w = tl.load(W + i, mask=mask, other=0.0).to(tl.float32)
    tl.store(Y + row * s_y + i, (w * y).to(Y.dtype.element_ty), mask=mask)


def add_rms_norm(x: torch.Tensor, d: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + d, rms_norm(x + d)) in one launch instead of two: the residual add of
    one sublayer and the norm that opens the next."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    if d.stride(-1) != 1:
        d = d.contiguous()
    m, n = x.shape
    xo = torch.empty(m, n, dtype=x.dtype, device=x.device)
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m:
        _add_rms_norm_kernel[(m,)](x, d, weight, xo, y, x.stride(0), d.stride(0), xo.stride(0),
                                   y.stride(0), n, eps, BLOCK=triton.next_power_of_2(n),
                                   num_warps=8 if n >= 2048 else 4, **triton_pdl.opts())
    return xo, y


@triton.jit
def _silu_mul_kernel(GU, Y, s_g, s_y, inter, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    pdl_enter(PDL)
    row = tl.program_id(0)
    i = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = i < inter
    g = tl.load(GU + row * s_g + i, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(GU + row * s_g + inter + i, mask=mask, other=0.0).to(tl.float32)
    s = (g / (1.0 + tl.exp(-g))).to(Y.dtype.element_ty).to(tl.float32)
    tl.store(Y + row * s_y + i, (s * u).to(Y.dtype.element_ty), mask=mask)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    # gate_up: [M, 2I] (gate columns, then up) -> [M, I]
    if gate_up.stride(-1) != 1:
        gate_up = gate_up.contiguous()
    m, two_i = gate_up.shape
    inter = two_i // 2
    y = torch.empty(m, inter, dtype=gate_up.dtype, device=gate_up.device)
    if m:
        block = 1024
        _silu_mul_kernel[(m, triton.cdiv(inter, block))](gate_up, y, gate_up.stride(0),
                                                        y.stride(0), inter, BLOCK=block,
                                                        **triton_pdl.opts())
    return y


@triton.jit
def _rope_kernel(X, POS, COS, SIN, Y, s_xm, s_xh, s_ym, s_yh, s_c,
                 HALF: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    pdl_enter(PDL)
    row = tl.program_id(0)
    head = tl.program_id(1)
    i = tl.arange(0, BLOCK)
    mask = i < HALF
    p = tl.load(POS + row)
    c = tl.load(COS + p * s_c + i, mask=mask, other=0.0).to(tl.float32)
    s = tl.load(SIN + p * s_c + i, mask=mask, other=0.0).to(tl.float32)
    base = X + row * s_xm + head * s_xh
    x1 = tl.load(base + i, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(base + HALF + i, mask=mask, other=0.0).to(tl.float32)
    out = Y + row * s_ym + head * s_yh
    tl.store(out + i, (x1 * c - x2 * s).to(Y.dtype.element_ty), mask=mask)
    tl.store(out + HALF + i, (x2 * c + x1 * s).to(Y.dtype.element_ty), mask=mask)


def rope(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
         sin: torch.Tensor) -> torch.Tensor:
    # x: [M, h, D] (unit stride in D); cos, sin: [P, D/2] -> [M, h, D]
    m, heads, d = x.shape
    y = torch.empty(m, heads, d, dtype=x.dtype, device=x.device)
    if m:
        half = d // 2
        _rope_kernel[(m, heads)](x, positions, cos, sin, y, x.stride(0), x.stride(1),
                                 y.stride(0), y.stride(1), cos.stride(0), HALF=half,
                                 BLOCK=triton.next_power_of_2(half), **triton_pdl.opts())
    return y
