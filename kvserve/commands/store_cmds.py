"""``kvserve store serve|reindex|stats|quota|integrity-key``."""

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
    _integrity_flag(p)


def _integrity_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--integrity-key-file", default="", metavar="FILE",
                   help="the block MAC key (`kvserve store integrity-key`); default "
                        "$KVSERVE_INTEGRITY_KEY_FILE, else derived from the deployment secret")


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
            security=security_from_args(args, "kvstore"), health_port=args.health_port,
            integrity_key_file=args.integrity_key_file)
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


def _store_security(args: argparse.Namespace) -> object:
    """The kvstore's credentials for an offline tool: the flags, else the running stack's."""
    from kvserve.launcher import stack_security

    if args.tls_dir or args.insecure or args.secret_file:
        return security_from_args(args, "kvstore")
    return stack_security("kvstore")


def _reindex(args: argparse.Namespace) -> int:
    from kvstore.serve import StoreOptions, warehouse_config
    from kvstore.warehouse import Warehouse
    from security.config import SecurityError

    _running_config(args)
    cfg = _load(args)
    try:
        url = redis_url_from(args, cfg.redis)
    except SecretFileError as exc:
        raise UsageError(str(exc)) from exc
    if not url:
        raise UsageError("reindex needs the store's Redis: start `kvserve up`, pass --config "
                         "or --redis-url, or set REDIS_URL")
    try:   # only blocks whose MAC verifies under the store's key are indexed
        wcfg = warehouse_config(StoreOptions(config=cfg, sweep_interval_s=0,
                                             security=_store_security(args),  # type: ignore[arg-type]
                                             integrity_key_file=args.integrity_key_file), url)
    except (SecurityError, ValueError) as exc:
        raise UsageError(str(exc)) from exc

    async def run() -> dict[str, object]:
        wh = Warehouse(wcfg)
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
    p.add_argument("--tls-dir", default=None, metavar="DIR",
                   help="the kvstore's deployment directory (its secret keys the block MAC)")
    p.add_argument("--secret-file", default=None, metavar="FILE", help="deployment secret")
    p.add_argument("--insecure", action="store_true",
                   help="blocks written by a store without a secret (unkeyed tags)")
    _integrity_flag(p)


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
    print(f"tenants with an id: {s.tenant_names} of {s.max_tenants}")
    if s.tenants:
        print(f"{'tier':<5}{'tenant':<24}{'used':>14}{'quota':>16}{'blocks':>9}{'evict':>8}")
    for t in s.tenants:
        quota = "none" if t.quota_bytes < 0 else f"{t.quota_bytes:,}"
        print(f"{t.tier:<5}{t.tenant[:23]:<24}{t.used_bytes:>14,}{quota:>16}{t.blocks:>9}"
              f"{t.evictions:>8}")
    return 0


def _configure_quota(p: argparse.ArgumentParser) -> None:
    p.add_argument("--address", default="127.0.0.1:50051", help="kvstore host:port")
    p.add_argument("--tenant", default="", help='tenant name, or "*" for every tenant not '
                   "listed (omit to show the table)")
    p.add_argument("--tier", default="", choices=["", "G2", "G3", "G4"])
    how = p.add_mutually_exclusive_group()
    how.add_argument("--bytes", default="", help="the quota, e.g. 2GiB")
    how.add_argument("--unlimited", action="store_true", help="no limit for this tenant")
    how.add_argument("--reset", action="store_true",
                     help="drop the operator's setting; the config's applies again")
    p.add_argument("--json", action="store_true")
    p.add_argument("--timeout", type=float, default=5.0)


def _quota(args: argparse.Namespace) -> int:
    from kvserve.launcher import stack_security
    from kvstore.client import KVStoreClient
    from kvstore.errors import KVStoreError

    change = bool(args.bytes or args.unlimited or args.reset)
    if change and not (args.tenant and args.tier):
        raise UsageError("setting a quota needs --tenant and --tier")
    try:
        nbytes = parse_size(args.bytes, "--bytes") if args.bytes else None
    except ConfigError as exc:
        raise UsageError(str(exc)) from exc

    async def run() -> object:
        async with KVStoreClient(args.address, timeout_s=args.timeout, use_shm=False,
                                 security=stack_security()) as c:
            if change:
                return await c.set_quota(args.tier, args.tenant, nbytes, reset=args.reset)
            return await c.get_quotas()

    try:
        table = asyncio.run(run())
    except KVStoreError as exc:
        raise UsageError(f"kvstore at {args.address}: {exc}") from exc
    rows = [dataclasses.asdict(e) for e in table]  # type: ignore[attr-defined]
    if args.json:
        print(json.dumps(rows))
        return 0
    print(f"{'tier':<5}{'tenant':<24}{'quota bytes':>16}  source")
    for r in rows:
        quota = "none" if r["quota_bytes"] is None else f"{r['quota_bytes']:,}"
        print(f"{r['tier']:<5}{r['tenant'][:23]:<24}{quota:>16}  {r['source']}")
    return 0


def _configure_integrity_key(p: argparse.ArgumentParser) -> None:
    p.add_argument("out", help="file to write (created 0600; never overwritten)")
    p.add_argument("--tls-dir", default=None, metavar="DIR", help="deployment directory")
    p.add_argument("--secret-file", default=None, metavar="FILE", help="deployment secret")


def _integrity_key(args: argparse.Namespace) -> int:
    from kvstore.integrity import derive_mac_key, write_key_file
    from security.config import SecurityConfig, SecurityError

    try:
        sec = SecurityConfig.from_flags(tls_dir=args.tls_dir, role="kvstore",
                                        secret_file=args.secret_file)
        path = write_key_file(args.out, derive_mac_key(sec.require_secret()))
    except (SecurityError, FileExistsError) as exc:
        raise UsageError(str(exc)) from exc
    print(f"wrote the block MAC key to {path} (mode 0600); give the kvstore "
          f"--integrity-key-file {path} instead of the deployment secret")
    return 0


def register(reg: CommandRegistry) -> None:
    reg.group("store", help="the KV-cache warehouse")
    reg.add("store serve", help="run the kvstore gRPC service", configure=_configure_serve,
            run=_serve)
    reg.add("store reindex", help="rebuild the Redis block index from the blocks on disk",
            configure=_configure_reindex, run=_reindex)
    reg.add("store stats", help="tier, class and tenant counters of a running kvstore",
            configure=_configure_stats, run=_stats)
    reg.add("store quota", help="show or set per-tenant byte quotas per tier (operators)",
            configure=_configure_quota, run=_quota)
    reg.add("store integrity-key", help="derive the kvstore's block MAC key from the "
            "deployment secret into a 0600 file", configure=_configure_integrity_key,
            run=_integrity_key)
