"""Operators' retention tools: ``kvserve ttl-sweep``, ``kvserve whatif --fit``
and ``kvserve store whatif`` (docs/operators.md explains how to read them)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import zlib
from collections.abc import Sequence
from typing import Any

from common.trace_arrays import CompactTrace
from common.traces import Trace
from kvserve.cli import CommandRegistry, UsageError
from kvserve.trace_args import add_trace_args, load_traces, trace_note
from studies.sweep import (
    fmt_seconds,
    fmt_tokens,
    format_table,
    parse_capacities,
    parse_policies,
    parse_ttls,
    plot_sweep,
    run_sweep,
)


def _grid(args: argparse.Namespace) -> tuple[list[float], list[float]]:
    try:
        return parse_ttls(args.ttl), parse_capacities(args.capacity)
    except ValueError as exc:
        raise UsageError(str(exc)) from exc


# ------------------------------------------------------------ ttl-sweep

def _configure_sweep(p: argparse.ArgumentParser) -> None:
    add_trace_args(p)
    p.add_argument("--policy", default="all",
                   help="eviction policies, comma-separated (default all, Belady included)")
    p.add_argument("--plot", metavar="PNG", help="write hit rate and storage vs TTL here")
    p.add_argument("--all-classes", action="store_true",
                   help="text table: show every class, not only 'all'")
    p.add_argument("--jobs", type=int, default=None, metavar="N",
                   help="replays in parallel processes (default: one per CPU)")


def _sweep(args: argparse.Namespace) -> int:
    ttls, caps = _grid(args)
    try:
        policies = parse_policies(args.policy)
    except ValueError as exc:
        raise UsageError(str(exc)) from exc
    trace = load_traces(args)
    note = trace_note(trace, args)
    print(note, file=sys.stderr)
    if args.jobs is not None and args.jobs < 1:
        raise UsageError("--jobs must be >= 1")
    rows = run_sweep(trace, ttls=ttls, capacities=caps, policies=policies,
                     kv_bytes_per_token=args.kv_bytes_per_token, time_scale=args.time_scale,
                     jobs=args.jobs)
    if args.plot:
        plot_sweep(rows, args.plot, title=f"{trace.name}, time scale {args.time_scale:g}")
        print(f"# plot: {args.plot}", file=sys.stderr)
    if args.json:
        print(json.dumps([r.as_json() for r in rows], indent=1))
    else:
        print(note)
        print(format_table(rows, classes=args.all_classes or _has_classes(rows)))
    return 0


def _has_classes(rows: Sequence[Any]) -> bool:
    return len({r.cls for r in rows}) > 2


# ------------------------------------------------------------ what-if

def _configure_whatif(p: argparse.ArgumentParser) -> None:
    add_trace_args(p, "--fit")
    p.add_argument("--max-tracked", type=int, default=65_536,
                   help="sampled blocks the estimator tracks (bounded memory)")
    p.add_argument("--check", action="store_true",
                   help="also replay each TTL x capacity (LRU) and show the replayed rate")
    p.add_argument("--split", choices=("none", "time", "session"), default="none",
                   help="held-out check: fit on the first half (in time, or by session "
                        "hash) and replay the other half for --check")
    p.add_argument("--plot", metavar="PNG", help="write predicted hit rate and storage vs TTL")


def _whatif(args: argparse.Namespace) -> int:
    from kvstore.whatif import WhatIfEstimator, fit_trace
    from studies.sim import replay_cache

    ttls, caps = _grid(args)
    loaded = load_traces(args)
    trace = loaded.to_trace() if isinstance(loaded, CompactTrace) else loaded
    note = trace_note(trace, args)
    print(note, file=sys.stderr)
    fit_on, check_on = split_trace(trace, args.split)
    if args.split != "none":
        note += (f"\n# fitted on {len(fit_on.requests)} requests, replay column on the other "
                 f"{len(check_on.requests)} ({args.split} split)")
    est = fit_trace(fit_on, estimator=WhatIfEstimator(max_tracked=args.max_tracked))
    rows = est.predict(ttls, caps, kv_bytes_per_token=args.kv_bytes_per_token)
    docs = [r.as_json() for r in rows]
    if args.check:
        for doc, r in zip(docs, rows, strict=True):
            if r.cls != "all":
                continue
            st = replay_cache(check_on, capacity_tokens=None if math.isinf(r.capacity_tokens)
                              else r.capacity_tokens, ttl_s=r.ttl_s,
                              kv_bytes_per_token=args.kv_bytes_per_token)
            doc["replay_hit_rate"] = st.hit_rate
            doc["replay_token_hit_rate"] = st.token_hit_rate
    if args.plot:
        plot_sweep(rows, args.plot, title=f"what-if fitted on {trace.name}")
    _print_whatif(docs, args.json, note + f"\n# estimator sampling rate {est.rate:.4g}")
    return 0


def split_trace(trace: Trace, how: str) -> tuple[Trace, Trace]:
    """Two halves of a trace: by time (first half of the requests, then the
    rest) or by session (a stable hash of the session name); "none" = itself twice."""
    if how == "none":
        return trace, trace
    if how == "time":
        mid = len(trace.requests) // 2
        halves = (trace.requests[:mid], trace.requests[mid:])
    else:
        first = [zlib.crc32(r.session.split("/")[0].encode()) % 2 == 0 for r in trace.requests]
        halves = (tuple(r for r, f in zip(trace.requests, first, strict=True) if f),
                  tuple(r for r, f in zip(trace.requests, first, strict=True) if not f))
    if not halves[0] or not halves[1]:
        raise UsageError(f"--split {how}: one half of {trace.name} is empty")
    return (dataclasses.replace(trace, requests=halves[0]),
            dataclasses.replace(trace, requests=halves[1]))


def _print_whatif(docs: list[dict[str, Any]], as_json: bool, note: str) -> None:
    if as_json:
        print(json.dumps(docs, indent=1))
        return
    print(note)
    head = (f"{'capacity':>10} {'ttl':>8} {'class':<7} {'hit':>6} {'+-':>6} {'tok_hit':>7} "
            f"{'GB_peak':>9} {'GB_mean':>9} {'replay':>7}")
    print(head)
    print("-" * len(head))
    for d in docs:
        cap = math.inf if d["capacity_tokens"] is None else d["capacity_tokens"]
        ttl = math.inf if d["ttl_s"] is None else d["ttl_s"]
        rep = f"{d['replay_hit_rate']:7.3f}" if "replay_hit_rate" in d else ""
        print(f"{fmt_tokens(cap):>10} {fmt_seconds(ttl):>8} {d['class']:<7} "
              f"{d['hit_rate']:6.3f} {d.get('hit_rate_bound', 0.0):6.3f} "
              f"{d['token_hit_rate']:7.3f} {d['bytes_peak'] / 1e9:9.1f} "
              f"{d['bytes_mean'] / 1e9:9.1f} {rep}")


def _configure_store_whatif(p: argparse.ArgumentParser) -> None:
    p.add_argument("--address", default=None, metavar="HOST:PORT",
                   help="the kvstore's gRPC address (default: the one `kvserve up` runs)")
    p.add_argument("--ttl", required=True, help="TTL list, e.g. 60,5m,1h,3d,inf")
    p.add_argument("--capacity", required=True, help="capacity list in tokens, e.g. 1e6,3M,inf")
    p.add_argument("--kv-bytes-per-token", type=int, default=None,
                   help="KV bytes per token for storage figures (default: the served "
                        "model's, from --model)")
    p.add_argument("--model", default=None,
                   help="served model whose KV size sizes the bytes (default: the model "
                        "`kvserve up` runs, else [model].name)")
    p.add_argument("--dtype", default=None, help="KV dtype (default [model].dtype)")
    p.add_argument("--config", default=None, help="kvserve TOML config file")
    p.add_argument("--timeout", type=float, default=10.0, help="gRPC deadline, seconds")
    p.add_argument("--json", action="store_true", help="print the rows as a JSON list")


def _store_whatif(args: argparse.Namespace) -> int:
    import grpc

    from kvserve.launcher import stack_security
    from kvstore.whatif import WhatIfEstimator
    from proto import kvstore_pb2, kvstore_pb2_grpc

    ttls, caps = _grid(args)
    _served_model_defaults(args)
    try:
        with stack_security().sync_channel(args.address, "kvstore") as channel:
            reply = kvstore_pb2_grpc.KVStoreStub(channel).Stats(
                kvstore_pb2.StatsRequest(), timeout=args.timeout)
    except grpc.RpcError as exc:
        raise UsageError(f"store at {args.address}: {exc.code().name}: {exc.details()}") from exc
    if not reply.whatif_json:
        raise UsageError(f"store at {args.address} ({reply.node}) keeps no what-if estimator")
    try:
        est = WhatIfEstimator.from_json(reply.whatif_json)
    except ValueError as exc:
        raise UsageError(f"store at {args.address}: {exc}") from exc
    rows = est.predict(ttls, caps, kv_bytes_per_token=args.kv_bytes_per_token)
    span = (est.t_last - est.t_first) if est.t_first is not None else 0.0
    _print_whatif([r.as_json() for r in rows], args.json,
                  f"# store {reply.node} at {args.address}: {span:.0f} s of traffic, "
                  f"sampling rate {est.rate:.4g}; bytes at {args.kv_bytes_per_token:,} KV "
                  f"bytes/token ({args.kv_source})")
    return 0


def _served_model_defaults(args: argparse.Namespace) -> None:
    """Fill --address and --kv-bytes-per-token from the running stack and its
    model, so storage figures are in the served model's bytes."""
    from kvserve.commands.serve_cmds import load_config
    from kvserve.launcher import UpState

    state = UpState.load()
    cfg = load_config(args.config or (state.config if state else None))
    if args.address is None:
        if state is None:
            raise UsageError("no kvstore: pass --address HOST:PORT or start `kvserve up`")
        args.address = state.store
    if args.kv_bytes_per_token is not None:
        args.kv_source = "--kv-bytes-per-token"
        return
    model = args.model or (state.model if state else cfg.model.name)
    dtype = args.dtype or cfg.model.dtype
    args.kv_bytes_per_token = kv_bytes_per_token(model, dtype)
    args.kv_source = f"{model}, {dtype}"


