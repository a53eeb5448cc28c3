"""Kernel families the model runs on, chosen by name (``EngineConfig.kernels``).

- ``torch``: plain torch ops (MKL/oneDNN on CPU, cuBLAS/flash on CUDA). A row's
  bits depend on how many rows share a GEMM, so the runner keeps exactness with
  a fixed decode bucket and chunk-aligned restores.
- ``bik``: the batch-invariant CPU fp32 kernels of engine/bik.py. A row's bits
  depend on that row alone: decode KV equals prefill KV, restores start at any
  block boundary, and decode runs exactly as many rows as it has sequences.
- ``triton``: CUDA; torch GEMMs plus fused Triton RMSNorm, RoPE and SwiGLU
  (engine/triton_kernels.py), one kernel each instead of 8, 9 and 2.
- ``triton_bi``: CUDA; the batch-invariant GPU family
  (engine/triton_invariant.py): Triton GEMM and attention whose per-row bits do
  not depend on M, plus ``triton``'s RMSNorm, RoPE and SwiGLU. What ``bik`` gives
  on the CPU.
- ``auto`` (the default): ``bik`` where it applies (CPU, fp32, extension built);
  on CUDA with Triton ``triton_bi`` once its measured cost against ``triton``
  (``TRITON_BI_COST``) is within ``AUTO_MAX_COST``, else ``triton``; else ``torch``.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F

from engine import bik
from engine.config import KERNEL_NAMES
from engine.errors import ModelConfigError

# triton_bi's cost against triton on the H200 for THIS kernel version (KERNEL_ID):
# 1 - the worst same-run ratio of llama-8b-shape bf16 prefill at 4k/16k/32k and
# decode at b1/8/64 (python3 -m benchmarks.kernels --model llama-8b-shape;
# docs/bench-notes/h6-gpu.md). None: not measured yet, so ``auto`` keeps triton.
# 0.077: tbi4 (row sums on the matrix unit, keys-major decode programs), the
# worst of three runs on 2026-12-02 (0.065 and 0.062 in the other two; the
# worst ratio each time prefill 32k: 0.923, 0.935, 0.938; docs/BENCHMARKS.md
# issue 21). tbi3 measured 0.081 and 0.083 alternated with the last two.
TRITON_BI_COST: float | None = 0.077
AUTO_MAX_COST = 0.10        # issue 21: exactness is the default when it costs <= 10 %


def cuda_auto(cost: float | None = TRITON_BI_COST) -> str:
    """The family ``auto`` picks on CUDA, given triton_bi's measured cost."""
    return "triton_bi" if cost is not None and cost <= AUTO_MAX_COST else "triton"


class Kernels(Protocol):
    name: str
    invariant: bool         # per-row results independent of the rows sharing a call

    def linear(self, x: torch.Tensor, w_t: torch.Tensor,
               bias: torch.Tensor | None = None) -> torch.Tensor: ...

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor: ...

    def add_rms_norm(self, x: torch.Tensor, d: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]: ...

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor: ...

    def rope(self, x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
             sin: torch.Tensor) -> torch.Tensor: ...


class TorchKernels:
    name = "torch"
    invariant = False

    def linear(self, x: torch.Tensor, w_t: torch.Tensor,
               bias: torch.Tensor | None = None) -> torch.Tensor:
        # x: [M, in] @ w_t: [in, out] -> [M, out]
        return torch.mm(x, w_t) if bias is None else torch.addmm(bias, x, w_t)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        # x: [M, hidden]; the statistic is taken in fp32 whatever the model dtype.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        return weight * xf.to(x.dtype)

    def add_rms_norm(self, x: torch.Tensor, d: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        # the residual add, then the next sublayer's norm: (x + d, norm(x + d))
        x = x + d
        return x, self.rms_norm(x, weight, eps)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    def rope(self, x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
             sin: torch.Tensor) -> torch.Tensor:
        # x: [M, h, D] (half-split "rotate_half" convention, as in HF Llama);
        # element-wise, so batch-invariant as it is.
        c = cos[positions].unsqueeze(1)                     # [M, 1, D/2]
        s = sin[positions].unsqueeze(1)
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)


