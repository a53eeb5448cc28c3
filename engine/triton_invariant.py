"""Batch-invariant GPU kernels (kernel family ``triton_bi``): a row's bits depend
on that row's inputs alone, never on how many rows share the call, which
sequences share a batched prefill, how a prompt was chunked, or how many
sequences decode together.

- GEMM: engine/triton_gemm.py. One fp32 accumulation per output and K split
  over fixed 64-deep K tiles in order, the splits added in order; how many
  splits is fixed by the weight's shape (``k_splits``; shipped: one), never by
  M; the tile (rows, columns, warps, stages) is chosen per row count for speed
  and does not change the bits.
- Attention: engine/triton_attention.py. One arithmetic for prefill chunks,
  batched (varlen) prefill and decode rows: key tiles of 64 and splits of
  1,024 keys aligned to absolute position 0, splits folded in order, so decode
  can spread a long context over many programs and still give a prefill's bits.
- RMSNorm, SwiGLU, RoPE: engine/triton_kernels.py as it is. RMSNorm is one
  program per row whose block and warp count depend on the hidden size only,
  so its reduction tree is fixed; the other two are element-wise.

Attention reads K/V from the paged pool through each sequence's block table,
not from the per-sequence mirror: the bits are the same, and a decode step then
costs one kernel per layer (two with key splits) instead of two mirror copies
per sequence per layer. Decode runs in the paged runner's CUDA graphs
(``DecodeAttention``): a bucket's padding rows change no real row's bits.

Only imported on CUDA (Triton is not a CPU dependency).
"""

from __future__ import annotations

import torch

from engine.kv_pool import KVStorage
from engine.paged_decode import StepBuffers, write_kv
from engine.triton_attention import (
    KEY_SPLIT,
    KEY_TILE,
    AttnSegment,
    InvariantAttention,
    attend,
    decode_scratch,
)
from engine.triton_gemm import BK, SPLIT_ID, SPLITS, linear

__all__ = ["KERNEL_ID", "AttnSegment", "DecodeAttention", "InvariantAttention", "linear"]

# Part of the model fingerprint (engine/kernels.py): it names every choice that
# decides bits (K tile, key tile, key split, the fold), so blocks of two versions
# never mix. Bump the leading version when the arithmetic changes otherwise.
# tbi4: the softmax row sum is a matrix-unit product of the probabilities (in the value dtype)
# with ones (tbi3 summed the fp32 probabilities in the layout's shuffle tree).
# A K-split rule other than one split (engine/triton_gemm.py SPLITS) names itself.
KERNEL_ID = f"tbi4-k{BK}-t{KEY_TILE}-s{KEY_SPLIT}" + (f"-{SPLIT_ID}" if SPLITS > 1 else "")


class DecodeAttention:
    """The attend callback of a CUDA-graph decode bucket (engine/paged_decode.py
    DecodeRunner, ``attention=``) through the invariant kernel: row i is a
    one-token segment at position ``lens[i] - 1`` over block table ``tables[i]``,
    its key splits dealt over ``buf.splits`` programs; padding rows point at the
    scratch block. Everything it reads lives in the bucket's static buffers (and
    its own split-state scratch: a slot for every key split a row of
    ``max_blocks`` blocks can have, where ``buf.acc`` has one a program), so a
    captured graph replays it."""

    def __init__(self, storage: KVStorage, windows: tuple[int, ...], num_heads: int,
                 buf: StepBuffers) -> None:
        self.storage, self.windows, self.buf = storage, windows, buf
        self.group = num_heads // storage.layout.kv_heads
        b, max_blocks = buf.tables.shape
        dev = buf.tables.device
        rows = torch.arange(b, dtype=torch.int32, device=dev)
        self.seg_meta = torch.stack([rows, torch.ones_like(rows), torch.zeros_like(rows),
                                     rows * max_blocks], 1).contiguous()      # [b, 4]
        self.tiles = torch.stack([rows, torch.zeros_like(rows)], 1).contiguous()
        self.width = num_heads * storage.layout.head_dim
        self.acc, self.ml = buf.acc, buf.ml
        if buf.splits > 1:
            self.acc, self.ml = decode_scratch(b, max_blocks * storage.layout.block_tokens,
                                               num_heads, storage.layout.head_dim, dev)

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor,
                 v: torch.Tensor) -> torch.Tensor:
        # q: [b, H, D]; k, v: [b, Hkv, D] -> [b, H * D]
        b = self.buf
        write_kv(self.storage.data, layer, b.slots, k, v)
        if layer == 0:             # positions change every step: once per forward
            self.seg_meta[:, 2].copy_(b.lens - 1)
        out = q.new_empty(q.shape[0], self.width)
        attend(self.storage.data, layer, q, b.tables, self.seg_meta, self.tiles,
               q.shape[0], self.group, self.windows[layer], out, b.splits, self.acc, self.ml)
        return out
