"""The trace flags every trace-reading command shares (``ttl-sweep``,
``whatif``, ``trace …``, ``bench policies``), loading the traces they name, and
the one-line note that states what was loaded."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from common.trace_arrays import CompactTrace, is_compact_dir
from common.traces import Trace, TraceFormatError, load_trace, merge_traces, rebin
from kvserve.cli import UsageError
from studies.sim import LLAMA3_70B_KV_BYTES_PER_TOKEN


def add_trace_args(p: argparse.ArgumentParser, flag: str = "--trace", grid: bool = True,
                capacity: bool = True) -> None:
    p.add_argument(flag, dest="traces", action="append", required=True, metavar="FILE",
                   help="trace file (Mooncake/Bailian JSONL, Claude Code traces.tar.xz, a "
                        "directory or one trace_NNNN.json); repeat to merge several into one "
                        "timeline (coarsened to the largest block size)")
    p.add_argument("--class-of", default=None, metavar="RULE",
                   help="traffic class rules, e.g. 'conversation*=chat,*.tar.xz=agent', "
                        "'type:coder=agent' or just 'chat' (default: agent for Claude Code "
                        "sessions, chat otherwise)")
    p.add_argument("--time-scale", type=float, default=1.0, metavar="X",
                   help="multiply every trace time by X, so a short trace stands for a "
                        "longer period (X=72: one hour plays as three days); default 1")
    p.add_argument("--max-requests", type=int, default=None, metavar="N",
                   help="keep each trace's earliest N requests")
    p.add_argument("--max-sessions", type=int, default=None, metavar="N",
                   help="agent archives: a seeded random subset of N sessions")
    p.add_argument("--session-rate", type=float, default=None, metavar="PER_S",
                   help="agent archives: Poisson session arrival rate (default: 16 "
                        "sessions overlapping on average)")
    p.add_argument("--seed", type=int, default=0, help="seed for session order and arrivals")
    p.add_argument("--block-tokens", type=int, default=None, metavar="N",
                   help="coarsen blocks to N tokens (a multiple of the trace's) for speed")
    p.add_argument("--kv-bytes-per-token", type=int, default=LLAMA3_70B_KV_BYTES_PER_TOKEN,
                   help="KV bytes per token for storage figures (default Llama-3-70B bf16, "
                        "327,680)")
    if grid:
        p.add_argument("--ttl", required=True,
                       help="TTL list, e.g. 60,5m,1h,3d,inf (inf = none)")
    if capacity:
        p.add_argument("--capacity", required=True,
                       help="capacity list in tokens, e.g. 1e6,3M,50M,inf")
        p.add_argument("--json", action="store_true", help="print the rows as a JSON list")


def load_traces(args: argparse.Namespace, paths: Sequence[str] | None = None
          ) -> Trace | CompactTrace:
    """The trace(s) named by the arguments; one compact trace directory with no
    transforming option stays as arrays mapped from disk (streams when large)."""
    paths = list(args.traces if paths is None else paths)
    plain = (args.max_requests is None and args.time_scale == 1.0 and args.max_sessions is None
             and not args.class_of and not args.block_tokens)
    if len(paths) == 1 and plain and is_compact_dir(paths[0]):
        try:
            return CompactTrace.load(paths[0])
        except ValueError as exc:
            raise UsageError(str(exc)) from exc
    traces = []
    try:
        for i, path in enumerate(paths):
            traces.append(load_trace(
                path, max_requests=args.max_requests, seed=args.seed,
                session_rate_per_s=args.session_rate, time_scale=args.time_scale,
                max_sessions=args.max_sessions, class_of=args.class_of, namespace=i))
        merged = merge_traces(traces)
        return rebin(merged, args.block_tokens) if args.block_tokens else merged
    except (TraceFormatError, ValueError) as exc:
        raise UsageError(str(exc)) from exc


def trace_note(trace: Trace | CompactTrace, args: argparse.Namespace) -> str:
    if isinstance(trace, CompactTrace):
        n_req, n_blocks = trace.n_requests, trace.n_uses
    else:
        n_req, n_blocks = len(trace.requests), sum(len(r.hash_ids) for r in trace.requests)
    return (f"# {trace.name}: {n_req} requests, {n_blocks} block uses of "
            f"{trace.block_tokens} tokens, span {trace.span_s:.0f} s; time scale "
            f"{args.time_scale:g} (TTLs are in scaled seconds); KV {args.kv_bytes_per_token} "
            f"bytes/token\n# arrivals: {trace.arrival_note}")


__all__ = ["add_trace_args", "load_traces", "trace_note"]
