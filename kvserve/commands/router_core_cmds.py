"""``kvserve eplb`` and ``kvserve replay``: the router's placement library
from the command line (docs/router.md)."""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from kvserve.cli import CommandRegistry, UsageError

# ------------------------------------------------------------------ eplb


def _eplb_configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--plan", action="append", required=True, metavar="FILE",
                   help="expert-load recording to plan from (repeat to plan over several)")
    p.add_argument("--eval", required=True, metavar="FILE",
                   help="recording the plan is judged on (use one not planned on)")
    p.add_argument("--ranks", type=int, default=72)
    p.add_argument("--redundant", type=int, default=32, help="redundant expert replicas")
    p.add_argument("--kappa", type=float, default=1.0,
                   help="weight of load uncertainty in the robust plan (0 = plan on the mean)")
    p.add_argument("--rel-sigma", type=float, default=0.25,
                   help="prior relative drift of an expert's load share between workloads")
    p.add_argument("--sweeps", type=int, default=8, help="passes of the dispatch rule")
    p.add_argument("--out", metavar="FILE", help="write the plan (decode_svc placement JSON)")
    p.add_argument("--png", metavar="FILE", help="per-layer imbalance chart")
    p.add_argument("--json", action="store_true", help="print results as JSON")


def _eplb_run(args: argparse.Namespace) -> int:
    from eplb.evaluate import ExpertLoadError, load_expert_loads, score_plan
    from eplb.plan import EplbConfig, plan

    try:
        cfg = EplbConfig(ranks=args.ranks, redundant=args.redundant, kappa=args.kappa,
                         rel_sigma=args.rel_sigma)
        recs = [load_expert_loads(f) for f in args.plan]
        ev = load_expert_loads(args.eval)
        result = plan(recs, cfg)
        if ev.shape[1] != result.n_experts:
            raise ExpertLoadError(f"{args.eval} has {ev.shape[1]} experts, the plan "
                                  f"{result.n_experts}")
        score = score_plan(result.layers, ev, sweeps=args.sweeps)
        greedy = score_plan(plan(recs, replace(cfg, method="greedy")).layers, ev,
                            sweeps=args.sweeps)
    except (ExpertLoadError, ValueError) as exc:
        raise UsageError(str(exc)) from exc
    if args.out:
        result.save(args.out)
    in_sample = [Path(f).resolve() == Path(args.eval).resolve() for f in args.plan]
    counts = {li: p.counts for li, p in result.layers.items()}
    out: dict[str, Any] = {
        "plan_files": args.plan, "eval_file": args.eval,
        "out_of_sample": not any(in_sample),
        "ranks": cfg.ranks, "redundant": cfg.redundant,
        "slots_per_rank": result.slots_per_rank, "experts": result.n_experts,
        "moe_layers": len(score.layers),
        "imbalance_contiguous": score.contiguous,
        "imbalance_plan": score.dispatch,
        "imbalance_plan_static": score.static,
        "imbalance_plan_dispatch": score.dispatch,
        "imbalance_greedy_static": greedy.static,
        "imbalance_greedy_dispatch": greedy.dispatch,
        "headline": "imbalance_plan = imbalance_plan_dispatch (runtime dispatch rule); "
                    "greedy = plain baseline (mean loads, balanced packing)",
        "dispatch_rule": ("per step, replicated experts heaviest first; each expert's tokens "
                          "water-fill its replicas' ranks (lowest first to a common level); "
                          f"{args.sweeps} passes"),
        "per_layer": [{"layer": s.layer, "contiguous": s.contiguous, "static": s.static,
                       "dispatch": s.dispatch,
                       "replicated_experts": int((counts[s.layer] > 1).sum()),
                       "max_replicas": int(counts[s.layer].max())} for s in score.layers],
    }
    if args.png:
        _eplb_png(args.png, score, args.eval)
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    warn = "" if out["out_of_sample"] else "  (IN SAMPLE: --eval is also a --plan file)"
    print(f"plan: {', '.join(args.plan)}\neval: {args.eval}{warn}")
    print(f"{cfg.ranks} ranks x {result.slots_per_rank} slots, {cfg.redundant} redundant, "
          f"{len(score.layers)} MoE layers")
    print(f"{'placement':<28}{'imbalance (mean over layers)':>30}")
    print(f"{'contiguous':<28}{score.contiguous:>30.3f}")
    print(f"{'greedy, static equal split':<28}{greedy.static:>30.3f}")
    print(f"{'greedy, dispatch rule':<28}{greedy.dispatch:>30.3f}")
    print(f"{'plan, static equal split':<28}{score.static:>30.3f}")
    print(f"{'plan, dispatch rule':<28}{score.dispatch:>30.3f}")
    return 0


