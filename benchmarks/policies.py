"""``kvserve bench policies``: eviction policies against Belady's offline
optimum on trace replays, hit rate and ratio per capacity, and how many block
uses per second each replay core runs."""

from __future__ import annotations

import argparse
import math
import sys
from typing import Any

from benchmarks.harness import Chart, Report, Table, quantile, timed
from common.trace_arrays import CompactTrace
from kvserve.cli import UsageError
from kvserve.trace_args import load_traces, trace_note
from studies.sweep import fmt_seconds, fmt_tokens, parse_capacities, parse_policies, parse_ttls


def report(args: argparse.Namespace) -> Report:
    """``kvserve bench policies``: the flags in, the harness's report out."""
    from tqdm import tqdm

    from studies.sim import compact_of, replay_cache

    try:
        caps = parse_capacities(args.capacity)
        (ttl,) = parse_ttls(args.ttl)
        policies = [p for p in parse_policies(args.policy) if p != "belady"]
    except ValueError as exc:
        raise UsageError(f"{exc} (bench policies takes one --ttl)") from exc
    if args.repeat < 1:
        raise UsageError("--repeat must be >= 1")
    rows: list[dict[str, Any]] = []
    for path in args.traces:
        loaded = load_traces(args, [path])
        print(trace_note(loaded, args), file=sys.stderr)
        # Loading is not timed: the trace is converted to arrays once, up front.
        trace = loaded if isinstance(loaded, CompactTrace) else compact_of(loaded)
        py_trace = None          # request objects, built once if a Python policy runs
        uses = trace.n_uses
        for cap in tqdm(caps, desc=trace.name, unit="capacity", file=sys.stderr):
            c = None if math.isinf(cap) else cap
            results = {}
            for policy in ["belady", *policies]:
                if _engine_used(args.engine, policy) == "python" and py_trace is None:
                    py_trace = trace.to_trace()
                src = py_trace if _engine_used(args.engine, policy) == "python" else trace
                last: list[Any] = []

                def replay(src: Any = src, policy: str = policy, c: float | None = c,
                           last: list[Any] = last) -> None:
                    last[:] = [replay_cache(src, policy=policy, capacity_tokens=c, ttl_s=ttl,
                                            kv_bytes_per_token=args.kv_bytes_per_token,
                                            engine=args.engine)]

                tm = timed(replay, repeats=args.repeat, warmup=0)
                results[policy] = (last[0], tm.min, min(tm.cpu))
            best = results["belady"][0]
            for policy, (st, secs, cpu) in results.items():
                rows.append({"trace": trace.name, "capacity_tokens": c, "ttl_s":
                             None if math.isinf(ttl) else ttl, "policy": policy,
                             "hit_rate": st.hit_rate, "token_hit_rate": st.token_hit_rate,
                             "belady_hit_rate": best.hit_rate,
                             "ratio_to_belady": st.hit_rate / best.hit_rate
                             if best.hit_rate else 1.0, "evictions": st.evictions,
                             "block_uses_per_s": uses / secs if secs > 0 else math.inf,
                             # CPU time of this process: one core's rate on a loaded machine
                             "block_uses_per_cpu_s": uses / cpu if cpu > 0 else math.inf,
                             "engine": _engine_used(args.engine, policy)})
    return Report(f"eviction policies against Belady's optimum, TTL {fmt_seconds(ttl)}: hit "
                  "rate (ratio to Belady); goal: where LRU < 0.9 of Belady, the best policy "
                  ">= 0.95", rows, [_table(rows, policies)], chart=_chart(rows))


def _engine_used(engine: str, policy: str) -> str:
    from studies.replay_core import native_supports

    return "native" if engine != "python" and native_supports(policy, None) else "python"


def _table(rows: list[dict[str, Any]], policies: list[str]) -> Table:
    """One line per trace x capacity: Belady's hit rate, each policy's hit rate
    and ratio to it, and whether the goal holds (LRU < 0.9 -> best >= 0.95)."""
    cells = {(r["trace"], r["capacity_tokens"], r["policy"]): r for r in rows}
    table = Table(("trace", "capacity", "belady", *policies, "goal"))
    for trace, cap in dict.fromkeys((r["trace"], r["capacity_tokens"]) for r in rows):
        ratios = {p: cells[(trace, cap, p)]["ratio_to_belady"] for p in policies}
        lru = ratios.get("lru")
        best = max(ratios.values()) if ratios else 0.0
        goal = "n/a (lru>=0.9)" if lru is None or lru >= 0.9 else (
            "met" if best >= 0.95 else "missed")
        table.add(trace[:26], fmt_tokens(math.inf if cap is None else cap),
                  f"{cells[(trace, cap, 'belady')]['hit_rate']:.3f}",
                  *[f"{cells[(trace, cap, p)]['hit_rate']:.3f} ({ratios[p]:.2f})"
                    for p in policies], goal)
    speed = {p: [r["block_uses_per_s"] for r in rows if r["policy"] == p]
             for p in ["belady", *policies]}
    table.add("M block uses/s (median)", "",
              *[f"{quantile(speed[p], 0.5) / 1e6:.2f}" if speed[p] else "" for p in speed], "")
    return table


def _chart(rows: list[dict[str, Any]]) -> Chart:
    """Each policy's hit rate as a fraction of Belady's vs capacity (one line per
    trace and policy), the 0.95 goal and the 0.9 line drawn."""
    mine = [r for r in rows if r["policy"] != "belady" and r["capacity_tokens"] is not None]
    caps = tuple(sorted({r["capacity_tokens"] for r in mine}))
    cells = {(r["trace"], r["policy"], r["capacity_tokens"]): r["ratio_to_belady"] for r in mine}
    lines = dict.fromkeys((r["trace"], r["policy"]) for r in mine)
    many = len({trace for trace, _ in lines}) > 1
    return Chart("hit rate / Belady's vs capacity", caps,
                 {(f"{trace[:20]} {policy}" if many else policy):
                  [cells.get((trace, policy, c)) for c in caps] for trace, policy in lines},
                 ylabel="hit rate / Belady's", xlabel="capacity (tokens)", kind="line",
                 logx=10, refs=(("goal 0.95", 0.95), ("0.9", 0.9)))
