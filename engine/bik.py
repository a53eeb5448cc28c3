"""Batch-invariant kernels: the CPU fp32 path of the model's matmuls, RMSNorm,
SwiGLU and attention (native/bik.c).

A row's result is one fixed sequence of IEEE operations on that row's inputs:
it does not depend on how many rows share the call (decode batch size, prefill
chunk length) or on the thread split. So with these kernels

- decode KV is bit-identical to prefill KV of the same tokens (no recompute
  before storing a turn's output blocks: they are canonical as computed);
- a restore may start at any block boundary, not only a chunk boundary;
- decode needs no fixed padded bucket (the old price of batch invariance: an
  8-row MKL GEMM streamed weights at about half the speed of a 1-row one).

The AVX-512, AVX2 and scalar paths give the same bytes, so blocks computed on
different CPUs of one deployment are interchangeable. ``KVSERVE_NO_NATIVE=1``
or a missing extension leaves the engine on its torch path (exactness then
comes from the fixed decode bucket and chunk-aligned restores, as before).
``KVSERVE_BIK_LIBRARY=<path to a _bik .so>`` loads another build of these
kernels (an older one, to measure a change side by side).
"""

from __future__ import annotations

import importlib.util
import math
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from types import ModuleType

import torch

_builds: dict[str, ModuleType] = {}


def _load_file(path: str) -> ModuleType:
    if path not in _builds:
        spec = importlib.util.spec_from_file_location("_bik", path)
        if spec is None or spec.loader is None:
            raise ImportError(f"{path} is not an extension module")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        _builds[path] = mod
    return _builds[path]


def _load() -> ModuleType | None:
    if os.environ.get("KVSERVE_NO_NATIVE", "") in ("1", "true", "yes"):
        return None
    # Another build of the same kernels (to time one build against another);
    # it must give the same bits, so KERNEL_ID holds.
    other = os.environ.get("KVSERVE_BIK_LIBRARY", "")
    if other:
        return _load_file(other)
    try:
        from native import _bik
    except ImportError:  # not built (no compiler at install time)
        return None
    return _bik


_ext: ModuleType | None = _load()

# Part of the model fingerprint: blocks from another kernel family never mix.
KERNEL_ID = "bik1"


def available() -> bool:
    return _ext is not None


def paths() -> tuple[str, ...]:
    """SIMD paths this CPU runs, slowest first (all give identical bits)."""
    return tuple(_ext.isas()) if _ext is not None else ()


def use_path(name: str) -> None:
    """Force a SIMD path (tests and benchmarks)."""
    _lib().set_isa(name)


def current_path() -> str:
    return str(_lib().isa())


def set_threads(n: int) -> None:
    _lib().set_threads(max(1, int(n)))


def threads() -> int:
    return int(_lib().threads())


@contextmanager
def build(path: str) -> Iterator[None]:
    """Runs the block on another build of these kernels (an older .so, timed
    against this one in alternation by benchmarks/bik.py), with the same
    thread count and SIMD path."""
    global _ext
    before = _lib()
    other = _load_file(path)
    other.set_threads(int(before.threads()))
    other.set_isa(str(before.isa()))
    _ext = other
    try:
        yield
    finally:
        _ext = before


def _lib() -> ModuleType:
    if _ext is None:
        raise RuntimeError("the batch-invariant kernels (native._bik) are not built")
    return _ext


@dataclass(frozen=True, slots=True)
class PackedWeight:
    """A [K, N] fp32 weight in 16-column panels (what the GEMM streams)."""

    data: torch.Tensor          # [ceil(N / 16) * K * 16] fp32
    k: int
    n: int