def kv_bytes_per_token(model: str, dtype: str) -> int:
    """K and V of every layer for one token: layers x 2 x kv_heads x head_dim x dtype size."""
    from engine.errors import ModelConfigError
    from router.model_meta import load_model_meta

    try:
        mc = load_model_meta(model).config
    except ModelConfigError as exc:
        raise UsageError(str(exc)) from exc
    sizes = {"float32": 4, "bfloat16": 2, "float16": 2}
    if dtype not in sizes:
        raise UsageError(f"--dtype {dtype!r}: choose one of {sorted(sizes)}")
    return mc.num_layers * 2 * mc.num_kv_heads * mc.head_dim * sizes[dtype]


# ------------------------------------------------------------ trace files

def _configure_synth(p: argparse.ArgumentParser) -> None:
    from studies.trace_synth import SynthConfig

    p.add_argument("--out", required=True, metavar="DIR", help="compact trace directory to write")
    for f in dataclasses.fields(SynthConfig):
        kind = _int_arg if isinstance(f.default, int) else float
        p.add_argument(f"--{f.name.replace('_', '-')}", type=kind, default=f.default,
                       help=f"(default {f.default:g})")


def _int_arg(text: str) -> int:
    """An integer that may be written 100e6."""
    v = float(text)
    if v != int(v):
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer")
    return int(v)