class TritonKernels(TorchKernels):
    name = "triton"
    invariant = False

    def __init__(self) -> None:
        from engine import triton_kernels
        self._t = triton_kernels

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return self._t.rms_norm(x, weight, eps)

    def add_rms_norm(self, x: torch.Tensor, d: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        return self._t.add_rms_norm(x, d, weight, eps)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return self._t.silu_mul(gate_up)

    def rope(self, x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
             sin: torch.Tensor) -> torch.Tensor:
        return self._t.rope(x, positions, cos, sin)


class TritonBIKernels(TritonKernels):
    """``triton``'s fused element-wise kernels (RMSNorm is one program per row with
    a reduction fixed by the hidden size alone) plus an M-independent GEMM."""

    invariant = True

    def __init__(self) -> None:
        super().__init__()
        from engine import triton_invariant
        self._ti = triton_invariant
        self.name = triton_invariant.KERNEL_ID

    def linear(self, x: torch.Tensor, w_t: torch.Tensor,
               bias: torch.Tensor | None = None) -> torch.Tensor:
        return self._ti.linear(x, w_t, bias)


class BIKernels(TorchKernels):
    """Packs every weight once (keyed by the tensor's storage) on first use."""

    name = bik.KERNEL_ID
    invariant = True

    def __init__(self, threads: int) -> None:
        bik.set_threads(threads or torch.get_num_threads())
        # id -> (the tensor, kept alive so the id stays unique; its packed panels)
        self._packed: dict[int, tuple[torch.Tensor, bik.PackedWeight]] = {}

    def prepare(self, tensors: list[torch.Tensor]) -> None:
        for t in tensors:
            if t.dim() == 2:
                self._pack(t)

    def _pack(self, w_t: torch.Tensor) -> bik.PackedWeight:
        hit = self._packed.get(id(w_t))
        if hit is None or hit[0] is not w_t:
            hit = (w_t, bik.pack(w_t))
            self._packed[id(w_t)] = hit
        return hit[1]

    def linear(self, x: torch.Tensor, w_t: torch.Tensor,
               bias: torch.Tensor | None = None) -> torch.Tensor:
        return bik.linear(x, self._pack(w_t), bias)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return bik.rms_norm(x, weight, eps)

    def add_rms_norm(self, x: torch.Tensor, d: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        return bik.add_rms_norm(x, d, weight, eps)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return bik.silu_mul(gate_up)

    def rope(self, x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
             sin: torch.Tensor) -> torch.Tensor:
        # One pass in C, the same operations as the torch version (same bits); the
        # torch one made six temporaries and took a fifth of a 1.5k-token prefill.
        return bik.rope(x, positions, cos, sin)




def bik_applies(device: torch.device, dtype: torch.dtype) -> str | None:
    """None when the batch-invariant kernels can run here, else why not."""
    if device.type != "cpu":
        return f"they run on the CPU only (device is {device})"
    if dtype != torch.float32:
        return f"they are fp32 only (dtype is {dtype})"
    if not bik.available():
        return "native._bik is not built (or KVSERVE_NO_NATIVE=1)"
    return None


def triton_applies(device: torch.device) -> str | None:
    if device.type != "cuda":
        return f"they run on CUDA only (device is {device})"
    try:
        import triton  # noqa: F401
    except ImportError:
        return "Triton is not installed"
    return None


def select_kernels(name: str, device: torch.device, dtype: torch.dtype,
                   threads: int) -> Kernels:
    if name not in KERNEL_NAMES:
        raise ModelConfigError(f"kernels must be one of {KERNEL_NAMES}, got {name!r}")
    checks = {"bik": lambda: bik_applies(device, dtype), "triton": lambda: triton_applies(device),
              "triton_bi": lambda: triton_applies(device)}
    if name in checks and (why_not := checks[name]()):
        raise ModelConfigError(f"kernels {name!r} requested but {why_not}")
    if name == "auto":
        name = next((k for k in ("bik", "triton") if checks[k]() is None), "torch")
        if name == "triton":
            name = cuda_auto()
    makers = {"torch": TorchKernels, "triton": TritonKernels, "triton_bi": TritonBIKernels,
              "bik": lambda: BIKernels(threads)}
    return makers[name]()
