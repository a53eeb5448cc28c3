"""Paged attention, one sequence at a time.

A forward call covers rows of one or more sequences (segments): a prefill
chunk is one segment of up to ``chunk`` rows; a decode step has one row per
sequence plus padding rows. Each segment attends only to its own sequence's
keys, gathered from the pool by its block table, with shapes that depend only
on that sequence's positions, so co-tenants never change its bits.

Sliding-window layers see keys ``(p - window, p]`` for a query at position
``p`` (the window counts the token itself).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.kv_pool import KVStorage


@dataclass(frozen=True, slots=True)
class Segment:
    row0: int                  # first row of this sequence in the batch
    rows: int                  # its number of rows (query tokens)
    q_start: int               # absolute position of its first row
    table: torch.Tensor        # its block ids, int64 on the pool device: [n_blocks]


@dataclass(frozen=True, slots=True)
class _KeyPlan:
    block_ids: torch.Tensor    # blocks to gather: [n]
    offset: int                # first key's offset inside the gathered run
    n_keys: int
    mask: torch.Tensor | None  # [g * rows, n_keys] True = attend; None = attend to all


def _key_plan(seg: Segment, window: int, block_tokens: int, group: int) -> _KeyPlan:
    end = seg.q_start + seg.rows                       # keys [lo, end) after this step's write
    lo = 0 if window == 0 else max(0, seg.q_start - window + 1)
    first, last = lo // block_tokens, (end + block_tokens - 1) // block_tokens
    n_keys = end - lo
    mask = None
    if seg.rows > 1:
        dev = seg.table.device
        q_pos = torch.arange(seg.q_start, end, device=dev).unsqueeze(1)   # [m, 1]
        k_pos = torch.arange(lo, end, device=dev).unsqueeze(0)            # [1, n_keys]
        allowed = k_pos <= q_pos
        if window:
            allowed &= k_pos > q_pos - window
        mask = allowed.repeat(group, 1)
    return _KeyPlan(seg.table[first:last], lo - first * block_tokens, n_keys, mask)


class PagedAttention:
    """The ``attend`` callback of one forward call (engine.model.AttendFn)."""

    def __init__(self, storage: KVStorage, segments: list[Segment], windows: tuple[int, ...],
                 num_heads: int, rows: int) -> None:
        layout = storage.layout
        self.storage, self.segments, self.windows = storage, segments, windows
        self.kv_heads, self.head_dim = layout.kv_heads, layout.head_dim
        self.group = num_heads // layout.kv_heads
        self.rows = rows
        B = layout.block_tokens
        slots = []
        for seg in segments:
            pos = torch.arange(seg.q_start, seg.q_start + seg.rows, device=seg.table.device)
            slots.append(seg.table[pos // B] * B + pos % B)
        self.slots = torch.cat(slots)                  # [n_real]
        self.n_real = int(self.slots.numel())
        self.plans = {w: [_key_plan(s, w, B, self.group) for s in segments]
                      for w in sorted(set(windows))}

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor,
                 v: torch.Tensor) -> torch.Tensor:
        # q: [M, H, D]; k, v: [M, Hkv, D] -> [M, H * D]
        n = self.n_real
        self.storage.write(layer, self.slots, k[:n], v[:n])
        hkv, g, d = self.kv_heads, self.group, self.head_dim
        out = q.new_zeros(self.rows, hkv * g * d)
        for seg, plan in zip(self.segments, self.plans[self.windows[layer]], strict=True):
            kv = self.storage.gather(layer, plan.block_ids)            # [2, Hkv, n*B, D]
            kv = kv.narrow(2, plan.offset, plan.n_keys)
            m = seg.rows
            qs = q[seg.row0: seg.row0 + m]                             # [m, H, D]
            qs = qs.reshape(m, hkv, g, d).permute(1, 2, 0, 3).reshape(hkv, g * m, d)
            o = F.scaled_dot_product_attention(qs, kv[0], kv[1], attn_mask=plan.mask)
            out[seg.row0: seg.row0 + m] = o.view(hkv, g, m, d).permute(2, 0, 1, 3).reshape(m, -1)
        return out
