"""``kvserve router serve`` (the OpenAI HTTP front and the gRPC Router service).

The config is built here from the TOML file plus flags and passed down.
"""

from __future__ import annotations

import argparse
import asyncio
from dataclasses import replace
from typing import TYPE_CHECKING

from common.config import ConfigError, KVServeConfig
from kvserve.cli import CommandRegistry, UsageError
from security.flags import add_redis_flags, add_security_flags, redis_url_from, security_from_args

if TYPE_CHECKING:
    from router.serve import RouterConfig


def _configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="kvserve TOML config file")
    p.add_argument("--host", default=None, help="bind address (default [ports].host)")
    p.add_argument("--port", type=int, default=None,
                   help="gRPC Router port (default [ports].router_grpc; 0 = any free port)")
    p.add_argument("--http-port", type=int, default=None,
                   help="OpenAI HTTP port (default [ports].http; 0 = any free port)")
    add_redis_flags(p, default="[redis] / REDIS_URL(_FILE)")
    p.add_argument("--node", default=None, help="node name (default [tiers].node)")
    p.add_argument("--policy", default=None,
                   help="placement policy (default [router].policy), e.g. round_robin, "
                        "least_load, cache_aware, cache_expert_aware")
    p.add_argument("--api-key-file", default=None,
                   help="file of 'KEY TENANT' lines; requests then need a listed key")
    p.add_argument("--model", default=None,
                   help="served model: a name (smollm2, tiny-dense, ...) or an HF-layout "
                        "directory (default [model].name)")
    p.add_argument("--served-name", default=None,
                   help="model id clients send and /v1/models lists (default: the model name)")
    p.add_argument("--instance-id", default=None, help="registry id (default router-ADDRESS)")
    p.add_argument("--backend", default="engine", choices=("engine", "vllm"),
                   help="engines behind the router: kvserve's own (engine) or vLLM OpenAI "
                   "servers with the kvserve connector (vllm); see docs/vllm.md")
    p.add_argument("--max-attempts", type=int, default=None,
                   help="instances tried per request before the first token (default 3)")
    p.add_argument("--default-max-tokens", type=int, default=None,
                   help="max_tokens when a request gives none (default 256)")
    add_security_flags(p)


def router_config(args: argparse.Namespace) -> RouterConfig:
    from router.auth import ApiKeys
    from router.core import CoreConfig
    from router.live_view import ViewConfig
    from router.serve import RouterConfig

    cfg = KVServeConfig.load(args.config) if args.config else KVServeConfig()
    if args.api_key_file:
        ApiKeys.load(args.api_key_file)   # a bad key file fails here, before anything starts
    core = CoreConfig(block_tokens=cfg.blocks.block_tokens,
                      local_tail_tokens=cfg.router.local_tail_tokens,
                      local_cold_tokens=cfg.router.local_cold_tokens)
    if args.max_attempts is not None:
        core = replace(core, max_attempts=args.max_attempts)
    if args.default_max_tokens is not None:
        core = replace(core, default_max_tokens=args.default_max_tokens)
    view = ViewConfig(policy=args.policy or cfg.router.policy, hit_rule=cfg.blocks,
                      heartbeat_s=cfg.router.heartbeat_s,
                      instance_ttl_s=cfg.router.instance_ttl_s,
                      poll_s=min(0.5, cfg.router.heartbeat_s))
    return RouterConfig(
        model=args.model or cfg.model.name, served_name=args.served_name or "",
        host=args.host or cfg.ports.host,
        grpc_port=cfg.ports.router_grpc if args.port is None else args.port,
        http_port=cfg.ports.http if args.http_port is None else args.http_port,
        redis_url=redis_url_from(args, cfg.redis),
        node=args.node or cfg.tiers.node, instance_id=args.instance_id or "",
        api_key_file=args.api_key_file or "", hit_rule=cfg.blocks, classes=cfg.classes,
        view=view, core=core, admission=cfg.admission,
        security=security_from_args(args, "router"),
        health_port=args.health_port, backend=args.backend)


def _run(args: argparse.Namespace) -> int:
    from common import exit_watchdog
    from router.serve import serve

    try:
        cfg = router_config(args)
    except (ConfigError, ValueError) as exc:
        raise UsageError(str(exc)) from exc
    exit_watchdog.enable()               # this process is the router: bound its stop
    try:
        asyncio.run(serve(cfg))
    except OSError as exc:               # a taken port: say so and exit non-zero
        raise UsageError(str(exc)) from exc
    return 0


def register(reg: CommandRegistry) -> None:
    reg.group("router", help="the router (OpenAI HTTP front + gRPC Router)")
    reg.add("router serve", help="run the router: OpenAI HTTP front and gRPC Router service",
            configure=_configure, run=_run)
