"""What predicts reuse in prefix-KV traffic: per feature bucket, the share of
block uses, the chance the block is used again (ever, within 60 s) and the
median gap, from a ``CompactTrace`` (``kvserve trace reuse``).

Features, all known online when the block is used: the session's turn
number, the block's depth in its chain and relative position, the chain's
length, whether this use is the block's first, and the block's class. The
label (reused later, and when) is what Belady knows and an online policy must
guess; a feature whose buckets differ a lot in ``p_reuse`` is worth a policy's
attention.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from common.trace_arrays import CompactTrace
from studies.replay_core import next_uses

_BINS: dict[str, tuple[float, ...]] = {
    "turn": (1, 2, 4, 8, 16),
    "depth": (4, 16, 64, 256),
    "rel_position": (0.25, 0.5, 0.75, 0.9),
    "chain_blocks": (8, 32, 128, 512),
    "first_use": (1,),
}


@dataclass(frozen=True, slots=True)
class FeatureRow:
    feature: str
    bucket: str          # "< edge" or ">= last edge", or a class name
    share: float         # of block uses
    p_reuse: float       # used again later in the trace
    p_reuse_60s: float   # used again within 60 s
    median_gap_s: float  # of the uses that are reused (nan if none)
    same_session: float  # of reuses, the share by the same session


def reuse_features(ct: CompactTrace) -> list[FeatureRow]:
    nxt = next_uses(ct)
    lens = np.diff(ct.offsets)
    ridx = np.repeat(np.arange(ct.n_requests), lens)
    pos = np.arange(ct.n_uses) - ct.offsets[ridx]
    turn = np.zeros(ct.n_requests, dtype=np.int64)
    seen: dict[int, int] = {}
    for i, s in enumerate(ct.sessions.tolist()):
        turn[i] = seen.get(s, 0)
        seen[s] = turn[i] + 1
    first = np.zeros(ct.n_uses, dtype=bool)
    first[np.unique(ct.ids, return_index=True)[1]] = True
    reused = nxt >= 0
    safe = np.maximum(nxt, 0)
    gap = np.where(reused, ct.times[safe] - ct.times[ridx], np.inf)
    same = reused & (ct.sessions[safe] == ct.sessions[ridx])
    feats = {"turn": turn[ridx], "depth": pos, "rel_position": pos / np.maximum(lens[ridx], 1),
             "chain_blocks": lens[ridx], "first_use": first.astype(np.int64)}
    rows: list[FeatureRow] = []
    for name, values in feats.items():
        edges = _BINS[name]
        b = np.digitize(values, edges)
        for k in np.unique(b):
            label = f"< {edges[k]:g}" if k < len(edges) else f">= {edges[-1]:g}"
            rows.append(_row(name, label, b == k, reused, gap, same))
    for c, cname in enumerate(ct.class_names):
        m = ct.classes[ridx] == c
        if m.any():
            rows.append(_row("class", cname, m, reused, gap, same))
    return rows


def _row(name: str, label: str, m: np.ndarray, reused: np.ndarray, gap: np.ndarray,
         same: np.ndarray) -> FeatureRow:
    g = gap[m & reused]
    n_re = int((m & reused).sum())
    return FeatureRow(name, label, float(m.mean()), float(reused[m].mean()),
                      float((gap[m] < 60).mean()), float(np.median(g)) if len(g) else float("nan"),
                      float(same[m].sum() / n_re) if n_re else float("nan"))


__all__ = ["FeatureRow", "reuse_features"]
