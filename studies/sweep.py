"""TTL x capacity x policy sweeps over simulated stores, their rows and plot.

Rows (``SweepRow.as_json``) have the keys ``class``, ``ttl_s``,
``capacity_tokens``, ``policy``, ``hit_rate``, ``token_hit_rate``,
``bytes_peak``, ``bytes_mean``, ``evictions``, ``expirations``,
``time_scale``; an unlimited TTL or capacity is ``null``. ``kvserve whatif``
and ``kvserve store whatif`` print the same keys.
"""

from __future__ import annotations

import math
import multiprocessing as mp
import os
import re
from collections.abc import Iterable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tqdm import tqdm

from common.trace_arrays import CompactTrace
from common.traces import Trace
from kvstore.eviction import policy_names
from kvstore.whatif import WhatIfRow
from studies.sim import LLAMA3_70B_KV_BYTES_PER_TOKEN, compact_of, replay_cache

_UNITS_S = {"": 1, "s": 1, "m": 60, "min": 60, "h": 3600, "d": 86_400, "w": 604_800}
_UNITS_TOK = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_NUM = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([a-z]*)\s*$", re.IGNORECASE)
_UNLIMITED = ("inf", "none", "unlimited")


def _parse(text: str, units: dict[str, int], what: str) -> list[float]:
    out: list[float] = []
    for part in text.split(","):
        item = part.strip().lower()
        if not item:
            continue
        if item in _UNLIMITED:
            out.append(math.inf)
            continue
        m = _NUM.match(item)
        if not m or m.group(2) not in units:
            raise ValueError(f"{what}: cannot parse {part.strip()!r} (e.g. {_example(what)})")
        v = float(m.group(1)) * units[m.group(2)]
        if v <= 0:
            raise ValueError(f"{what}: {part.strip()!r} must be > 0")
        out.append(v)
    if not out:
        raise ValueError(f"{what}: empty list")
    return out


def _example(what: str) -> str:
    return "60,300,1h,3d,inf" if what == "--ttl" else "1e6,3M,50M,inf"


def parse_ttls(text: str) -> list[float]:
    """Seconds from e.g. ``60,5m,1h,3d,inf`` (inf = no TTL)."""
    return _parse(text, _UNITS_S, "--ttl")


def parse_capacities(text: str) -> list[float]:
    """Tokens from e.g. ``1e6,3M,50M,inf`` (inf = unlimited)."""
    return _parse(text, _UNITS_TOK, "--capacity")


def parse_policies(text: str | None) -> list[str]:
    known = policy_names()
    if not text or text.strip() == "all":
        return known
    names = [p.strip() for p in text.split(",") if p.strip()]
    bad = [p for p in names if p not in known]
    if bad:
        raise ValueError(f"--policy: unknown {bad}; choose from {known}")
    return names


@dataclass(frozen=True, slots=True)
class SweepRow(WhatIfRow):
    """A replayed row: the what-if row's keys (so predictions and replays compare
    key for key) plus what only a replay knows."""

    evictions: int = 0
    expirations: int = 0
    time_scale: float = 1.0

    def as_json(self) -> dict[str, Any]:
        return {**WhatIfRow.as_json(self), "evictions": self.evictions,
                "expirations": self.expirations, "time_scale": self.time_scale}


_SHARED: Trace | CompactTrace | None = None   # the trace a forked worker replays


def _replay_one(task: tuple[str, float, float, int]) -> tuple[tuple[str, float, float], Any]:
    policy, cap, ttl, kvb = task
    assert _SHARED is not None
    st = replay_cache(_SHARED, policy=policy, capacity_tokens=None if math.isinf(cap) else cap,
                      ttl_s=ttl, kv_bytes_per_token=kvb)
    return (policy, cap, ttl), st


def default_jobs(n_tasks: int) -> int:
    return max(1, min(n_tasks, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                      else (os.cpu_count() or 1)))


def run_sweep(trace: Trace | CompactTrace, *, ttls: Sequence[float],
              capacities: Sequence[float], policies: Sequence[str],
              kv_bytes_per_token: int = LLAMA3_70B_KV_BYTES_PER_TOKEN,
              time_scale: float = 1.0, progress: bool = True,
              jobs: int | None = None) -> list[SweepRow]:
    """Replay ``trace`` once per TTL x capacity x policy; rows per class and ``all``.
    Bytes are per class only for ``all`` (one store holds every class). Replays
    run in ``jobs`` forked processes (default: one per CPU) that share the
    trace's arrays copy-on-write; one progress bar counts them all."""
    global _SHARED
    ct = compact_of(trace) if isinstance(trace, Trace) else trace
    combos = [(p, c, t) for p in policies for c in capacities for t in ttls]
    n_jobs = default_jobs(len(combos)) if jobs is None else max(1, min(jobs, len(combos)))
    tasks = [(p, c, t, kv_bytes_per_token) for p, c, t in combos]
    results: dict[tuple[str, float, float], Any] = {}
    bar = tqdm(total=len(combos), desc="ttl-sweep", unit="replay", disable=not progress)
    _SHARED = ct
    try:
        if n_jobs == 1 or "fork" not in mp.get_all_start_methods():
            for task in tasks:
                key, st = _replay_one(task)
                results[key] = st
                bar.update()
        else:
            with ProcessPoolExecutor(n_jobs, mp_context=mp.get_context("fork")) as pool:
                for key, st in pool.map(_replay_one, tasks, chunksize=1):
                    results[key] = st
                    bar.update()
    finally:
        _SHARED = None
        bar.close()
    rows: list[SweepRow] = []
    for policy, cap, ttl in combos:
        st = results[(policy, cap, ttl)]
        common = (ttl, cap, policy)
        extra = {"evictions": st.evictions, "expirations": st.expirations,
                 "time_scale": time_scale}
        for cls, cs in st.per_class.items():
            rows.append(SweepRow(cls, *common, cs.hit_rate, cs.token_hit_rate, st.bytes_peak,
                                 st.bytes_mean, **extra))
        rows.append(SweepRow("all", *common, st.hit_rate, st.token_hit_rate, st.bytes_peak,
                             st.bytes_mean, **extra))
    return rows


