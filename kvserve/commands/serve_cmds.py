"""``kvserve prefill serve``, ``kvserve decode serve``, ``kvserve up``,
``kvserve chat`` and ``kvserve status``.

Configs are built here, at the entry point, from the TOML file plus flags,
and passed down; nothing below reads flags or the environment.
"""

from __future__ import annotations

import argparse
from typing import Any

from common.config import PREFILL_POLICIES, ConfigError, KVServeConfig
from kvserve.cli import CommandRegistry, UsageError
from security.config import SecurityError
from security.flags import add_redis_flags, add_security_flags, redis_url_from, security_from_args
from security.secret_files import SecretFileError


def load_config(path: str | None) -> KVServeConfig:
    try:
        return KVServeConfig.load(path) if path else KVServeConfig()
    except ConfigError as exc:
        raise UsageError(str(exc)) from exc


def _configure_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="kvserve TOML config file")
    p.add_argument("--host", default=None, help="bind address (default [ports].host)")
    p.add_argument("--port", type=int, default=None,
                   help="gRPC port (default from [ports]; 0 = any free port)")
    add_redis_flags(p, default="[redis] / REDIS_URL(_FILE); none: do not register")
    p.add_argument("--node", default=None, help="node name (default [tiers].node)")
    p.add_argument("--model", default=None,
                   help="model name or HF-layout directory (default [model].name)")
    p.add_argument("--store", default=None, metavar="ADDRESS",
                   help="kvstore host:port (default [ports].host:[ports].kvstore; '' = none)")
    p.add_argument("--device", default=None, help="cpu or cuda[:N] (default [model].device)")
    p.add_argument("--dtype", default=None, help="float32 | bfloat16 | float16")
    p.add_argument("--num-blocks", type=int, default=None, help="engine KV pool size in blocks")
    p.add_argument("--gpu-fraction", type=float, default=None,
                   help="CUDA: cap on this engine process's share of the GPU's memory "
                        "(default [engine].gpu_fraction; 0 = none)")
    p.add_argument("--metrics-port", type=int, default=None,
                   help="Prometheus /metrics port (-1 off, 0 any free port)")
    p.add_argument("--instance-id", default=None, help="registry id (default role-address)")
    p.add_argument("--advertise-host", default=None,
                   help="host others dial (default: the bind host)")
    p.add_argument("--fetch-policy", default=None, choices=("cost", "always", "never"),
                   help="warehouse reads: cost-aware (default), always fetch usable blocks, "
                        "or never")
    add_security_flags(p)


def _overrides(args: argparse.Namespace, cfg: KVServeConfig) -> dict[str, Any]:
    return {"host": args.host, "port": args.port,
            "redis_url": redis_url_from(args, cfg.redis) or None,
            "node": args.node, "model": args.model, "store_address": args.store,
            "device": args.device, "dtype": args.dtype, "num_blocks": args.num_blocks,
            "gpu_fraction": args.gpu_fraction,
            "metrics_port": args.metrics_port, "instance_id": args.instance_id,
            "advertise_host": args.advertise_host, "fetch_policy": args.fetch_policy,
            "health_port": args.health_port}


def _configure_prefill(p: argparse.ArgumentParser) -> None:
    _configure_common(p)
    p.add_argument("--buffer-ttl", type=float, default=None,
                   help="seconds after which a request's KV that decode never pulled is "
                        "dropped (decode then rebuilds it; default 3600)")
    p.add_argument("--no-ipc-pulls", action="store_true",
                   help="never hand KV to a decode on the same GPU as a CUDA IPC handle "
                        "(the /dev/shm file or the byte stream only)")
    p.add_argument("--ipc-hold", type=float, default=None, metavar="S",
                   help="drop a device copy shared with decode that was not released "
                        "within S seconds (default 60)")
    p.add_argument("--no-local-prefix-cache", action="store_true",
                   help="do not keep prompt blocks in the engine (every hit comes from the "
                        "warehouse)")
    sched = p.add_argument_group("scheduling (default [prefill] of the config)")
    sched.add_argument("--policy", default=None, choices=PREFILL_POLICIES,
                       help="queue order: fcfs, or src (shortest remaining compute, aged)")
    sched.add_argument("--step-tokens", type=int, default=None,
                       help="prompt tokens computed per engine step, over all running prompts")
    sched.add_argument("--solo-step-tokens", type=int, default=None,
                       help="the step of a prompt computing alone with nothing waiting "
                            "(0: --step-tokens)")
    sched.add_argument("--max-running", type=int, default=None,
                       help="prompts computed at once")
    sched.add_argument("--max-waiting", type=int, default=None,
                       help="requests waiting; more are refused (RESOURCE_EXHAUSTED)")


