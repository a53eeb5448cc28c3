"""The native replay core behind ``studies.sim.replay_cache``.

``native._replaycore`` (native/replaycore.c) runs SimWarehouse's single-tier
accounting for lru, fifo, prefix_lru, s3fifo, belady, hit_density and
session_density (the policies ``make_policy`` builds: their defaults), with
per-class TTL expiry, over a ``CompactTrace``; it mirrors the Python code step
for step, the density policies' float64 arithmetic included, so every hit
count is identical (tests/studies/test_sim.py). Anything else
(several tiers, other policies, no compiler, ``KVSERVE_NO_NATIVE=1``) takes
the Python path; ``engine="python"`` forces it.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from types import ModuleType

import numpy as np

from common.trace_arrays import CompactTrace
from studies.replay_stats import UNLIMITED, ClassStats, ReplayStats, ttl_map

_ext: ModuleType | None = None
if os.environ.get("KVSERVE_NO_NATIVE", "") not in ("1", "true", "yes"):
    try:
        from native import _replaycore as _ext
    except ImportError:  # not built: the Python loop serves
        _ext = None

HAVE_NATIVE: bool = _ext is not None
# Policy name -> the C core's code (replaycore.c's P_* enum).
NATIVE_POLICIES: dict[str, int] = {"lru": 0, "prefix_lru": 1, "s3fifo": 2, "belady": 3,
                                   "fifo": 4, "hit_density": 5, "session_density": 6}
ENGINES = ("auto", "native", "python")


def native_supports(policy: str, capacity_tokens: object) -> bool:
    """Whether the C core can run this replay (one tier, a policy it has)."""
    if _ext is None or policy not in NATIVE_POLICIES:
        return False
    if isinstance(capacity_tokens, Sequence) and not isinstance(capacity_tokens, str):
        return len(capacity_tokens) == 1
    return True


def next_uses(ct: CompactTrace) -> np.ndarray:
    """int32 [uses]: the next request using each block use's block (-1: none)."""
    out = np.empty(ct.n_uses, dtype=np.int32)
    if ct.n_requests >= 2**31 - 1:
        raise ValueError("more than 2**31 requests")
    if _ext is not None:
        _ext.next_uses(ct.ids, ct.offsets, out, ct.n_keys)
        return out
    last = np.full(ct.n_keys, -1, dtype=np.int32)
    off = ct.offsets
    for i in range(ct.n_requests - 1, -1, -1):
        seg = ct.ids[off[i]:off[i + 1]]
        out[off[i]:off[i + 1]] = last[seg]
        last[seg] = i
    return out


def _density_settings(policy: str, ct: CompactTrace) -> tuple[object, ...]:
    """What the C core needs of a default ``HitDensity`` or ``SessionDensity``:
    the bin edges (the very float64 table the policies use), the settings and
    the first refresh; session_density also gets the requests' sessions."""
    from kvstore.eviction import hit_density as hd
    from kvstore.eviction import session_density as sd

    names = ct.class_names
    empty = names.index("") if "" in names else -1
    pol: hd.HitDensity | sd.SessionDensity
    if policy == "hit_density":
        pol = hd.HitDensity()
        ghost, extra = pol._ghost_factor, ()
    else:
        pol, ghost = sd.SessionDensity(), 0.0
        extra = (np.ascontiguousarray(ct.sessions, dtype=np.uint32), sd._MIN_STARTS)
    return (np.ascontiguousarray(hd._EDGES, dtype=np.float64),
            np.ascontiguousarray(hd._WIDTHS, dtype=np.float64), hd._LN_FACTOR, hd._BIN0_S,
            pol._refresh_every, pol._half_life, ghost, pol._quantile, pol._next_refresh,
            empty, *extra)


