"""``kvserve store serve|reindex|stats``."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json

from common.config import ConfigError, KVServeConfig, parse_size
from kvserve.cli import CommandRegistry, UsageError
from security.flags import (
    add_redis_flags,
    add_security_flags,
    argv_url,
    redis_url_from,
    security_from_args,
)
from security.secret_files import SecretFileError


def _load(args: argparse.Namespace) -> KVServeConfig:
    try:
        cfg = KVServeConfig.load(args.config) if args.config else KVServeConfig()
        tiers = cfg.tiers
        changes = {k: v for k, v in (("node", args.node), ("g3_path", args.g3_path),
                                     ("g4_url", getattr(args, "g4_url", None)))
                   if v is not None}
        if getattr(args, "g2_bytes", None) is not None:
            changes["g2_bytes"] = parse_size(args.g2_bytes, "--g2-bytes")
        if getattr(args, "g3_bytes", None) is not None:
            changes["g3_bytes"] = parse_size(args.g3_bytes, "--g3-bytes")
        if changes:
            cfg = dataclasses.replace(cfg, tiers=dataclasses.replace(tiers, **changes))
        return cfg
    except ConfigError as exc:
        raise UsageError(str(exc)) from exc


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="kvserve TOML config file")
    add_redis_flags(p, default="config, REDIS_URL, else an embedded server")
    p.add_argument("--node", help="node name (overrides [tiers].node)")
    p.add_argument("--g3-path", help="G3 disk directory (overrides [tiers].g3_path)")
    p.add_argument("--g4-url", type=argv_url,
                   help="G4 fsspec URL (overrides [tiers].g4_url); no credentials in it")


def _configure_serve(p: argparse.ArgumentParser) -> None:
    _common(p)
    p.add_argument("--host", default=None, help="bind address (default [ports].host)")
    p.add_argument("--port", type=int, default=None, help="gRPC port (default [ports].kvstore; "
                   "0 = any free port)")
    p.add_argument("--metrics-port", type=int, default=None,
                   help="Prometheus port (default [ports].metrics; -1 = off, 0 = any)")
    p.add_argument("--g2-bytes", help="G2 host-memory capacity, e.g. 4GiB")
    p.add_argument("--g3-bytes", help="G3 disk capacity, e.g. 100GiB")
    p.add_argument("--sweep-interval", type=float, default=300.0,
                   help="seconds between TTL sweeps (0 = never)")
    p.add_argument("--grace", type=float, default=10.0, help="drain grace on SIGTERM, seconds")
    p.add_argument("--no-prefault", action="store_true",
                   help="do not touch all of G2 at start (faster start, slower first writes)")
    p.add_argument("--no-fsync", action="store_true",
                   help="skip fsync on G3 writes (benchmarks of page-cache speed only)")
    add_security_flags(p)


def _serve(args: argparse.Namespace) -> int:
    from kvstore.serve import StoreOptions, check_object_store_secrets, main

    cfg = _load(args)
    try:
        check_object_store_secrets(cfg.tiers.g4_url)
        opts = StoreOptions(
            config=cfg, host=args.host or cfg.ports.host,
            port=cfg.ports.kvstore if args.port is None else args.port,
            metrics_port=cfg.ports.metrics if args.metrics_port is None else args.metrics_port,
            redis_url=redis_url_from(args, cfg.redis), grace_s=args.grace,
            sweep_interval_s=args.sweep_interval,
            fsync=not args.no_fsync, prefault_g2=not args.no_prefault,
            security=security_from_args(args, "kvstore"), health_port=args.health_port)
    except ValueError as exc:               # SecretFileError included
        raise UsageError(str(exc)) from exc
    return main(opts)


def _running_config(args: argparse.Namespace) -> None:
    """No --config / --redis-url: use the stack ``kvserve up`` runs (as ``status``
    finds it), whose effective config names its Redis, disk tier and node."""
    from kvserve.launcher import UpState

    if args.config or args.redis_url or args.redis_url_file:
        return
    state = UpState.load()
    if state is not None and state.config:
        args.config = state.config
        args.redis_url_file = state.redis_url_file or None


def _reindex(args: argparse.Namespace) -> int:
    from kvstore.serve import StoreOptions, warehouse_config
    from kvstore.warehouse import Warehouse

    _running_config(args)
    cfg = _load(args)
    try:
        url = redis_url_from(args, cfg.redis)
    except SecretFileError as exc:
        raise UsageError(str(exc)) from exc
    if not url:
        raise UsageError("reindex needs the store's Redis: start `kvserve up`, pass --config "
                         "or --redis-url, or set REDIS_URL")

    async def run() -> dict[str, object]:
        wh = Warehouse(warehouse_config(StoreOptions(config=cfg, sweep_interval_s=0), url))
        await wh.start(serve=False)
        try:
            report = await wh.reindex()
        finally:
            await wh.close()
        return {"node": wh.node, "blocks": report.blocks, "total": report.total,
                "seconds": round(report.seconds, 3)}

    out = asyncio.run(run())
    if args.json:
        print(json.dumps(out))
    else:
        print(f"reindexed {out['total']} blocks on node {out['node']} {out['blocks']} "
              f"in {out['seconds']} s")
    return 0


def _configure_reindex(p: argparse.ArgumentParser) -> None:
    _common(p)
    p.add_argument("--json", action="store_true")


def _configure_stats(p: argparse.ArgumentParser) -> None:
    p.add_argument("--address", default="127.0.0.1:50051", help="kvstore host:port")
    p.add_argument("--json", action="store_true")
    p.add_argument("--timeout", type=float, default=5.0)


def _stats(args: argparse.Namespace) -> int:
    from kvserve.launcher import stack_security
    from kvstore.client import KVStoreClient
    from kvstore.errors import KVStoreError

    async def run() -> object:
        async with KVStoreClient(args.address, timeout_s=args.timeout, use_shm=False,
                                 security=stack_security()) as c:
            return await c.stats()

    try:
        s = asyncio.run(run())
    except KVStoreError as exc:
        raise UsageError(f"kvstore at {args.address}: {exc}") from exc
    if args.json:
        print(json.dumps(dataclasses.asdict(s)))  # type: ignore[call-overload]
        return 0
    print(f"node {s.node} ({s.hostname}), shared memory: {'yes' if s.shm_capable else 'no'}")
    print(f"{'tier':<5}{'used':>14}{'capacity':>16}{'blocks':>9}{'hits':>9}{'misses':>9}"
          f"{'evict':>8}{'bad':>6}")
    for t in s.tiers:
        print(f"{t.tier:<5}{t.used_bytes:>14,}{t.capacity_bytes:>16,}{t.blocks:>9}{t.hits:>9}"
              f"{t.misses:>9}{t.evictions:>8}{t.checksum_failures:>6}")
    print(f"{'class':<8}{'ttl_s':>10}{'hits':>9}{'misses':>9}{'written':>9}")
    for c in s.classes:
        print(f"{c.traffic_class:<8}{c.ttl_s:>10}{c.hits:>9}{c.misses:>9}{c.blocks:>9}")
    return 0


def register(reg: CommandRegistry) -> None:
    reg.group("store", help="the KV-cache warehouse")
    reg.add("store serve", help="run the kvstore gRPC service", configure=_configure_serve,
            run=_serve)
    reg.add("store reindex", help="rebuild the Redis block index from the blocks on disk",
            configure=_configure_reindex, run=_reindex)
    reg.add("store stats", help="tier and class counters of a running kvstore",
            configure=_configure_stats, run=_stats)
