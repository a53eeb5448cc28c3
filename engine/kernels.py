"""Kernel families the model runs on, chosen by name (``EngineConfig.kernels``).

- ``torch``: plain torch ops (MKL/oneDNN on CPU, cuBLAS/flash on CUDA). A row's
  bits depend on how many rows share a GEMM, so the runner keeps exactness with
  a fixed decode bucket and chunk-aligned restores.
- ``bik``: the batch-invariant CPU fp32 kernels of engine/bik.py. A row's bits
  depend on that row alone: decode KV equals prefill KV, restores start at any
  block boundary, and decode runs exactly as many rows as it has sequences.
- ``auto`` (the default): ``bik`` where it applies (CPU, fp32, extension built),
  else ``torch``.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F

from engine import bik
from engine.config import KERNEL_NAMES
from engine.errors import ModelConfigError


class Kernels(Protocol):
    name: str
    invariant: bool         # per-row results independent of the rows sharing a call

    def linear(self, x: torch.Tensor, w_t: torch.Tensor,
               bias: torch.Tensor | None = None) -> torch.Tensor: ...

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor: ...

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor: ...


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

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up


class BIKernels:
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

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return bik.silu_mul(gate_up)




def bik_applies(device: torch.device, dtype: torch.dtype) -> str | None:
    """None when the batch-invariant kernels can run here, else why not."""
    if device.type != "cpu":
        return f"they run on the CPU only (device is {device})"
    if dtype != torch.float32:
        return f"they are fp32 only (dtype is {dtype})"
    if not bik.available():
        return "native._bik is not built (or KVSERVE_NO_NATIVE=1)"
    return None


def select_kernels(name: str, device: torch.device, dtype: torch.dtype,
                   threads: int) -> Kernels:
    if name not in KERNEL_NAMES:
        raise ModelConfigError(f"kernels must be one of {KERNEL_NAMES}, got {name!r}")
    why_not = bik_applies(device, dtype)
    if name == "bik" and why_not:
        raise ModelConfigError(f"kernels 'bik' requested but {why_not}")
    if name == "torch" or why_not:
        return TorchKernels()
    return BIKernels(threads)
