"""The paged KV pool: block storage (one tensor) and block accounting with the
G1 local prefix cache.

Storage is ONE tensor ``[layers, 2, kv_heads, num_blocks, block_tokens, head_dim]``:
- a sequence's KV for all layers comes out with one ``index_select`` as
  ``[layers, 2, kv_heads, n * block_tokens, head_dim]`` (to fill its mirror);
- export is one gather of a permuted view into the documented block tensor
  ``[n_blocks, layers, 2, kv_heads, block_tokens, head_dim]`` and import one
  ``index_copy_`` scatter: never a per-block copy loop (84x slower on a GPU).

Accounting follows vLLM's BlockPool: blocks are refcounted; a full block whose
KV is canonical can be cached under its chain key; cached blocks nobody
references wait in an LRU and are evicted only when the free list is empty.
Invariant: block tables are append-only and a cached block is never written.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.errors import PoolExhaustedError
from engine.staging import CAPTURE, PinnedChunks, export_rows

_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


@dataclass(frozen=True, slots=True)
class KVLayout:
    layers: int
    kv_heads: int
    block_tokens: int
    head_dim: int
    dtype: str

    @property
    def name(self) -> str:
        return (f"L{self.layers}xH{self.kv_heads}xT{self.block_tokens}xD{self.head_dim}"
                f":{self.dtype}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    @property
    def block_shape(self) -> tuple[int, int, int, int, int]:
        return (self.layers, 2, self.kv_heads, self.block_tokens, self.head_dim)

    @property
    def block_nbytes(self) -> int:
        n = 1
        for d in self.block_shape:
            n *= d
        return n * torch.empty((), dtype=self.torch_dtype).element_size()

    @staticmethod
    def dtype_name(dtype: torch.dtype) -> str:
        return _DTYPE_NAMES[dtype]


class KVStorage:
    """The pool tensor and the few ways to move data in and out of it."""

    def __init__(self, layout: KVLayout, num_blocks: int, device: torch.device) -> None:
        self.layout, self.num_blocks, self.device = layout, num_blocks, device
        L, H, B, D = layout.layers, layout.kv_heads, layout.block_tokens, layout.head_dim
        # empty, not zeros: on CPU untouched pages cost no memory. Slots past a
        # sequence's length are never read into attention (they are sliced off).
        self.data = torch.empty(L, 2, H, num_blocks, B, D, dtype=layout.torch_dtype,
                                device=device)
        # Views over the same memory (no copies):
        self._slots = self.data.view(L, 2, H, num_blocks * B, D)        # token slots
        self._blocks = self.data.permute(3, 0, 1, 2, 4, 5)              # [nb, L, 2, H, B, D]

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        # k, v: [M, H, D] rows for token slots (block * B + offset): [M]
        self._slots[layer, 0].index_copy_(1, slots, k.transpose(0, 1))
        self._slots[layer, 1].index_copy_(1, slots, v.transpose(0, 1))

    def copy_rows(self, src: torch.Tensor, dst: torch.Tensor, layer: int | None = None) -> None:
        """Token slots ``src`` into ``dst`` (both [n]): one layer's K and V, or every layer's."""
        view = self._slots if layer is None else self._slots[layer]
        dim = view.dim() - 2
        view.index_copy_(dim, dst, view.index_select(dim, src))

    def gather_all(self, block_ids: torch.Tensor) -> torch.Tensor:
        # -> [L, 2, H, n * B, D]: every layer's KV of these blocks, in table order
        kv = self.data.index_select(3, block_ids)                         # [L, 2, H, n, B, D]
        return kv.view(*kv.shape[:3], -1, kv.shape[-1])

    def export(self, block_ids: torch.Tensor, out: torch.Tensor | None = None, *,
               on_device: bool = False) -> torch.Tensor:
        """[n, L, 2, H, B, D]: one device-side gather; on CUDA then one
        non_blocking copy into pinned host memory. ``on_device``: the gather
        alone, queued on the current stream and not waited for (the caller
        copies it out elsewhere: engine.staging.HostCopy)."""
        if on_device:
            return self._blocks.index_select(0, block_ids)
        if self.device.type == "cuda":
            gathered = self._blocks.index_select(0, block_ids)
            if out is None:
                out = torch.empty(gathered.shape, dtype=gathered.dtype, pin_memory=True)
            out.copy_(gathered, non_blocking=True)
            torch.cuda.current_stream(self.device).synchronize()
            return out
        if out is None:
            return self._blocks.index_select(0, block_ids)
        return torch.index_select(self._blocks, 0, block_ids, out=out)

    def import_(self, block_ids: torch.Tensor, blocks: torch.Tensor) -> None:
        # blocks: [n, L, 2, H, B, D] on any device; one copy to the device, one scatter
        src = blocks.to(self.device, non_blocking=True)
        self._blocks.index_copy_(0, block_ids, src)

    def export_tokens(self, slots: torch.Tensor) -> torch.Tensor:
        # -> [L, 2, H, n_tokens, D]
        return self._slots.index_select(3, slots)

    def export_tokens_into(self, slots: torch.Tensor, out: torch.Tensor,
                           chunks: PinnedChunks) -> torch.Tensor:
        """``export_tokens`` into a contiguous host ``out`` [L, 2, H, n, D]
        through pinned chunks on a side stream (engine.staging): one DMA per
        group of (layer, K/V, head) rows, never a pageable copy of the whole."""
        L, H, D = self.layout.layers, self.layout.kv_heads, self.layout.head_dim
        rows = self._slots.view(L * 2 * H, -1, D)
        with CAPTURE.copy():
            export_rows(rows, slots, out.view(L * 2 * H, -1, D), chunks)
        return out

    def export_tokens_device(self, slots: torch.Tensor) -> torch.Tensor:
        """``export_tokens`` into a new contiguous device tensor, gathered on a
        side stream and complete on return: a same-GPU hand-off shares it with
        another process, which sees none of this process's streams."""
        with CAPTURE.copy():
            if self.device.type != "cuda":
                return self._slots.index_select(3, slots.to(self.device))
            stream = torch.cuda.Stream(self.device)
            with torch.cuda.stream(stream):
                out = self._slots.index_select(3, slots.to(self.device))
            stream.synchronize()
        return out

    def import_tokens(self, slots: torch.Tensor, kv: torch.Tensor) -> None:
        # kv: [L, 2, H, n_tokens, D]
        self._slots.index_copy_(3, slots, kv.to(self.device))


