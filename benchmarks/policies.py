"""``kvserve bench policies``: eviction policies against Belady's offline
optimum on trace replays, hit rate and ratio per capacity, and how many block
uses per second each replay core runs."""

from __future__ import annotations

import argparse
import json
import math
import sys
from typing import Any

from common.trace_arrays import CompactTrace
from kvserve.cli import UsageError
from kvserve.trace_args import add_trace_args, load_traces, trace_note
from studies.sweep import fmt_tokens, parse_capacities, parse_policies, parse_ttls


def configure(p: argparse.ArgumentParser) -> None:
    add_trace_args(p, grid=False)
    p.add_argument("--ttl", default="inf", help="one TTL for every replay (default inf)")
    p.add_argument("--policy", default="all", help="policies to compare (Belady is always run)")
    p.add_argument("--engine", choices=("auto", "native", "python"), default="auto",
                   help="replay core: native C where it has the policy (auto), or the "
                        "Python loop (python: the 'before' figures)")
    p.add_argument("--repeat", type=int, default=1, metavar="N",
                   help="time each replay N times and report the best (default 1)")
    p.add_argument("--plot", metavar="PNG",
                   help="write each policy's ratio to Belady vs capacity here")


def run(args: argparse.Namespace) -> int:
    import time

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
                best_s = best_cpu = math.inf
                for _ in range(args.repeat):
                    t0, c0 = time.perf_counter(), time.process_time()
                    st = replay_cache(src, policy=policy, capacity_tokens=c, ttl_s=ttl,
                                      kv_bytes_per_token=args.kv_bytes_per_token,
                                      engine=args.engine)
                    best_s = min(best_s, time.perf_counter() - t0)
                    best_cpu = min(best_cpu, time.process_time() - c0)
                results[policy] = (st, best_s, best_cpu)
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
    if args.plot:
        from studies.sweep import plot_policies

        plot_policies(rows, args.plot)
        print(f"# plot: {args.plot}", file=sys.stderr)
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    print(_policy_table(rows, policies))
    return 0


def _engine_used(engine: str, policy: str) -> str:
    from studies.replay_core import native_supports

    return "native" if engine != "python" and native_supports(policy, None) else "python"


def _policy_table(rows: list[dict[str, Any]], policies: list[str]) -> str:
    """One line per trace x capacity: Belady's hit rate, each policy's hit rate
    and ratio to it, and whether the goal holds (LRU < 0.9 -> best >= 0.95)."""
    cells = {(r["trace"], r["capacity_tokens"], r["policy"]): r for r in rows}
    head = f"{'trace':<26} {'capacity':>9} {'belady':>7} " + " ".join(
        f"{p:>17}" for p in policies) + "  goal"
    out = [head, "-" * len(head)]
    speed = {p: [r["block_uses_per_s"] for r in rows if r["policy"] == p]
             for p in ["belady", *policies]}
    for trace, cap in dict.fromkeys((r["trace"], r["capacity_tokens"]) for r in rows):
        bel = cells[(trace, cap, "belady")]["hit_rate"]
        ratios = {p: cells[(trace, cap, p)]["ratio_to_belady"] for p in policies}
        parts = [f"{cells[(trace, cap, p)]['hit_rate']:.3f} ({ratios[p]:.2f})" for p in policies]
        lru = ratios.get("lru")
        best = max(ratios.values()) if ratios else 0.0
        goal = "n/a (lru>=0.9)" if lru is None or lru >= 0.9 else (
            "met" if best >= 0.95 else "missed")
        out.append(f"{trace[:26]:<26} {fmt_tokens(math.inf if cap is None else cap):>9} "
                   f"{bel:7.3f} " + " ".join(f"{x:>17}" for x in parts) + f"  {goal}")
    out.append(f"{'M block uses/s (median)':<36} " + f"{_median(speed['belady']) / 1e6:7.2f} "
               + " ".join(f"{_median(speed[p]) / 1e6:>17.2f}" for p in policies))
    return "\n".join(out)


def _median(xs: list[float]) -> float:
    return sorted(xs)[len(xs) // 2] if xs else 0.0