def _class_ttls(ct: CompactTrace, ttl_s: float | Mapping[str, float],
                offline: bool) -> tuple[np.ndarray, bool]:
    ttls, default = ttl_map(ttl_s)
    expiring = any(math.isfinite(v) for v in ttls.values()) or (
        default is not None and math.isfinite(default))
    out = np.empty(len(ct.class_names), dtype=np.float64)
    present = set(np.unique(ct.classes).tolist()) if len(ct.classes) else set()
    for i, name in enumerate(ct.class_names):
        v = ttls.get(name, default)
        if v is None:
            if (expiring or offline) and i in present:
                raise ValueError(f"no TTL for traffic class {name!r}; known: {sorted(ttls)} "
                                 "(add '*' for a default)")
            v = math.inf
        out[i] = v
    return out, expiring


def replay_native(ct: CompactTrace, *, policy: str, capacity_tokens: object,
                  ttl_s: float | Mapping[str, float], kv_bytes_per_token: int,
                  cache_partial: bool = False,
                  next_req: np.ndarray | None = None) -> ReplayStats:
    """One replay in C; the same ``ReplayStats`` as the Python loop, to the bit."""
    if _ext is None:
        raise RuntimeError("native._replaycore is unavailable (not built or KVSERVE_NO_NATIVE)")
    code = NATIVE_POLICIES[policy]
    cap = capacity_tokens
    if isinstance(cap, Sequence):
        (cap,) = cap
    if kv_bytes_per_token < 1 or ct.block_tokens < 1:
        raise ValueError("block_tokens and kv_bytes_per_token must be >= 1")
    cap_bytes = UNLIMITED if cap is None or math.isinf(cap) else int(cap) * kv_bytes_per_token
    if cap_bytes < 0:
        raise ValueError(f"tier capacities must be >= 0, got {[cap_bytes]}")
    bt = ct.block_tokens
    lens = np.diff(ct.offsets)
    nstore = (lens if cache_partial else np.minimum(lens, ct.input_length // bt)).astype(np.int32)
    ttls, expiring = _class_ttls(ct, ttl_s, offline=policy == "belady")
    if policy == "belady" and next_req is None:
        next_req = next_uses(ct)
    hits = np.zeros(ct.n_requests, dtype=np.int32)
    if ct.n_requests == 0:
        raise ValueError("empty trace")
    extra = ((_density_settings(policy, ct),) if policy in ("hit_density", "session_density")
             else ())
    r = _ext.replay(ct.ids, ct.offsets, nstore, ct.times, ct.classes, ttls,
                    next_req if policy == "belady" else None, hits, ct.n_keys, cap_bytes,
                    bt * kv_bytes_per_token, code, expiring, *extra)
    ncls = len(ct.class_names)
    h64 = hits.astype(np.int64)
    per = {
        "requests": np.bincount(ct.classes, minlength=ncls),
        "blocks": np.bincount(ct.classes, weights=lens, minlength=ncls),
        "hit_blocks": np.bincount(ct.classes, weights=h64, minlength=ncls),
        "tokens": np.bincount(ct.classes, weights=ct.input_length, minlength=ncls),
        "hit_tokens": np.bincount(ct.classes, weights=np.minimum(h64 * bt, ct.input_length),
                                  minlength=ncls),
    }
    per_class = {
        name: ClassStats(*(int(per[f][i]) for f in
                           ("requests", "blocks", "hit_blocks", "tokens", "hit_tokens")))
        for i, name in enumerate(ct.class_names) if per["requests"][i] > 0}
    total = ClassStats()
    for st in per_class.values():
        total.add(st)
    span = r["t_last"] - r["t0"]
    mean = r["area"] / span if span > 0 else float(r["used"])
    return ReplayStats(
        hit_rate=total.hit_rate, token_hit_rate=total.token_hit_rate,
        per_class=dict(sorted(per_class.items())), bytes_peak=r["bytes_peak"],
        bytes_mean=mean, evictions=r["evictions"], expirations=r["expirations"],
        requests=total.requests, tier_hits=(total.hit_blocks,))


__all__ = ["ENGINES", "HAVE_NATIVE", "NATIVE_POLICIES", "native_supports", "next_uses",
           "replay_native"]
