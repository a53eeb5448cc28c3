"""Every ``kvserve bench …`` command: its flags, and a run that imports its
benchmark only when it runs (importing torch would slow every kvserve
command down). ``kvserve/cli.py`` finds this module by name: the benchmarks
stand above the CLI's package, so the CLI cannot import them.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict

from kvserve.cli import CommandRegistry, UsageError
from kvserve.commands.engine_cmds import engine_args, engine_user_errors
from kvserve.commands.vllm_cmds import need_vllm

# ------------------------------------------------------------ bench engine

def _engine_configure(p: argparse.ArgumentParser) -> None:
    engine_args(p)
    p.add_argument("--json", action="store_true", help="print the results as JSON")
    p.add_argument("--prefill-chunk", type=int, default=0,
                   help="prefill chunk, a multiple of --block-tokens (default: the block on "
                        "CPU, 2048 on CUDA); restores snap to chunk boundaries")
    p.add_argument("--prefill-tokens", type=int, nargs="*", default=None,
                   help="prompt lengths to time (default: 256 and 1493 on CPU; 4k/16k on CUDA)")
    p.add_argument("--decode-batches", type=int, nargs="*", default=None,
                   help="decode batch sizes (default 1 8 on CPU; 1 8 64 on CUDA)")
    p.add_argument("--decode-steps", type=int, default=32)
    p.add_argument("--big-model", default="llama-8b-shape",
                   help="second model timed on CUDA (bf16); '' to skip")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = default)")
    p.add_argument("--decode-bucket", type=int, default=0,
                   help="decode rows per forward (default 8 on CPU, the biggest batch on CUDA)")


def _engine_run(args: argparse.Namespace) -> int:
    from benchmarks.engine import BenchOptions, print_table, run_engine_bench

    try:
        opts = BenchOptions(model=args.model, device=args.device, dtype=args.dtype,
                            block_tokens=args.block_tokens, num_blocks=args.num_blocks,
                            prefill_chunk=args.prefill_chunk,
                            prefill_tokens=tuple(args.prefill_tokens or ()),
                            decode_batches=tuple(args.decode_batches or ()),
                            decode_steps=args.decode_steps, big_model=args.big_model,
                            threads=args.threads, decode_bucket=args.decode_bucket)
        result = run_engine_bench(opts)
    except engine_user_errors() as exc:
        raise UsageError(str(exc)) from exc
    print_table(result, file=sys.stderr if args.json else sys.stdout)
    if args.json:
        print(json.dumps(result.to_json(), indent=2))
    return 0


# ------------------------------------------------------------ bench front

def _front_configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="tiny-dense",
                   help="model of the stack it starts (default tiny-dense: the front's cost "
                        "stands out against a small compute)")
    p.add_argument("--prompt-tokens", type=int, default=256)
    p.add_argument("--requests", type=int, default=40, help="timed requests per path")
    p.add_argument("--rejects", type=int, default=400, help="timed 400 answers")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")


def _front_run(args: argparse.Namespace) -> int:
    from benchmarks.front import FrontBenchConfig, run, table

    try:
        cfg = FrontBenchConfig(model=args.model, prompt_tokens=args.prompt_tokens,
                               requests=args.requests, rejects=args.rejects)
    except ValueError as exc:
        raise UsageError(str(exc)) from exc
    res = run(cfg)
    print(json.dumps(asdict(res), indent=1) if args.json else table(res))
    return 0


# ------------------------------------------------------------ bench router

def _router_configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--instances", type=int, default=64)
    p.add_argument("--prompt-tokens", type=int, default=8192)
    p.add_argument("--decisions", type=int, default=5000)
    p.add_argument("--policy", default="cache_aware")
    p.add_argument("--cpu", type=int, default=0, help="core to pin to (-1: no pinning)")
    p.add_argument("--json", action="store_true", help="print results as JSON")


def _router_run(args: argparse.Namespace) -> int:
    from benchmarks.router import BenchConfig, run_bench
    from router.placement import UnknownPolicyError

    try:
        cfg = BenchConfig(instances=args.instances, prompt_tokens=args.prompt_tokens,
                          decisions=args.decisions, policy=args.policy,
                          cpu=None if args.cpu < 0 else args.cpu,
                          progress=sys.stderr.isatty())
        res = run_bench(cfg)
    except (UnknownPolicyError, ValueError) as exc:
        raise UsageError(str(exc)) from exc
    out = asdict(res) | {"instances": cfg.instances, "prompt_tokens": cfg.prompt_tokens,
                         "policy": cfg.policy,
                         "goal": {"decisions_per_s": 5000, "p99_ms": 2.0},
                         "goal_met": res.decisions_per_s >= 5000 and res.p99_ms < 2.0}
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    print(f"{cfg.policy}, {cfg.instances} instances, {cfg.prompt_tokens}-token prompts, "
          f"{res.cpu}, {res.keys_in_view} block keys in the view")
    print(f"{'decisions/s':>12}{'p50 ms':>9}{'p99 ms':>9}{'hash ms':>9}{'tokenize ms':>13}")
    print(f"{res.decisions_per_s:>12.0f}{res.p50_ms:>9.3f}{res.p99_ms:>9.3f}"
          f"{res.hash_ms_p50:>9.3f}{res.tokenize_ms_p50:>13.2f}  ({res.tokenizer})")
    return 0


# ------------------------------------------------------------ bench store

def _store_configure(p: argparse.ArgumentParser) -> None:
    from benchmarks.store import configure

    configure(p)


def _store_run(args: argparse.Namespace) -> int:
    from benchmarks.store import run

    return run(args)


# ------------------------------------------------------------ bench vllm

def _vllm_configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--reps", type=int, default=3, help="prompts timed (medians over them)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument("--tls-dir", default="", help="mTLS deployment directory for the kvstore")
    p.add_argument("--insecure", action="store_true", help="plain text to the kvstore")


def _vllm_run(args: argparse.Namespace) -> int:
    need_vllm()
    if args.reps < 1:
        raise UsageError("--reps must be >= 1")
    import os

    from benchmarks.vllm import main
    from connectors.vllm import _client_takes_security

    tls = args.tls_dir or os.environ.get("KVSERVE_TLS_DIR", "")
    insecure = args.insecure or not (tls and _client_takes_security())
    return main(args.reps, args.json, tls_dir="" if insecure else tls, insecure=insecure)


def register(reg: CommandRegistry) -> None:
    from benchmarks import hashing, pd, policies

    reg.group("bench", help="benchmarks (tables; --json for machines)")
    reg.add("bench engine", help="engine prefill/decode throughput and KV export/import",
            configure=_engine_configure, run=_engine_run)
    reg.add("bench front", help="router front overhead on TTFT, and its 400 path",
            configure=_front_configure, run=_front_run)
    reg.add("bench policies", help="eviction policies against Belady's optimum on trace "
                                   "replays (hit rate and ratio per capacity)",
            configure=policies.configure, run=policies.run)
    reg.add("bench router", help="placement decisions per second on one core",
            configure=_router_configure, run=_router_run)
    reg.add("bench store", help="warehouse throughput and lookup latency against raw baselines",
            configure=_store_configure, run=_store_run)
    reg.add("bench vllm", help="vLLM TTFT: cold, warm from the warehouse in a fresh process, "
            "warm from its own cache", configure=_vllm_configure, run=_vllm_run)
    hashing.register(reg)
    pd.register(reg)


__all__ = ["register"]