class BlockPool:
    """Block ids, refcounts and the G1 prefix cache (chain key -> block)."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._refs = [0] * num_blocks
        self._cached: dict[bytes, int] = {}
        self._key_of: dict[int, bytes] = {}
        # Cached blocks with refcount 0, least recently used first.
        self._lru: OrderedDict[int, None] = OrderedDict()
        self.evicted_total = 0      # cached blocks reused for new KV (or dropped by a reset)
        self.cached_total = 0       # blocks published under a key (G1 grew)

    @property
    def num_free(self) -> int:
        """Blocks allocatable now (free plus evictable cached)."""
        return len(self._free) + len(self._lru)

    @property
    def num_cached(self) -> int:
        return len(self._cached)

    def allocate(self, n: int) -> list[int]:
        if n > self.num_free:
            raise PoolExhaustedError(
                f"KV pool exhausted: need {n} blocks, {self.num_free} of {self.num_blocks} free")
        out = []
        for _ in range(n):
            if self._free:
                b = self._free.popleft()
            else:
                b, _ = self._lru.popitem(last=False)
                del self._cached[self._key_of.pop(b)]
                self.evicted_total += 1
            self._refs[b] = 1
            out.append(b)
        return out

    def release(self, blocks: Sequence[int]) -> None:
        # Release in reverse so a sequence's tail is evicted before its prefix.
        for b in reversed(blocks):
            self._refs[b] -= 1
            if self._refs[b] < 0:
                raise RuntimeError(f"block {b} released more often than acquired")
            if self._refs[b] == 0:
                if b in self._key_of:
                    self._lru[b] = None
                else:
                    self._free.append(b)

    def match(self, keys: Sequence[bytes]) -> list[int]:
        """Blocks of the leading keys present in the cache (not acquired)."""
        out = []
        for key in keys:
            b = self._cached.get(key)
            if b is None:
                break
            out.append(b)
        return out

    def acquire(self, blocks: Sequence[int]) -> None:
        for b in blocks:
            if self._refs[b] == 0:
                self._lru.pop(b, None)
            self._refs[b] += 1

    def cache(self, block: int, key: bytes) -> bool:
        """Publish a full, canonical block under its key (first writer wins)."""
        if key in self._cached or block in self._key_of:
            return False
        self._cached[key] = block
        self._key_of[block] = key
        self.cached_total += 1
        return True

    def ref_count(self, block: int) -> int:
        return self._refs[block]

    def reset_cache(self) -> tuple[int, int]:
        """Forget every cached key (vLLM's reset_prefix_cache): idle cached
        blocks become free, blocks running sequences hold stay theirs but are no
        longer found by ``match``. Returns (keys dropped, of them in use)."""
        dropped, in_use = len(self._cached), 0
        for b in self._key_of:
            if self._refs[b]:
                in_use += 1
        self._free.extend(self._lru)
        self._lru.clear()
        self._cached.clear()
        self._key_of.clear()
        self.evicted_total += dropped
        return dropped, in_use
