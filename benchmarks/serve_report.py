"""Figures of ``kvserve bench serve``: per point, the table, the PNGs and the JSON.

JSON (``--json``): ``kvserve`` and ``peer`` each hold ``ttft_p50_s``,
``ttft_p90_s``, ``tpot_p50_s``, ``goodput_rps``, ``cached_token_fraction``,
``errors`` (and more) at the highest speed both systems ran; ``ratios`` divides
kvserve's by the peer's; ``points`` lists every point of both.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.harness import Table
from benchmarks.serve_tools import ToolRun


@dataclass(frozen=True, slots=True)
class Slo:
    ttft_s: float = 10.0
    tpot_s: float = 1.0

    def met(self, ttft_s: float, tpot_s: float) -> bool:
        return ttft_s <= self.ttft_s and tpot_s <= self.tpot_s


@dataclass(frozen=True, slots=True)
class PointResult:
    system: str
    speed: float
    offered_rps: float
    requests: int
    errors: int
    duration_s: float
    ttft_p50_s: float
    ttft_p90_s: float
    ttft_p99_s: float
    tpot_p50_s: float
    goodput_rps: float
    cached_token_fraction: float       # server counters: hits / queries
    prompt_tokens: int
    effective_prefill_tps: float       # all prompt tokens served (cached included) per second
    tool_result: str


KEYS = ("ttft_p50_s", "ttft_p90_s", "tpot_p50_s", "goodput_rps", "cached_token_fraction",
        "errors")


def _pct(xs: Sequence[float], p: float) -> float:
    return float(np.percentile(xs, p)) if len(xs) else 0.0


def point_result(system: str, speed: float, offered: float, run: ToolRun,
                 before: dict[str, float], after: dict[str, float], slo: Slo) -> PointResult:
    ok = [r for r in run.requests if r.ok]
    ttfts = [r.ttft_s for r in ok]
    tpots = [r.tpot_s for r in ok if r.output_tokens > 1]
    met = sum(1 for r in ok if slo.met(r.ttft_s, r.tpot_s))
    dur = run.duration_s or 1e-9
    q = after.get("vllm:prefix_cache_queries_total", 0) - before.get(
        "vllm:prefix_cache_queries_total", 0)
    h = after.get("vllm:prefix_cache_hits_total", 0) - before.get(
        "vllm:prefix_cache_hits_total", 0)
    prompt = sum(r.prompt_tokens for r in ok)
    return PointResult(system=system, speed=speed, offered_rps=offered,
                       requests=len(run.requests), errors=len(run.requests) - len(ok),
                       duration_s=run.duration_s, ttft_p50_s=_pct(ttfts, 50),
                       ttft_p90_s=_pct(ttfts, 90), ttft_p99_s=_pct(ttfts, 99),
                       tpot_p50_s=_pct(tpots, 50), goodput_rps=met / dur,
                       cached_token_fraction=h / q if q > 0 else 0.0, prompt_tokens=prompt,
                       effective_prefill_tps=prompt / dur, tool_result=str(run.raw))


def summary(results: Sequence[PointResult], *, trace: str, trace_reuse: float, slo: Slo,
            g1: str, tool: str, peer: str) -> dict[str, Any]:
    by = {(r.system, r.speed): r for r in results}
    speeds = sorted({r.speed for r in results})
    both = [s for s in speeds if ("kvserve", s) in by and ("peer", s) in by]
    top = both[-1] if both else (speeds[-1] if speeds else 0.0)
    doc: dict[str, Any] = {"trace": trace, "trace_reuse_fraction": trace_reuse, "tool": tool,
                           "peer": peer, "g1": g1, "slo": {"ttft_s": slo.ttft_s,
                                                          "tpot_s": slo.tpot_s},
                           "speed": top, "points": [asdict(r) for r in results]}
    for name in ("kvserve", "peer"):
        r = by.get((name, top))
        doc[name] = None if r is None else {**{k: getattr(r, k) for k in KEYS},
                                            "requests": r.requests,
                                            "ttft_p99_s": r.ttft_p99_s,
                                            "offered_rps": r.offered_rps,
                                            "effective_prefill_tps": r.effective_prefill_tps}
    if doc["kvserve"] and doc["peer"]:
        doc["ratios"] = {k: (doc["kvserve"][k] / doc["peer"][k] if doc["peer"][k] else None)
                         for k in (*KEYS, "ttft_p99_s", "effective_prefill_tps")}
        if doc["kvserve"]["errors"] or doc["peer"]["errors"]:
            # Latency percentiles cover completed requests only (as the tools' own do).
            doc["caveat"] = (f"errors: kvserve {doc['kvserve']['errors']}, peer "
                             f"{doc['peer']['errors']} of {doc['kvserve']['requests']}; TTFT "
                             "and TPOT cover completed requests only")
    else:
        doc["ratios"] = None
    return doc


def table(results: Sequence[PointResult]) -> Table:
    """One row per system and speed (latencies over completed requests, as the tools')."""
    t = Table(("system", "speed", "offered req/s", "ok", "TTFT p50 s", "p90 s", "p99 s",
               "TPOT p50 s", "goodput req/s", "cached %", "prefill tok/s"))
    for r in results:
        t.add(r.system, r.speed, r.offered_rps, f"{r.requests - r.errors}/{r.requests}",
              r.ttft_p50_s, r.ttft_p90_s, r.ttft_p99_s, r.tpot_p50_s, r.goodput_rps,
              100 * r.cached_token_fraction, r.effective_prefill_tps)
    return t


def write_pngs(results: Sequence[PointResult], trace_reuse: float, slo: Slo,
               first: Path) -> list[Path]:
    """TTFT and TPOT vs rate into ``first``; goodput and the cache/prefill figures
    beside it (``<stem>-goodput.png``, ``<stem>-cache.png``)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    systems = sorted({r.system for r in results})
    series = {s: sorted((r for r in results if r.system == s), key=lambda r: r.speed)
              for s in systems}
    paths = []

    def save(fig: Any, name: str) -> None:
        path = first if name == "ttft_tpot" else first.with_name(f"{first.stem}-{name}.png")
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)

    color = {s: f"C{i}" for i, s in enumerate(systems)}
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for s, rs in series.items():
        x = [r.offered_rps for r in rs]
        for attr, style in (("ttft_p50_s", "-o"), ("ttft_p90_s", "--s"), ("ttft_p99_s", ":^")):
            a.plot(x, [getattr(r, attr) for r in rs], style, color=color[s],
                   label=f"{s} {attr[5:8]}")
        b.plot(x, [r.tpot_p50_s for r in rs], "-o", color=color[s], label=f"{s} p50")
    a.set(xlabel="offered rate (req/s)", ylabel="TTFT (s)",
          title="TTFT vs offered rate (completed requests)")
    b.set(xlabel="offered rate (req/s)", ylabel="TPOT (s)", title="TPOT vs offered rate")
    a.legend(fontsize=7)
    b.legend(fontsize=7)
    save(fig, "ttft_tpot")

    fig, a = plt.subplots(figsize=(6, 4))
    for s, rs in series.items():
        a.plot([r.offered_rps for r in rs], [r.goodput_rps for r in rs], "-o", label=s)
    a.set(xlabel="offered rate (req/s)", ylabel="goodput (req/s)",
          title=f"goodput (TTFT <= {slo.ttft_s:g} s, TPOT <= {slo.tpot_s:g} s)")
    a.legend()
    save(fig, "goodput")

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for s, rs in series.items():
        a.plot([r.offered_rps for r in rs], [100 * r.cached_token_fraction for r in rs], "-o",
               label=s)
        b.plot([r.offered_rps for r in rs], [r.effective_prefill_tps for r in rs], "-o", label=s)
    a.axhline(100 * trace_reuse, color="grey", linestyle="--", label="trace reuse")
    a.set(xlabel="offered rate (req/s)", ylabel="cached prompt tokens (%)",
          title="achieved prompt-cache hit rate")
    b.set(xlabel="offered rate (req/s)", ylabel="prompt tokens / s",
          title="effective prefill (cached included)")
    a.legend()
    b.legend()
    save(fig, "cache")
    return paths