def _run_prefill(args: argparse.Namespace) -> int:
    from prefill_svc.config import PrefillConfig
    from prefill_svc.server import SERVICE_NAME, PrefillService
    from proto import prefill_pb2_grpc
    from service.hosting import serve_engine_service

    try:
        base = load_config(args.config)
        cfg = PrefillConfig.from_kvserve(
            base, **_overrides(args, base), buffer_ttl_s=args.buffer_ttl,
            ipc_pulls=False if args.no_ipc_pulls else None, ipc_hold_s=args.ipc_hold,
            local_prefix_cache=False if args.no_local_prefix_cache else None,
            policy=args.policy, step_tokens=args.step_tokens,
            solo_step_tokens=args.solo_step_tokens, max_running=args.max_running,
            max_waiting=args.max_waiting, security=security_from_args(args, "prefill"))
    except (ConfigError, SecurityError, SecretFileError) as exc:
        raise UsageError(str(exc)) from exc
    return serve_engine_service(
        "prefill", SERVICE_NAME, cfg.engine, cfg.endpoint,
        lambda engine, address: PrefillService(cfg, engine, address=address),
        prefill_pb2_grpc.add_PrefillServicer_to_server)


def _configure_decode(p: argparse.ArgumentParser) -> None:
    _configure_common(p)
    p.add_argument("--max-seqs", type=int, default=None, help="sequences decoding at once")
    p.add_argument("--no-ipc-pulls", action="store_true",
                   help="never ask a prefill on the same GPU for its KV as a CUDA IPC handle")
    p.add_argument("--max-waiting", type=int, default=None,
                   help="requests taken beyond --max-seqs before answering RESOURCE_EXHAUSTED "
                        "(default 64)")
    p.add_argument("--ep-ranks", type=int, default=None,
                   help="MoE: expert-parallel ranks for the imbalance figure (default 4)")
    p.add_argument("--expert-plan", default=None,
                   help="MoE: expert placement JSON (eplb.plan plan), 'auto' (plan from this "
                        "instance's own expert counts), default contiguous")
    p.add_argument("--ep-redundant", type=int, default=None,
                   help="MoE with --expert-plan auto: redundant expert slots (default 0)")
    p.add_argument("--canonical-wait", type=float, default=None, metavar="S",
                   help="hold a finished answer's final event up to S seconds until its "
                        "prompt+output blocks are stored, so the next turn hits them "
                        "(default 10; 0 = store them after answering)")


def _run_decode(args: argparse.Namespace) -> int:
    from decode_svc.config import DecodeConfig
    from decode_svc.server import SERVICE_NAME, DecodeService
    from proto import decode_pb2_grpc
    from service.hosting import serve_engine_service

    try:
        base = load_config(args.config)
        cfg = DecodeConfig.from_kvserve(
            base, **_overrides(args, base), max_seqs=args.max_seqs,
            max_waiting=args.max_waiting, use_ipc=False if args.no_ipc_pulls else None,
            ep_ranks=args.ep_ranks, expert_plan=args.expert_plan, ep_redundant=args.ep_redundant,
            canonical_wait_s=args.canonical_wait,
            security=security_from_args(args, "decode"))
    except (ConfigError, SecurityError, SecretFileError) as exc:
        raise UsageError(str(exc)) from exc
    return serve_engine_service(
        "decode", SERVICE_NAME, cfg.engine, cfg.endpoint,
        lambda engine, address: DecodeService(cfg, engine, address=address),
        decode_pb2_grpc.add_DecodeServicer_to_server)


def _configure_up(p: argparse.ArgumentParser) -> None:
    from kvserve.launch_vllm import configure_up
    from kvserve.launcher import configure

    configure(p)
    configure_up(p)


def _run_up(args: argparse.Namespace) -> int:
    # --engine: kvserve's own services, or vLLM servers with the kvserve connector.
    if args.engine == "vllm":
        from kvserve.commands.vllm_cmds import need_vllm
        from kvserve.launch_vllm_up import run

        need_vllm()                   # one line naming the missing step, no traceback
    else:
        from kvserve.launcher import run
    return run(args)


def _configure_chat(p: argparse.ArgumentParser) -> None:
    from kvserve.chat import configure

    configure(p)


def _run_chat(args: argparse.Namespace) -> int:
    from kvserve.chat import run

    return run(args)


def _configure_status(p: argparse.ArgumentParser) -> None:
    from kvserve.status import configure

    configure(p)


def _run_status(args: argparse.Namespace) -> int:
    from kvserve.status import run

    return run(args)


def register(reg: CommandRegistry) -> None:
    reg.group("prefill", help="the prefill service")
    reg.add("prefill serve", help="run a gRPC Prefill instance", configure=_configure_prefill,
            run=_run_prefill)
    reg.group("decode", help="the decode service")
    reg.add("decode serve", help="run a gRPC Decode instance", configure=_configure_decode,
            run=_run_decode)
    reg.add("up", help="start Redis, a kvstore, prefill, decode (and the router) on this "
            "machine", configure=_configure_up, run=_run_up)
    reg.add("chat", help="talk to a running deployment (router, else prefill then decode)",
            configure=_configure_chat, run=_run_chat)
    reg.add("status", help="instances in the registry and the warehouse's tiers and classes",
            configure=_configure_status, run=_run_status)
