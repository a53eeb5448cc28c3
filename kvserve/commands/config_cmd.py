"""``kvserve config check FILE``: validate a config file (the k8s ConfigMap's too)."""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict

from common.config import ConfigError, KVServeConfig
from kvserve.cli import CommandRegistry, UsageError


def _configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("file", help="TOML config file")
    p.add_argument("--json", action="store_true", help="print the effective config as JSON")


def _run(args: argparse.Namespace) -> int:
    try:
        cfg = KVServeConfig.load(args.file)
    except ConfigError as exc:
        raise UsageError(str(exc)) from exc
    if args.json:
        print(json.dumps(asdict(cfg), indent=2, sort_keys=True))
    else:
        print(f"{args.file}: ok (model {cfg.model.name}, block {cfg.blocks.block_tokens} tokens, "
              f"reserve {cfg.blocks.reserve}, classes {cfg.classes.ttl_s})")
    return 0


def register(reg: CommandRegistry) -> None:
    reg.group("config", help="configuration files")
    reg.add("config check", help="validate a kvserve config file", configure=_configure, run=_run)