def pack(w_t: torch.Tensor) -> PackedWeight:
    # w_t: [K, N] (x @ w_t), any row stride, unit column stride
    if w_t.dtype != torch.float32 or w_t.device.type != "cpu" or w_t.dim() != 2:
        raise ValueError(f"pack needs a 2-D fp32 CPU tensor, got {w_t.dtype} {w_t.device}")
    if w_t.stride(1) != 1:
        w_t = w_t.contiguous()
    k, n = w_t.shape
    out = torch.empty(-(-n // 16) * k * 16, dtype=torch.float32)
    _lib().pack(w_t.data_ptr(), k, n, w_t.stride(0), out.data_ptr())
    return PackedWeight(out, k, n)


def _rows(x: torch.Tensor) -> torch.Tensor:
    if x.dtype != torch.float32 or x.dim() != 2:
        raise ValueError(f"expected a 2-D fp32 tensor, got {x.dim()}-D {x.dtype}")
    return x if x.stride(1) == 1 else x.contiguous()


def linear(x: torch.Tensor, w: PackedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    # x: [M, K] -> [M, N]
    x = _rows(x)
    m, k = x.shape
    if k != w.k:
        raise ValueError(f"linear: x has {k} columns, weight expects {w.k}")
    out = torch.empty(m, w.n, dtype=torch.float32)
    if m:
        b = 0 if bias is None else bias.contiguous().data_ptr()
        _lib().gemm(x.data_ptr(), x.stride(0), m, k, w.data.data_ptr(), w.n, b,
                    out.data_ptr(), w.n)
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x = _rows(x)
    m, n = x.shape
    out = torch.empty(m, n, dtype=torch.float32)
    if m:
        _lib().rmsnorm(x.data_ptr(), x.stride(0), m, n, weight.contiguous().data_ptr(),
                       float(eps), out.data_ptr(), n)
    return out


def add_rms_norm(x: torch.Tensor, d: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + d, rms_norm(x + d)) in one pass over the rows: the same bits as the
    add followed by ``rms_norm`` (one IEEE add per element), without the add's
    separate trip through memory and torch's thread pool."""
    x, d = _rows(x), _rows(d)
    if x.shape != d.shape:
        raise ValueError(f"add_rms_norm: x {tuple(x.shape)} and d {tuple(d.shape)} differ")
    m, n = x.shape
    total = torch.empty(m, n, dtype=torch.float32)
    out = torch.empty(m, n, dtype=torch.float32)
    if m:
        _lib().add_rmsnorm(x.data_ptr(), x.stride(0), d.data_ptr(), d.stride(0),
                           total.data_ptr(), n, m, n, weight.contiguous().data_ptr(),
                           float(eps), out.data_ptr(), n)
    return total, out


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    # gate_up: [M, 2I] (gate columns, then up) -> silu(gate) * up: [M, I]
    gu = _rows(gate_up)
    m, two_i = gu.shape
    inter = two_i // 2
    out = torch.empty(m, inter, dtype=torch.float32)
    if m:
        _lib().silu_mul(gu.data_ptr(), gu.stride(0), m, inter, out.data_ptr(), inter)
    return out


def rope(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
         sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding (half-split) of x: [M, h, D] (rows may be strided, heads
    contiguous) at positions: [M] over the fp32 tables cos, sin: [P, D/2];
    -> [M, h, D] contiguous, bit-identical to TorchKernels.rope."""
    m, h, d = x.shape
    if x.dtype != torch.float32 or x.stride(2) != 1 or x.stride(1) != d:
        x = x.contiguous()
    pos = positions.to(torch.int64).contiguous()
    if cos.dtype != torch.float32 or not cos.is_contiguous() or not sin.is_contiguous():
        raise ValueError("rope: cos and sin must be contiguous fp32 tables")
    if m and (int(pos.min()) < 0 or int(pos.max()) >= cos.shape[0]):
        raise ValueError(f"rope: positions outside the table of {cos.shape[0]}")
    out = torch.empty(m, h, d, dtype=torch.float32)
    if m:
        _lib().rope(x.data_ptr(), x.stride(0), m, h, d, pos.data_ptr(), cos.data_ptr(),
                    sin.data_ptr(), out.data_ptr())
    return out


@dataclass(frozen=True, slots=True)
class AttnSegment:
    row0: int                  # first query row of this sequence in the call
    rows: int
    q_start: int               # absolute position of its first row
    kv: torch.Tensor           # this layer's [2, Hkv, capacity, D] (the sequence's mirror)


def attend(q: torch.Tensor, segments: list[AttnSegment], kv_heads: int, window: int,
           out: torch.Tensor) -> None:
    """Causal (optionally sliding-window) attention of each segment's rows over
    its own keys [lo, p]; q: [M, H, D] (unit stride in D), out: [M, H * D]."""
    if not segments:
        return
    _, heads, d = q.shape
    if q.stride(2) != 1 or q.stride(1) != d:
        q = q.contiguous()
    meta, max_keys = [], 1
    for s in segments:
        kv = s.kv
        cap = kv.shape[2]
        if (kv.dtype != torch.float32 or not kv.is_contiguous() or kv.dim() != 4
                or kv.shape[1] != kv_heads or kv.shape[3] != d):
            raise ValueError("attend: every segment's KV must be a contiguous "
                             f"[2, {kv_heads}, capacity, {d}] fp32 tensor")
        end = s.q_start + s.rows
        if end > cap:
            raise ValueError(f"attend: keys up to {end} exceed the KV capacity {cap}")
        meta += [s.row0, s.rows, s.q_start, kv[0].data_ptr(), kv[1].data_ptr(),
                 cap * d]
        max_keys = max(max_keys, min(end, window) if window else end)
    seg_t = torch.tensor(meta, dtype=torch.int64)
    _lib().attend(q.data_ptr(), q.stride(0), heads, kv_heads, d, seg_t.data_ptr(),
                  len(segments), window, 1.0 / math.sqrt(d),
                  out.data_ptr(), out.stride(0), max_keys)


def paged() -> bool:
    """The loaded build reads keys through block tables (``PagedAttention``)."""
    return _ext is not None and hasattr(_ext, "attend_paged")


@dataclass(frozen=True, slots=True)
class PagedSegment:
    row0: int                  # first query row of this sequence in the call
    rows: int
    q_start: int               # absolute position of its first row
    table: torch.Tensor        # its block ids in the pool, int64 on the CPU


class PagedAttention:
    """One forward's attention straight from the paged pool, the way the CUDA
    kernels read it: no per-sequence contiguous copy of the KV.

    The copy cost more than the attention it fed: admitting a resend of a
    5.5k-token context gathered 250 MB into its mirror (0.21 s on one core,
    as long as computing its 60-token tail), and decode paid it again on adopt.
    The kernel reads row ``j`` of a sequence at ``table[j // B] * B + j % B``
    instead of ``j``; nothing else changes, so the bits equal the mirror's.

    Tables are checked once here (every key a segment reads lies in a block
    of the pool), not per layer: the kernel trusts them."""

    __slots__ = ("_ends", "_k0", "_layer_bytes", "_layers", "_max_keys", "_meta", "_nseg",
                 "_tables", "_v_bytes", "head_dim", "kv_heads")

    def __init__(self, pool: torch.Tensor, segments: list[PagedSegment]) -> None:
        # pool: [layers, 2, kv_heads, num_blocks, B, D] fp32, the engine's KVStorage.data
        if (pool.dtype != torch.float32 or pool.dim() != 6 or not pool.is_contiguous()
                or pool.device.type != "cpu"):
            raise ValueError("PagedAttention needs the contiguous 6-D fp32 CPU pool")
        layers, _, hkv, nb, b, d = pool.shape
        if b < 1 or b & (b - 1):
            raise ValueError(f"rows per block must be a power of two, got {b}")
        shift = b.bit_length() - 1
        meta: list[int] = []
        self._tables: list[torch.Tensor] = []        # kept alive for the kernel
        self._max_keys: dict[int, int] = {}
        ends = []
        for s in segments:
            end = s.q_start + s.rows
            need = -(-end // b)
            t = s.table
            if t.dtype != torch.int64 or t.dim() != 1 or t.device.type != "cpu":
                raise ValueError("a segment's block table must be a 1-D int64 CPU tensor")
            if t.numel() < need or s.rows < 1 or s.q_start < 0:
                raise ValueError(f"a segment reads keys up to {end} but its table has "
                                 f"{t.numel()} blocks of {b}")
            t = t[:need].contiguous()
            if need and (int(t.min()) < 0 or int(t.max()) >= nb):
                raise ValueError(f"a block table names a block outside the pool of {nb}")
            self._tables.append(t)
            meta += [s.row0, s.rows, s.q_start, 0, 0, nb * b * d, t.data_ptr(), shift]
            ends.append(end)
        self._ends: list[int] = ends
        self._meta = torch.tensor(meta, dtype=torch.int64).view(len(segments), 8)
        self._nseg = len(segments)
        esize = pool.element_size()
        self._k0 = pool.data_ptr()
        self._layer_bytes = pool.stride(0) * esize
        self._v_bytes = pool.stride(1) * esize
        self._layers = layers
        self.kv_heads, self.head_dim = hkv, d

    def __call__(self, layer: int, q: torch.Tensor, window: int, out: torch.Tensor) -> None:
        """Causal (optionally sliding-window) attention of one layer; q: [M, H, D],
        out: [M, H * D]."""
        if not self._nseg:
            return
        if not 0 <= layer < self._layers:
            raise ValueError(f"layer {layer} is not in the pool's {self._layers}")
        m, heads, d = q.shape
        if d != self.head_dim or q.dtype != torch.float32 or out.shape != (m, heads * d) \
                or out.stride(1) != 1:
            raise ValueError(f"attend: q must be [M, H, {self.head_dim}] fp32 and out "
                             f"[M, H * {self.head_dim}]")
        if q.stride(2) != 1 or q.stride(1) != d:
            q = q.contiguous()
        k = self._k0 + layer * self._layer_bytes
        self._meta[:, 3] = k
        self._meta[:, 4] = k + self._v_bytes
        max_keys = self._max_keys.get(window)
        if max_keys is None:
            max_keys = max([1, *(min(e, window) if window else e for e in self._ends)])
            self._max_keys[window] = max_keys
        _lib().attend_paged(q.data_ptr(), q.stride(0), heads, self.kv_heads, d,
                            self._meta.data_ptr(), self._nseg, window, 1.0 / math.sqrt(d),
                            out.data_ptr(), out.stride(0), max_keys)
