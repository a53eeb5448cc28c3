"""Attention over the KV of one sequence at a time.

A forward call covers rows of one or more sequences (segments): a prefill
chunk is one segment of up to ``chunk`` rows; a decode step has one row per
sequence plus padding rows. Each segment attends only to its own sequence's
keys, with shapes that depend only on that sequence's positions, so
co-tenants never change its bits.

New K/V rows go to the paged pool (block tables: the source of truth for
export/import and the G1 cache), which the invariant kernels read directly
(``bik.PagedAttention`` on the CPU, triton_bi on CUDA). The torch path also
writes them to the sequence's contiguous *mirror* ``[layers, 2, kv_heads,
capacity, head_dim]`` and reads that as a strided view: torch has no paged
attention on the CPU, and gathering a sequence's blocks for every layer of
every decode step cost as much as all the GEMMs (30% of a batch-8 step at
1.5k context); the mirror holds the same bits as the pool.

Sliding-window layers see keys ``(p - window, p]`` for a query at position
``p`` (the window counts the token itself).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine import bik
from engine.kv_pool import KVStorage


@dataclass(frozen=True, slots=True)
class Segment:
    row0: int                  # first row of this sequence in the batch
    rows: int                  # its number of rows (query tokens)
    q_start: int               # absolute position of its first row
    table: torch.Tensor        # its block ids, int64 on the pool device: [n_blocks]
    mirror: torch.Tensor       # its KV, [layers, 2, kv_heads, capacity, head_dim]


@dataclass(frozen=True, slots=True)
class _KeyPlan:
    lo: int                    # first key position attended
    mask: torch.Tensor | None  # [g * rows, keys] True = attend; None = attend to all


def _key_plan(seg: Segment, window: int, group: int) -> _KeyPlan:
    end = seg.q_start + seg.rows                       # keys [lo, end) after this step's write
    lo = 0 if window == 0 else max(0, seg.q_start - window + 1)
    mask = None
    if seg.rows > 1:
        dev = seg.table.device
        q_pos = torch.arange(seg.q_start, end, device=dev).unsqueeze(1)   # [m, 1]
        k_pos = torch.arange(lo, end, device=dev).unsqueeze(0)            # [1, keys]
        allowed = k_pos <= q_pos
        if window:
            allowed &= k_pos > q_pos - window
        mask = allowed.repeat(group, 1)
    return _KeyPlan(lo, mask)


class BatchAttention:
    """The ``attend`` callback of one forward call (engine.model.AttendFn)."""

    def __init__(self, storage: KVStorage, segments: list[Segment], windows: tuple[int, ...],
                 num_heads: int, rows: int, invariant: bool = False,
                 before_layer: Callable[[int], None] | None = None,
                 after_write: Callable[[int], None] | None = None) -> None:
        layout = storage.layout
        self.invariant = invariant
        self.before_layer = before_layer          # e.g. wait for a restored layer's copy
        self.after_write = after_write            # e.g. copy rows a leader just wrote
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
        self.plans = {} if invariant else {w: [_key_plan(s, w, self.group) for s in segments]
                                           for w in sorted(set(windows))}
        self._num_heads = num_heads
        self._invariant_attend: InvariantAttend | None = None    # built on first use

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor,
                 v: torch.Tensor) -> torch.Tensor:
        # q: [M, H, D]; k, v: [M, Hkv, D] -> [M, H * D]
        if self.before_layer is not None:
            self.before_layer(layer)
        n = self.n_real
        self.storage.write(layer, self.slots, k[:n], v[:n])
        if self.after_write is not None:
            self.after_write(layer)
        if self.invariant:
            return self._invariant(layer, q, k, v)
        hkv, g, d = self.kv_heads, self.group, self.head_dim
        out = q.new_zeros(self.rows, hkv * g * d)
        for seg, plan in zip(self.segments, self.plans[self.windows[layer]], strict=True):
            m, r0, end = seg.rows, seg.row0, seg.q_start + seg.rows
            kv = seg.mirror[layer]                                     # [2, Hkv, cap, D]
            kv[0, :, seg.q_start:end] = k[r0:r0 + m].transpose(0, 1)
            kv[1, :, seg.q_start:end] = v[r0:r0 + m].transpose(0, 1)
            kv = kv[:, :, plan.lo:end].unsqueeze(1)                    # [2, 1, Hkv, keys, D]
            # GQA without repeating K/V: the g query heads of a KV head become
            # g*m query rows of that head.
            if q.is_cuda and plan.mask is not None and self.windows[layer] == 0:
                # GPU prefill chunk: a lower-right causal bias instead of a dense mask
                # lets SDPA run its flash kernel (a 2k-row chunk over 32k keys would
                # otherwise take the masked path); heads stay in the same order.
                # Imported here: the module loads torch._dynamo (~1.5 s of every CPU
                # engine's start) and only this CUDA branch needs it.
                from torch.nn.attention.bias import causal_lower_right

                qh = q[r0:r0 + m].transpose(0, 1).unsqueeze(0)            # [1, H, m, D]
                o = F.scaled_dot_product_attention(
                    qh, kv[0], kv[1], attn_mask=causal_lower_right(m, end - plan.lo),
                    enable_gqa=True)                                     # [1, H, m, D]
                out[r0:r0 + m] = o[0].transpose(0, 1).reshape(m, -1)
                continue
            qs = q[r0:r0 + m].reshape(m, hkv, g, d).permute(1, 2, 0, 3).reshape(1, hkv, g * m, d)
            o = F.scaled_dot_product_attention(qs, kv[0], kv[1], attn_mask=plan.mask)
            out[r0:r0 + m] = o.view(hkv, g, m, d).permute(2, 0, 1, 3).reshape(m, -1)
        return out

    def _invariant(self, layer: int, q: torch.Tensor, k: torch.Tensor,
                   v: torch.Tensor) -> torch.Tensor:
        """One batch-invariant kernel call for every segment, by device."""
        width = self.kv_heads * self.group * self.head_dim
        out = (q.new_empty(self.rows, width) if self.n_real == self.rows
               else q.new_zeros(self.rows, width))
        if self._invariant_attend is None:
            self._invariant_attend = _INVARIANT_ATTEND[q.device.type](self)
        self._invariant_attend(layer, q, k, v, out)
        return out


# attend(layer, q, k, v, out): one layer of every segment into out [M, H * D]
InvariantAttend = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]


def _bik_attend(attn: BatchAttention) -> InvariantAttend:
    """CPU (engine/bik.py): reads the paged pool, already written by ``__call__``,
    where the engine gave the sequences no mirror (a build with
    ``attend_paged``); otherwise each sequence's mirror, written here first."""
    if all(s.mirror.shape[3] == 0 for s in attn.segments):
        plan = bik.PagedAttention(attn.storage.data, [
            bik.PagedSegment(s.row0, s.rows, s.q_start, s.table) for s in attn.segments])

        def attend_paged(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         out: torch.Tensor) -> None:
            plan(layer, q, attn.windows[layer], out)
        return attend_paged

    def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               out: torch.Tensor) -> None:
        segs = []
        for seg in attn.segments:
            m, r0, end = seg.rows, seg.row0, seg.q_start + seg.rows
            kv = seg.mirror[layer]                                     # [2, Hkv, cap, D]
            kv[0, :, seg.q_start:end] = k[r0:r0 + m].transpose(0, 1)
            kv[1, :, seg.q_start:end] = v[r0:r0 + m].transpose(0, 1)
            segs.append(bik.AttnSegment(r0, m, seg.q_start, kv))
        bik.attend(q, segs, attn.kv_heads, attn.windows[layer], out)
    return attend


def _triton_attend(attn: BatchAttention) -> InvariantAttend:
    """CUDA (engine/triton_invariant.py): reads the paged pool, already written by
    ``__call__``; the mirror is not kept up to date (nothing reads it on this path)."""
    from engine import triton_invariant as ti  # Triton: CUDA only
    plan = ti.InvariantAttention(
        attn.storage.data, [ti.AttnSegment(s.row0, s.rows, s.q_start, s.table)
                            for s in attn.segments], attn._num_heads)

    def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               out: torch.Tensor) -> None:
        plan(layer, q, attn.windows[layer], out)
    return attend


_INVARIANT_ATTEND: dict[str, Callable[[BatchAttention], InvariantAttend]] = {
    "cpu": _bik_attend, "cuda": _triton_attend}