def _eplb_png(path: str, score: Any, eval_file: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    layers = [s.layer for s in score.layers]
    fig, ax = plt.subplots(figsize=(9, 4))
    for key, label in (("contiguous", "contiguous"), ("static", "plan, static split"),
                       ("dispatch", "plan, dispatch rule")):
        ax.plot(layers, [getattr(s, key) for s in score.layers], label=label)
    ax.set_yscale("log")
    ax.set_xlabel("layer")
    ax.set_ylabel("max / mean rank load")
    ax.set_title(f"expert imbalance on {Path(eval_file).name}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ------------------------------------------------------------------ replay


def _replay_configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--trace", required=True, metavar="FILE",
                   help="Mooncake/Bailian JSONL or a Claude Code session archive")
    p.add_argument("--policy", required=True,
                   help="routing policy, comma-separated list or 'all' (cluster replay), or "
                        "an eviction policy (single-store cache replay)")
    p.add_argument("--instances", type=int, default=8)
    p.add_argument("--load", type=float, default=None,
                   help="arrival-rate multiplier (default: calibrated so round_robin is "
                        "--target-busy busy)")
    p.add_argument("--target-busy", type=float, default=0.7)
    p.add_argument("--capacity-tokens", default="3000000",
                   help="per-instance store capacity in tokens, per tier: G2[,G3[,G4]] "
                        "('inf' = unlimited)")
    p.add_argument("--ttl", type=float, default=math.inf, help="block TTL in seconds")
    p.add_argument("--eviction", default="lru", help="eviction policy of the stores")
    p.add_argument("--cost", metavar="FILE",
                   help="cost model JSON (coefficients, points, or kvserve bench engine --json)")
    p.add_argument("--arrival", default="auto", choices=("auto", "scale", "sessions"))
    p.add_argument("--block-tokens", type=int, default=None,
                   help="coarsen the trace's blocks to this size (faster replays)")
    p.add_argument("--max-requests", type=int, default=None)
    p.add_argument("--max-sessions", type=int, default=None,
                   help="agent archives: a seeded random subset of sessions")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--png", metavar="FILE", help="TTFT distribution chart")
    p.add_argument("--json", action="store_true", help="print results as JSON")


def _capacities(text: str) -> tuple[int | None, ...]:
    out: list[int | None] = []
    for part in text.split(","):
        part = part.strip().lower()
        try:
            out.append(None if part in ("inf", "none") else int(float(part)))
        except ValueError:
            raise UsageError(f"--capacity-tokens: {part!r} is not a number of tokens") from None
    return tuple(out)


def _replay_run(args: argparse.Namespace) -> int:
    from common.traces import TraceFormatError, load_trace, rebin
    from router.placement import UnknownPolicyError, router_policy_names
    from studies.replay import ReplayConfig, policy_kind, replay_cluster, replay_eviction
    from studies.replay_cost import CostModel, CostModelError

    names = router_policy_names() if args.policy == "all" else [
        s.strip() for s in args.policy.split(",") if s.strip()]
    try:
        kinds = {policy_kind(n) for n in names}
        if len(kinds) != 1 or ("eviction" in kinds and len(names) > 1):
            raise UsageError("--policy: give routing policies, or one eviction policy")
        cfg = ReplayConfig(instances=args.instances, load=args.load,
                           target_busy=args.target_busy,
                           capacity_tokens=_capacities(args.capacity_tokens), ttl_s=args.ttl,
                           eviction=args.eviction, arrival=args.arrival,
                           progress=sys.stderr.isatty())
        cost = CostModel.from_json(args.cost) if args.cost else CostModel.default()
        trace = load_trace(args.trace, max_requests=args.max_requests, seed=args.seed,
                           max_sessions=args.max_sessions)
        if args.block_tokens:
            trace = rebin(trace, args.block_tokens)
    except (UnknownPolicyError, TraceFormatError, CostModelError, ValueError) as exc:
        raise UsageError(str(exc)) from exc
    head = {"trace": trace.name, "requests": len(trace.requests),
            "block_tokens": trace.block_tokens, "arrival_note": trace.arrival_note}
    if kinds == {"eviction"}:
        res = replay_eviction(trace, names[0], cfg)
        out = {**head, "mode": "cache", **asdict(res)}
        if args.json:
            print(json.dumps(out, indent=2))
        else:
            print(f"{trace.name}: {res.requests} requests, one store of "
                  f"{args.capacity_tokens} tokens, {res.policy}: hit rate {res.hit_rate:.3f}, "
                  f"token hit rate {res.token_hit_rate:.3f}")
        return 0
    results, calib = replay_cluster(trace, names, cfg, cost)
    common = {**head, "mode": "cluster", "instances": cfg.instances,
              "capacity_tokens": list(cfg.capacity_tokens), "load": results[0].load,
              "load_note": ("given" if calib is None else
                            f"calibrated: round_robin {calib.utilization:.2f} busy "
                            f"(target {cfg.target_busy}"
                            f"{'' if calib.reached else ', NOT reachable with this trace'}"
                            f"); steps {list(calib.steps)}"),
              "cost_model": {"a_s": cost.a_s, "b_s_per_token": cost.b_s_per_token,
                             "c_s_per_token2": cost.c_s_per_token2, "source": cost.source}}
    rows = [_result_json(r) for r in results]
    if args.png:
        _replay_png(args.png, results, trace.name)
    if args.json:
        out = {**common, **rows[0]} if len(rows) == 1 else {**common, "results": rows}
        print(json.dumps(out, indent=2))
        return 0
    print(f"{trace.name}: {len(trace.requests)} requests, {cfg.instances} instances, "
          f"load x{common['load']:.3g} ({common['load_note'].split(';')[0]})")
    print(f"{'policy':<20}{'hit':>7}{'tok hit':>9}{'p50 s':>9}{'p90 s':>9}{'p99 s':>9}"
          f"{'busy':>7}{'imbal':>7}")
    for r in results:
        print(f"{r.policy:<20}{r.hit_rate:>7.3f}{r.token_hit_rate:>9.3f}{r.ttft_p50_s:>9.2f}"
              f"{r.ttft_p90_s:>9.2f}{r.ttft_p99_s:>9.2f}{r.utilization:>7.2f}"
              f"{r.imbalance:>7.2f}")
    return 0


def _result_json(r: Any) -> dict[str, Any]:
    return {"policy": r.policy, "hit_rate": r.hit_rate, "token_hit_rate": r.token_hit_rate,
            "ttft_p50_s": r.ttft_p50_s, "ttft_p90_s": r.ttft_p90_s, "ttft_p99_s": r.ttft_p99_s,
            "ttft_mean_s": r.ttft_mean_s, "imbalance": r.imbalance,
            "utilization": r.utilization,
            "per_instance": [asdict(i) for i in r.per_instance]}


def _replay_png(path: str, results: Any, name: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, ax = plt.subplots(figsize=(7, 4))
    for r in results:
        x = np.sort(r.ttft_s)
        ax.plot(x, np.arange(1, len(x) + 1) / len(x), label=r.policy)
    ax.set_xscale("log")
    ax.set_xlabel("TTFT (s)")
    ax.set_ylabel("fraction of requests")
    ax.set_title(f"{name}: TTFT at the same load")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ------------------------------------------------------------------ bench router


def register(reg: CommandRegistry) -> None:
    reg.add("eplb", help="plan expert placement with redundant experts and judge it on "
            "another recording", configure=_eplb_configure, run=_eplb_run)
    reg.add("replay", help="replay a request trace through placement policies and "
            "simulated stores", configure=_replay_configure, run=_replay_run)


__all__ = ["register"]
