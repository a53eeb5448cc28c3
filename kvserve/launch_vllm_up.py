"""``kvserve up --engine vllm``: the local stack with vLLM as the engine.

Embedded Redis (unless --redis-url), one kvstore, vLLM OpenAI servers running
``connectors.vllm.KVServeConnector`` (``--vllm-instances`` kv_both servers, or
with ``--pd`` a kv_producer and a kv_consumer), and the router with its vLLM
backend (``router serve --backend vllm``), which places requests by cache
affinity learned from the connectors' and the kvstore's KV events. Same state
file, logs, Ctrl-C behaviour and credential handout (each child its own
directory, kvserve/credentials.py) as ``kvserve up`` (kvserve/launcher.py).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

from common.config import ConfigError, KVServeConfig
from kvserve import launcher
from kvserve.children import (
    Child,
    Stop,
    start_children,
    stop_children,
    stop_on_signals,
    wait_registered,
)
from kvserve.cli import UsageError
from kvserve.credentials import hand_out
from kvserve.launch_vllm import VLLMError, VLLMProcess, VLLMSpec, engine_identity
from security.config import SecurityConfig
from security.flags import redis_url_from
from security.redact import redact_url
from security.secret_files import SecretFileError


def _security(args: argparse.Namespace, run_dir: Path) -> tuple[str, bool]:
    """(tls_dir, insecure): the flags, else KVSERVE_TLS_DIR, else a local deployment
    made once under the run directory (plain text only where the kvstore client
    cannot speak TLS yet)."""
    from connectors.vllm import _client_takes_security

    tls = getattr(args, "tls_dir", None) or os.environ.get("KVSERVE_TLS_DIR", "")
    if getattr(args, "insecure", False):
        return "", True
    if tls:
        return tls, False
    if not _client_takes_security():
        print("kvserve up: the kvstore client has no TLS yet: running in plain text",
              file=sys.stderr)
        return "", True
    from security.pki import ensure_deployment

    return str(ensure_deployment(run_dir / "tls")), False


def _model_dir(name: str) -> str:
    from engine.fetch import KNOWN_MODELS, fetch_model

    return str(fetch_model(name)) if name in KNOWN_MODELS else str(Path(name).expanduser())


def run(args: argparse.Namespace) -> int:
    from kvstore.redis_server import EmbeddedRedis, free_port

    if args.state_dir:            # as `kvserve up` does: a second stack beside the first
        os.environ[launcher.STATE_ENV] = str(Path(args.state_dir).resolve() / "up.json")
    launcher.refuse_second(launcher.state_path())
    if args.api_key_file and not Path(args.api_key_file).is_file():
        raise UsageError(f"--api-key-file {args.api_key_file}: no such file")
    try:
        cfg = KVServeConfig.load(args.config) if args.config else KVServeConfig()
        cfg = launcher.effective_config(cfg, args)
    except ConfigError as exc:
        raise UsageError(str(exc)) from exc
    if args.vllm_instances < 1:
        raise UsageError("--vllm-instances must be >= 1")
    run_dir = Path(args.run_dir) if args.run_dir else launcher.state_path().parent / "run-vllm"
    run_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    run_dir.chmod(0o700)             # logs, the Redis URL files, the vLLM event sockets
    stop = stop_on_signals()
    try:
        external = redis_url_from(args, cfg.redis)
    except SecretFileError as exc:
        raise UsageError(str(exc)) from exc
    if not external:                 # its log under the run dir, as kvserve.launcher does
        (run_dir / "redis").mkdir(mode=0o700, exist_ok=True)
    redis = None if external else EmbeddedRedis(data_dir=str(run_dir / "redis")).start()

    def url(role: str) -> str:
        return external or redis.url_for(role)  # type: ignore[union-attr]

    cfg = replace(cfg, redis=replace(cfg.redis, url="", url_file=""))
    model_dir = _model_dir(cfg.model.name)
    tls_dir, insecure = _security(args, run_dir)
    deployment = None if insecure else Path(tls_dir)
    creds = {role: hand_out(role, run_dir, redis_url=url(role), deployment=deployment)
             for role in ("kvstore", "router", "engine")}
    operator_url_file = hand_out("operator", run_dir, redis_url=url("operator"),
                                 deployment=None).redis_url_file
    config_file = run_dir / "kvserve.toml"
    launcher.write_private(config_file, launcher.to_toml(cfg))
    host, p = cfg.ports.host, cfg.ports
    base = [sys.executable, "-m", "kvserve.cli"]
    common = ["--config", str(config_file), "--host", host]
    store_addr = f"{host}:{p.kvstore}"
    store_health, router_health = free_port(host), free_port(host)
    plain = SecurityConfig(insecure=True)        # how to dial the plain-text health ports
    store = Child("kvstore", [*base, "store", "serve", *common,
                                       *creds["kvstore"].argv(), "--port", str(p.kvstore),
                                       "--metrics-port", str(p.metrics),
                                       "--health-port", str(store_health)],
                           f"{host}:{store_health}", run_dir / "kvstore.log", security=plain)
    keys = ["--api-key-file", str(Path(args.api_key_file).resolve())] if args.api_key_file \
        else []
    router = Child("router", [*base, "router", "serve", *common,
                                       *creds["router"].argv(), "--backend", "vllm",
                                       "--model", cfg.model.name, *keys,
                                       "--health-port", str(router_health)],
                            f"{host}:{router_health}", run_dir / "router.log", security=plain)
    roles = ["kv_producer", "kv_consumer"] if args.pd else ["kv_both"] * args.vllm_instances
    vllms = []
    for i, role in enumerate(roles):
        iid = f"vllm-{i}-{role.removeprefix('kv_')}"
        # Each server its own engine identity (CN = its id: its registry entry is
        # signed by it), made here, where the CA is; the child gets only its own
        # certificate, the engine role's secret and Redis URL file.
        ident = "" if insecure else str(engine_identity(tls_dir, iid, host))
        vllms.append(VLLMProcess(VLLMSpec(
            model_dir=model_dir, port=free_port(host), store=store_addr, redis_url="",
            redis_url_file=str(creds["engine"].redis_url_file),
            instance_id=iid, host=host, kv_role=role,
            block_tokens=cfg.blocks.block_tokens, node=cfg.tiers.node,
            kv_cache_mib=args.vllm_kv_cache_mib, tls_dir=ident, insecure=insecure,
            secret_file="" if insecure else str(creds["engine"].directory / "secret"),
            kv_events=f"ipc://{run_dir / f'vllm-{i}.events'}",
            extra_config={"window": cfg.blocks.window, "backtrack": cfg.blocks.backtrack,
                          "classes": sorted(cfg.classes.ttl_s),
                          "default_class": cfg.classes.default}),
            run_dir / f"vllm-{i}.log"))
    children = [store, router]
    try:
        start_children([store], args.ready_timeout, stop)
        for v in vllms:
            v.start()
        for v in vllms:
            v.wait_ready(args.ready_timeout)
            print(f"  vllm     ready at {v.spec.base_url} ({v.spec.kv_role}, "
                  f"{v.ready_s:.0f}s)", file=sys.stderr, flush=True)
        want = {"kvstore", "prefill"} | ({"decode"} if args.pd else set())
        wait_registered(url("operator"), want, args.ready_timeout)
        start_children([router], args.ready_timeout, stop)
        state = launcher.UpState(
            redis_url=redact_url(url("operator")), redis_url_file=str(operator_url_file),
            model=cfg.model.name, store=store_addr, tls_dir=tls_dir,
            prefill=vllms[0].spec.base_url, decode=vllms[-1].spec.base_url,
            router_http=f"http://{host}:{p.http}", router_grpc=f"{host}:{p.router_grpc}",
            tiers="G2 host " + launcher.human_size(cfg.tiers.g2_bytes), pid=os.getpid(),
            logs={**{c.name: str(c.log) for c in children},
                  **{v.spec.instance_id: str(v.log) for v in vllms}})
        launcher.state_path().parent.mkdir(parents=True, exist_ok=True)
        launcher.write_private(launcher.state_path(), json.dumps(asdict(state), indent=1))
        _print(state, vllms)
        code = _supervise(children, vllms, stop)
    except VLLMError as exc:
        raise UsageError(str(exc)) from exc
    finally:
        stop_children([router], args.grace)
        for v in vllms:
            v.stop(args.grace)
        stop_children([store], args.grace)
        launcher.remove_state()
        if redis is not None:
            redis.stop()
    print("kvserve up: stopped", flush=True)
    return code


def _print(state: launcher.UpState, vllms: list[VLLMProcess]) -> None:
    print("kvserve up (engine vllm): running (Ctrl-C stops everything)")
    print(f"  model     {state.model}")
    print(f"  redis     {state.redis_url}")
    print(f"  kvstore   {state.store}")
    for v in vllms:
        print(f"  {v.spec.instance_id:<9} {v.spec.base_url:<24} {v.spec.kv_role:<12} log {v.log}")
    print(f"  http      {state.router_http}/v1/chat/completions", flush=True)


def _supervise(children: list[Child], vllms: list[VLLMProcess],
               stop: Stop) -> int:
    while not stop.requested:
        for c in children:
            if c.proc is not None and c.proc.poll() is not None:
                print(f"kvserve up: {c.name} exited ({c.proc.returncode}); log {c.log}",
                      file=sys.stderr, flush=True)
                return 1
        for v in vllms:
            if not v.alive():
                print(f"kvserve up: {v.spec.instance_id} exited; log {v.log}", file=sys.stderr,
                      flush=True)
                return 1
        time.sleep(0.2)
    return 0