def _synth(args: argparse.Namespace) -> int:
    import time

    from studies.trace_synth import SynthConfig, synth

    try:
        cfg = SynthConfig(**{f.name: getattr(args, f.name)
                             for f in dataclasses.fields(SynthConfig)})
    except ValueError as exc:
        raise UsageError(str(exc)) from exc
    t0 = time.monotonic()
    ct = synth(cfg, args.out)
    print(f"# wrote {args.out}: {ct.n_requests} requests, {ct.n_uses} block uses of "
          f"{ct.block_tokens} tokens, {ct.n_keys} block ids, span {ct.span_s:.0f} s, "
          f"{ct.nbytes() / max(ct.n_uses, 1):.2f} bytes/use, {time.monotonic() - t0:.1f} s")
    return 0


def _configure_compact(p: argparse.ArgumentParser) -> None:
    add_trace_args(p, grid=False, capacity=False)
    p.add_argument("--out", required=True, metavar="DIR", help="compact trace directory to write")


def _compact(args: argparse.Namespace) -> int:
    loaded = load_traces(args)
    ct = loaded if isinstance(loaded, CompactTrace) else CompactTrace.from_trace(loaded)
    ct.save(args.out)
    print(f"# wrote {args.out}: {ct.n_requests} requests, {ct.n_uses} block uses, "
          f"{ct.nbytes() / max(ct.n_uses, 1):.2f} bytes/use")
    return 0


