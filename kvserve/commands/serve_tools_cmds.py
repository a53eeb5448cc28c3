"""Commands for driving kvserve with the peers' benchmark tools:
``trace export`` and ``operator-key`` (``bench serve`` is benchmarks/serve.py)."""

from __future__ import annotations

import argparse
import json
import sys

from kvserve.cli import CommandRegistry, UsageError


def _export_configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("trace", help="a trace kvserve reads (Claude Code sessions .tar.xz / dir / "
                   "json, Mooncake or Bailian JSONL, CSV/Parquet)")
    p.add_argument("--out", required=True, help="output JSONL file")
    p.add_argument("--format", default="mooncake",
                   choices=("mooncake", "aiperf", "aiperf-sessions"),
                   help="mooncake: hash_ids rows (AIPerf mooncake_trace, vllm bench "
                   "timed_trace); aiperf: text_input rows with extra.session_id (AIPerf, no "
                   "synthesis); aiperf-sessions: AIPerf payload rows, each session's turns "
                   "in order (the next after the previous answer), /v1/completions bodies")
    p.add_argument("--block-tokens", type=int, default=64,
                   help="tokens per exported hash id (the serving block size)")
    p.add_argument("--context-scale", type=float, default=0.0,
                   help="exported tokens per source token (default: fit --max-input)")
    p.add_argument("--max-input", type=int, default=6000,
                   help="longest prompt in tokens (SmolLM2: 8192 context)")
    p.add_argument("--time-scale", type=float, default=1.0,
                   help="multiply arrival times (0.1 = ten times the rate)")
    p.add_argument("--output-tokens", type=int, default=0,
                   help="output length of every request (default: the trace's)")
    p.add_argument("--max-output", type=int, default=64, help="cap on output lengths")
    p.add_argument("--max-sessions", type=int, default=None,
                   help="agent traces: a seeded subset of sessions")
    p.add_argument("--max-requests", type=int, default=None, help="the earliest N requests")
    p.add_argument("--session-rate", type=float, default=None,
                   help="agent traces: sessions started per second (Poisson)")
    p.add_argument("--model", default="smollm2",
                   help="tokenizer for the text formats (a random-weight shape: bytes), and "
                   "the served model id in aiperf-sessions bodies")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--interleave", type=int, default=0, metavar="N",
                   help="agent traces: paused sessions - the first N main-agent sessions (in "
                   "name order) whose --turns fit --max-input, round-robin, one request every "
                   "--gap s, so each session pauses N x --gap while the others' prompts go "
                   "through the engine (needs --context-scale)")
    p.add_argument("--turns", type=int, default=6, help="with --interleave: turns per session")
    p.add_argument("--gap", type=float, default=2.0,
                   help="with --interleave: seconds between consecutive requests")
    p.add_argument("--min-first-input", type=int, default=0, metavar="TOKENS",
                   help="with --interleave: only sessions whose first turn has at least this "
                   "many tokens once scaled")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")


def _export_run(args: argparse.Namespace) -> int:
    from dataclasses import asdict

    from common.traces import TraceFormatError
    from kvserve.trace_export import ExportError, ExportOptions, Interleave, export

    try:
        paused = Interleave(args.interleave, args.turns, args.gap, args.min_first_input) \
            if args.interleave else None
        opts = ExportOptions(fmt=args.format, block_tokens=args.block_tokens,
                             context_scale=args.context_scale, max_input_tokens=args.max_input,
                             time_scale=args.time_scale, output_tokens=args.output_tokens,
                             max_output_tokens=args.max_output, model=args.model,
                             seed=args.seed)
        s = export(args.trace, args.out, opts, max_sessions=args.max_sessions,
                   max_requests=args.max_requests, session_rate_per_s=args.session_rate,
                   paused=paused)
    except (ExportError, TraceFormatError, ValueError, OSError) as exc:
        raise UsageError(str(exc)) from exc
    if args.json:
        print(json.dumps(asdict(s), indent=1))
        return 0
    share = s.reusable_tokens / s.prompt_tokens if s.prompt_tokens else 0.0
    print(f"{args.out}: {s.requests} requests, {s.sessions} sessions over {s.span_s:.0f} s; "
          f"context scale {s.context_scale:.4g} ({s.source_blocks_per_block:g} source "
          f"{s.source_block_tokens}-token blocks per {args.block_tokens}-token block), "
          f"{s.truncated} prompts cut to {args.max_input}; {s.prompt_tokens:,} prompt tokens, "
          f"{s.reusable_tokens:,} ({100 * share:.1f} %) in blocks an earlier request had; "
          f"at least {s.min_tokens_between_turns:,} other prompt tokens between two turns of "
          f"one session")
    return 0


def _key_configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tls-dir", default=None, metavar="DIR",
                   help="the deployment directory (default: the running `kvserve up`'s)")


def _key_run(args: argparse.Namespace) -> int:
    """Print the bearer key of the router's operator endpoints (to stdout only:
    whoever can read the deployment secret may know it)."""
    from router.cluster_ops import operator_key
    from security.config import SecurityConfig, SecurityError

    try:
        if args.tls_dir:
            sec = SecurityConfig(cert_dir=args.tls_dir, role="operator")
        else:
            from kvserve.launcher import stack_security

            sec = stack_security("operator")
        key = operator_key(sec.require_secret())
    except (SecurityError, ValueError) as exc:
        raise UsageError(str(exc)) from exc
    if not key:
        raise UsageError("this deployment has no secret (--insecure): operator endpoints "
                         "are open")
    sys.stdout.write(key + "\n")
    return 0



def register(reg: CommandRegistry) -> None:
    reg.group("trace", help="trace files: synthesise, convert to compact arrays")
    reg.add("trace export", help="write a trace for AIPerf / vllm bench serve (context and "
            "time scaled, prefix reuse kept at 64-token blocks)", configure=_export_configure,
            run=_export_run)
    reg.add("operator-key", help="print the bearer key of the router's operator endpoints "
            "(/reset_prefix_cache)", configure=_key_configure, run=_key_run)
