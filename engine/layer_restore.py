"""Layer-wise pipelined restores on CUDA.

A restored prefix arrives block-major (``[n, layers, 2, kv_heads, B, D]``, the
warehouse's layout) in pinned host memory. Copying all of it before the
suffix's prefill starts puts the whole PCIe transfer in front of the compute.
Instead, layer ``l`` of every restored block is copied on a side stream (one
strided 2-D DMA per run of consecutive blocks: ``cudaMemcpy2DAsync`` with the
block as the source pitch) and marked with an event; the suffix's forward
waits for layer ``l``'s event only when its attention for layer ``l`` is
about to read the prefix, so the copy of layer ``l + 1`` runs under layer
``l``'s compute. torch has no strided host-to-device copy (a non-contiguous
pinned source is staged through pageable memory on the CPU), hence the one
cudart call through ctypes.

Where a feed cannot run (no CUDA, a source that is not pinned, no cudart
found) the engine imports the blocks in one copy before computing, as before:
the bits are the same either way, only the timing differs.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from dataclasses import dataclass

import torch

from engine.errors import DeviceError
from engine.kv_pool import KVStorage

log = logging.getLogger(__name__)

_H2D = 1                      # cudaMemcpyHostToDevice


@dataclass(frozen=True, slots=True)
class HostRuns:
    """Restored blocks in pinned host memory as runs of consecutive blocks, in
    prompt order (e.g. adjacent slots of a pinned arena), each run a
    contiguous ``[k, layers, 2, kv_heads, B, D]`` tensor: the restore copies
    from them directly, no host-side gather into one tensor first."""

    runs: tuple[torch.Tensor, ...]

    def __post_init__(self) -> None:
        if not self.runs:
            raise ValueError("HostRuns needs at least one run")
        first = self.runs[0]
        for r in self.runs:
            if r.device.type != "cpu" or not r.is_contiguous() or r.dim() != 6:
                raise ValueError("each run must be a contiguous [k, L, 2, H, B, D] host tensor")
            if r.shape[1:] != first.shape[1:] or r.dtype != first.dtype:
                raise ValueError("runs differ in block shape or dtype")

    @property
    def n_blocks(self) -> int:
        return sum(int(r.shape[0]) for r in self.runs)

    @property
    def block_shape(self) -> tuple[int, ...]:
        return tuple(self.runs[0].shape[1:])

    @property
    def dtype(self) -> torch.dtype:
        return self.runs[0].dtype

    def head(self, n: int) -> HostRuns:
        """The first ``n`` blocks."""
        out, left = [], n
        for r in self.runs:
            if left <= 0:
                break
            out.append(r[:left])
            left -= int(out[-1].shape[0])
        return HostRuns(tuple(out))

    def skip(self, n: int) -> HostRuns:
        """All but the first ``n`` blocks (at least one must be left)."""
        out, left = [], n
        for r in self.runs:
            k = int(r.shape[0])
            if left >= k:
                left -= k
                continue
            out.append(r[left:])
            left = 0
        return HostRuns(tuple(out))

    def cat(self) -> torch.Tensor:
        return self.runs[0] if len(self.runs) == 1 else torch.cat(self.runs)


@functools.cache
def _memcpy2d() -> object | None:
    """cudaMemcpy2DAsync from the cudart torch loaded, or None."""
    torch.cuda.init()
    names = []
    try:
        with open("/proc/self/maps") as maps:
            names = sorted({line.split()[-1] for line in maps if "libcudart.so" in line})
    except OSError:
        pass
    for name in (*names, "libcudart.so.13", "libcudart.so.12", "libcudart.so"):
        try:
            lib = ctypes.CDLL(name)
            fn = lib.cudaMemcpy2DAsync
        except (OSError, AttributeError):
            continue
        fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_size_t,
                       ctypes.c_size_t, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
        fn.restype = ctypes.c_int
        return fn
    log.warning("libcudart not found: restores are copied before the prefill, not per layer")
    return None


def feed_applies(device: torch.device, restored: torch.Tensor | HostRuns) -> bool:
    if device.type != "cuda":
        return False
    # HostRuns are host and contiguous by construction and pinned by their contract
    # (views of a cudaHostRegister'ed arena); a plain tensor is checked, since a
    # pageable source would make every copy synchronous.
    if isinstance(restored, torch.Tensor) and not (
            restored.device.type == "cpu" and restored.is_contiguous() and restored.is_pinned()):
        return False
    return _memcpy2d() is not None


class LayerFeed:
    """Restored blocks into the pool (and the sequence's mirror) one layer at a
    time. ``start`` queues every layer's copy; ``ready(l)`` is called before
    layer ``l``'s attention; ``close`` after the prefill, success or not."""

    def __init__(self, storage: KVStorage, block_ids: torch.Tensor,
                 restored: torch.Tensor | HostRuns, mirror: torch.Tensor,
                 token_lo: int) -> None:
        self.storage, self.block_ids, self.mirror = storage, block_ids, mirror
        self.token_lo = token_lo
        layout = storage.layout
        self.n = int(block_ids.numel())
        src = restored if isinstance(restored, HostRuns) else HostRuns((restored,))
        self.runs = src.head(self.n).runs
        L = layout.layers
        self.staging = torch.empty((L, self.n, *layout.block_shape[1:]),
                                   dtype=layout.torch_dtype, device=storage.device)
        self.side = torch.cuda.Stream(device=storage.device)
        self.events = [torch.cuda.Event() for _ in range(L)]
        self.done = [False] * L

    def start(self) -> LayerFeed:
        fn = _memcpy2d()
        assert fn is not None
        L = len(self.events)
        elt = self.staging.element_size()
        width = self.staging[0, 0].numel() * elt        # one layer of one block, bytes
        self.side.wait_stream(torch.cuda.current_stream(self.storage.device))
        self.staging.record_stream(self.side)
        handle = ctypes.c_void_p(self.side.cuda_stream)
        for layer in range(L):
            dst = self.staging[layer]
            row = 0
            for run in self.runs:
                k = int(run.shape[0])
                err = fn(ctypes.c_void_p(dst[row].data_ptr()), width,
                         ctypes.c_void_p(run[0, layer].data_ptr()), run[0].numel() * elt,
                         width, k, _H2D, handle)
                if err:
                    raise DeviceError(f"cudaMemcpy2DAsync failed with cuda error {err}")
                row += k
            self.events[layer].record(self.side)
        return self

    def ready(self, layer: int) -> None:
        if self.done[layer]:
            return
        torch.cuda.current_stream(self.storage.device).wait_event(self.events[layer])
        kv = self.staging[layer].permute(1, 2, 0, 3, 4)          # [2, H, n, B, D]
        self.storage.data[layer].index_copy_(2, self.block_ids, kv)
        if self.mirror.shape[3]:            # empty where attention reads the pool
            B = self.storage.layout.block_tokens
            lo, hi = self.token_lo, self.token_lo + self.n * B
            two, H, _, D = self.mirror.shape[1:]
            self.mirror[layer, :, :, lo:hi].view(two, H, self.n, B, D).copy_(kv)
        self.done[layer] = True

    def finish(self) -> None:
        for layer in range(len(self.done)):
            self.ready(layer)

    def close(self) -> None:
        # The host source must outlive the copies reading it: wait for them.
        self.side.synchronize()