def format_table(rows: Iterable[SweepRow], classes: bool = True) -> str:
    head = (f"{'policy':<12} {'capacity':>10} {'ttl':>8} {'class':<7} {'hit':>6} {'tok_hit':>7} "
            f"{'GB_peak':>9} {'GB_mean':>9} {'evict':>8} {'expire':>8}")
    lines = [head, "-" * len(head)]
    for r in rows:
        if not classes and r.cls != "all":
            continue
        lines.append(f"{r.policy:<12} {fmt_tokens(r.capacity_tokens):>10} "
                     f"{fmt_seconds(r.ttl_s):>8} {r.cls:<7} {r.hit_rate:6.3f} "
                     f"{r.token_hit_rate:7.3f} {r.bytes_peak / 1e9:9.1f} "
                     f"{r.bytes_mean / 1e9:9.1f} {r.evictions:8d} {r.expirations:8d}")
    return "\n".join(lines)


def fmt_tokens(x: float) -> str:
    if math.isinf(x):
        return "inf"
    for unit, v in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if x >= v:
            return f"{x / v:g}{unit}"
    return f"{x:g}"


def fmt_seconds(x: float) -> str:
    if math.isinf(x):
        return "inf"
    for unit, v in (("d", 86_400), ("h", 3600), ("m", 60)):
        if x >= v and x % v == 0:
            return f"{x / v:g}{unit}"
    return f"{x:g}s"


def plot_sweep(rows: Sequence[Any], path: str | Path, *, title: str = "") -> None:
    """Hit rate vs TTL (one curve per capacity; line style per policy) and
    storage (mean solid, peak dotted) vs TTL for the first policy. Accepts
    SweepRow or WhatIfRow (anything with the same attributes)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    allrows = [r for r in rows if r.cls == "all"]
    if not allrows:
        raise ValueError("no rows to plot")
    finite = sorted({r.ttl_s for r in allrows if math.isfinite(r.ttl_s)})
    # An unlimited TTL is drawn one decade to the right of the largest finite one.
    inf_x = (finite[-1] * 10) if finite else 1.0

    def x_of(t: float) -> float:
        return inf_x if math.isinf(t) else t

    policies = list(dict.fromkeys(r.policy for r in allrows))
    caps = list(dict.fromkeys(r.capacity_tokens for r in allrows))
    styles = ["-", "--", ":", "-.", (0, (3, 1, 1, 1)), (0, (5, 5))]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.8))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ci, cap in enumerate(caps):
        color = colors[ci % len(colors)]
        for pi, pol in enumerate(policies):
            pts = sorted((x_of(r.ttl_s), r.hit_rate) for r in allrows
                         if r.capacity_tokens == cap and r.policy == pol)
            label = f"{fmt_tokens(cap)} tok" + (f" {pol}" if len(policies) > 1 else "")
            ax1.plot(*zip(*pts, strict=True), marker="o", ms=3, color=color,
                     linestyle=styles[pi % len(styles)], label=label)
        pts = sorted((x_of(r.ttl_s), r.bytes_mean / 1e9, r.bytes_peak / 1e9) for r in allrows
                     if r.capacity_tokens == cap and r.policy == policies[0])
        xs, mean, peak = zip(*pts, strict=True)
        ax2.plot(xs, mean, marker="o", ms=3, color=color, label=f"{fmt_tokens(cap)} tok mean")
        ax2.plot(xs, peak, linestyle=":", color=color, label=f"{fmt_tokens(cap)} tok peak")
    ticks = [*finite, inf_x] if any(math.isinf(r.ttl_s) for r in allrows) else finite
    for ax in (ax1, ax2):
        ax.set_xscale("log")
        ax.set_xticks(ticks)
        ax.set_xticklabels([fmt_seconds(t) if t != inf_x else "inf" for t in ticks],
                           rotation=45)
        ax.set_xlabel("TTL")
        ax.grid(True, alpha=0.3)
    ax1.set_ylabel("block hit rate (all classes)")
    ax1.set_title("hit rate vs TTL")
    ax1.legend(fontsize=7, ncol=2 if len(caps) * len(policies) > 8 else 1)
    ax2.set_ylabel("KV bytes stored (GB)")
    ax2.set_title(f"storage vs TTL ({policies[0]})")
    ax2.legend(fontsize=7)
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