def _configure_reuse(p: argparse.ArgumentParser) -> None:
    add_trace_args(p, grid=False, capacity=False)
    p.add_argument("--json", action="store_true", help="print the rows as a JSON list")


def _reuse(args: argparse.Namespace) -> int:
    from studies.reuse import reuse_features

    loaded = load_traces(args)
    ct = loaded if isinstance(loaded, CompactTrace) else CompactTrace.from_trace(loaded)
    print(trace_note(loaded, args), file=sys.stderr)
    rows = reuse_features(ct)
    if args.json:
        print(json.dumps([dataclasses.asdict(r) for r in rows], indent=1))
        return 0
    print(f"{'feature':<13} {'bucket':<10} {'share':>6} {'p_reuse':>7} {'p<60s':>6} "
          f"{'med_gap_s':>9} {'same_sess':>9}")
    for r in rows:
        print(f"{r.feature:<13} {r.bucket:<10} {r.share:6.3f} {r.p_reuse:7.3f} "
              f"{r.p_reuse_60s:6.3f} {r.median_gap_s:9.0f} {r.same_session:9.3f}")
    return 0


def register(reg: CommandRegistry) -> None:
    reg.add("trace reuse", help="what predicts reuse: per feature bucket (turn, depth, "
                                "position, chain size, first use, class) the chance a block "
                                "is used again", configure=_configure_reuse, run=_reuse)
    reg.group("trace", help="trace files: synthesise, convert to compact arrays")
    reg.add("trace synth", help="write a seeded synthetic prefix trace (compact directory) of "
                                "any size, e.g. --uses 100e6", configure=_configure_synth,
            run=_synth)
    reg.add("trace compact", help="convert a trace (any supported format) to a compact "
                                  "directory that replays map from disk",
            configure=_configure_compact, run=_compact)
    reg.add("ttl-sweep", help="replay traces through simulated stores: hit rate and storage "
                              "per TTL x capacity x eviction policy",
            configure=_configure_sweep, run=_sweep)
    reg.add("whatif", help="fit the live what-if estimator to a trace and print its "
                           "predictions for other TTLs and capacities",
            configure=_configure_whatif, run=_whatif)
    reg.group("store", help="the KV-cache warehouse")
    reg.add("store whatif", help="predict a running store's hit rate at other TTLs and "
                                 "capacities from its live what-if estimator",
            configure=_configure_store_whatif, run=_store_whatif)
