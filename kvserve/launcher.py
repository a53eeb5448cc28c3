"""``kvserve up``: the whole stack on one machine, each part a child process.

Embedded Redis (unless REDIS_URL / --redis-url), one kvstore, N prefill and
M decode instances (``--prefill N --decode M`` or ``[engine]``; one each by
default), and the router front when a ``router serve`` command exists. The
launcher writes one effective config file that every child reads (so block
size, classes and ports agree), waits until each answers its health check,
prints what runs where, and on Ctrl-C / SIGTERM stops the children in
reverse order (SIGTERM, grace, then SIGKILL). A child that dies on its own
stops the rest. ``kvserve chat`` and ``kvserve status`` find the running
stack through the state file it writes (0600). Each child gets only its own
credentials, by files named on its command line (kvserve/credentials.py); no
secret is in argv, the environment, the banner, the state or the config file.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import socket
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from common.config import ConfigError, EngineSection, KVServeConfig, parse_size
from kvserve.children import (
    Child,
    Stop,
    die_with_parent,
    start_children,
    stop_children,
    stop_on_signals,
    tail,
    wait_registered,
)
from kvserve.cli import UsageError, build_registry
from kvserve.credentials import hand_out_roles, renew_due
from kvserve.gpu_share import start_gpu_share
from security.config import SecurityConfig
from security.flags import add_redis_flags, redis_url_from
from security.redact import redact_url
from security.secret_files import SecretFileError, read_secret_text, write_private

STATE_ENV = "KVSERVE_STATE"


def state_path() -> Path:
    if os.environ.get(STATE_ENV):
        return Path(os.environ[STATE_ENV])
    base = Path(os.environ.get("KVSERVE_CACHE", Path.home() / ".cache" / "kvserve"))
    return base / "up.json"


@dataclass(frozen=True, slots=True)
class UpState:
    """What ``kvserve up`` started: read by ``kvserve chat`` / ``status``."""

    redis_url: str                          # for display: the password masked
    model: str
    store: str
    prefill: str
    decode: str
    router_http: str = ""
    router_grpc: str = ""
    tiers: str = ""
    pid: int = 0
    logs: dict[str, str] = field(default_factory=dict)
    metrics: dict[str, str] = field(default_factory=dict)   # role -> Prometheus URL
    config: str = ""                        # the effective config file every child reads
    tls_dir: str = ""                       # the stack's deployment directory; "" = --insecure
    prefills: list[str] = field(default_factory=list)   # every prefill instance's address
    decodes: list[str] = field(default_factory=list)    # every decode instance's address
    pids: dict[str, int] = field(default_factory=dict)  # child name -> process id
    redis_url_file: str = ""                # the operator's Redis URL (0600)

    def registry_url(self) -> str:
        """The operator's Redis URL, read from its file ("" when there is none)."""
        try:
            return read_secret_text(self.redis_url_file, "the stack's Redis URL file") \
                if self.redis_url_file else ""
        except SecretFileError as exc:
            raise UsageError(str(exc)) from exc

    def security(self, role: str = "operator") -> SecurityConfig:
        """Credentials to talk to this stack (``kvserve chat`` / ``status``)."""
        if not self.tls_dir:
            return SecurityConfig(insecure=True)
        return SecurityConfig(cert_dir=self.tls_dir, role=role)

    @classmethod
    def load(cls, path: Path | None = None) -> UpState | None:
        path = path or state_path()
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            return None
        known = set(cls.__dataclass_fields__)
        state = cls(**{k: v for k, v in data.items() if k in known})
        with contextlib.suppress(OSError):
            os.kill(state.pid, 0)
            return state
        return None                             # stale: the launcher is gone


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="kvserve TOML config file")
    p.add_argument("--model", default=None, help="model for prefill and decode (default smollm2)")
    p.add_argument("--host", default=None, help="bind address of every service")
    add_redis_flags(p, default="an embedded Redis with one ACL user per role")
    p.add_argument("--cert-days", type=int, default=None, metavar="DAYS",
                   help="validity of the children's certificates, renewed at half-life "
                   "(default 7)")
    p.add_argument("--g3-path", default=None,
                   help="local disk tier directory (default: $KVSERVE_CACHE/g3, so warm KV "
                   "survives a restart); 'none' for no disk tier")
    p.add_argument("--port", type=int, default=None,
                   help="HTTP port of the OpenAI front (default [ports].http, 8000)")
    p.add_argument("--api-key-file", default=None,
                   help="file of 'KEY TENANT' lines; HTTP requests then need a listed key")
    p.add_argument("--free-ports", action="store_true",
                   help="pick free ports instead of the configured ones")
    p.add_argument("--state-dir", default=None,
                   help="state file, logs and default disk tier in DIR, so a second stack "
                   "can run beside the first (use with --free-ports; point chat/status at it "
                   "with KVSERVE_STATE=DIR/up.json)")
    p.add_argument("--run-dir", default=None, help="logs and the effective config (default: a "
                   "folder next to the state file)")
    p.add_argument("--ready-timeout", type=float, default=600.0,
                   help="seconds to wait for every service to answer its health check")
    p.add_argument("--grace", type=float, default=10.0, help="shutdown grace per child, seconds")
    p.add_argument("--no-router", action="store_true", help="do not start the router front")
    p.add_argument("--prefill", type=int, default=None, metavar="N",
                   help="prefill instances (default [engine].prefill, 1)")
    p.add_argument("--decode", type=int, default=None, metavar="M",
                   help="decode instances (default [engine].decode, 1)")
    p.add_argument("--g1", default=None, metavar="SIZE",
                   help="each engine's own KV pool (G1), e.g. 256MiB; becomes num_blocks by "
                   "the model's block size (default [engine].g1_bytes, else the services' "
                   "default pool)")
    p.add_argument("--decode-g1", default=None, metavar="SIZE",
                   help="decode engines' KV pool when it should differ from --g1 (it holds "
                   "running sequences only; default [engine].decode_g1_bytes, else --g1)")
    p.add_argument("--tls-dir", default=None, metavar="DIR",
                   help="deployment directory (secret, CA, certificates) shared by every child; "
                   "created on first start (default: tls/ next to the state file)")
    p.add_argument("--gpu-share", choices=("time", "mps"), default=None, help="CUDA: time "
                   "slicing or a CUDA MPS daemon of the stack's own (default [engine].gpu_share)")
    p.add_argument("--insecure", action="store_true",
                   help="plain text and NO authentication between the services (logged)")
    p.add_argument("--engine", choices=("kvserve", "vllm"), default="kvserve",
                   help="kvserve's own prefill/decode services, or vLLM OpenAI servers with "
                   "the kvserve connector (needs the [vllm] extra; docs/vllm.md)")


def run(args: argparse.Namespace) -> int:
    if args.state_dir:
        os.environ[STATE_ENV] = str(Path(args.state_dir).resolve() / "up.json")
    refuse_second(state_path())
    if args.api_key_file and not Path(args.api_key_file).is_file():
        raise UsageError(f"--api-key-file {args.api_key_file}: no such file")
    try:
        cfg = KVServeConfig.load(args.config) if args.config else KVServeConfig()
        cfg = effective_config(cfg, args)
    except ConfigError as exc:
        raise UsageError(str(exc)) from exc
    metrics_ports = _metrics_ports(cfg, free=args.free_ports)
    check_ports_free(cfg.ports.host, {**_service_ports(cfg, router=not args.no_router,
                                                       free=args.free_ports),
                                      **{f"{r} metrics": p for r, p in metrics_ports.items()}})
    run_dir = Path(args.run_dir) if args.run_dir else state_path().parent / "run"
    run_dir.mkdir(parents=True, exist_ok=True, mode=0o700)  # logs may quote prompts
    security = _security(args)
    stop = stop_on_signals()
    redis, url = _redis(args, cfg, run_dir)
    # The shared config names no Redis: each child gets its own role's URL file.
    cfg = replace(cfg, redis=replace(cfg.redis, url="", url_file=""))
    _prefetch(cfg.model.name)
    config_file = run_dir / "kvserve.toml"
    _write_private(config_file, to_toml(cfg))
    children = _children(cfg, config_file, run_dir, router=not args.no_router,
                         metrics=metrics_ports, api_key_file=args.api_key_file,
                         free=args.free_ports)
    deployment = None if security.insecure else Path(security.cert_dir)
    operator = _hand_out_credentials(children, run_dir, deployment, security, url,
                                     args.cert_days)
    redis_url = url("operator")
    state = replace(_state(cfg, children, metrics_ports), config=str(config_file),
                    redis_url=redact_url(redis_url), redis_url_file=str(operator),
                    tls_dir="" if security.insecure else security.cert_dir)
    gpu = start_gpu_share(cfg.engine, run_dir, children)    # "mps": the engines join it
    try:
        # The router last: its first view of the registry then holds the others.
        start_children([c for c in children if c.name != "router"], args.ready_timeout, stop)
        wait_registered(redis_url, {"kvstore": 1, "prefill": cfg.engine.prefill,
                                    "decode": cfg.engine.decode}, args.ready_timeout)
        start_children([c for c in children if c.name == "router"], args.ready_timeout, stop)
        state = replace(state, pids={c.name: c.proc.pid for c in children if c.proc})
        _write_private(state_path(), json.dumps(asdict(state), indent=1))
        _print_started(state, children)
        print(f"  gpu share {gpu.describe()}", flush=True)
        code = _supervise(children, stop, deployment, args.cert_days)
    finally:
        stop_children(children, args.grace)
        gpu.stop()
        remove_state()
        if redis is not None:
            redis.stop()
    print("kvserve up: stopped", flush=True)
    return code


def _redis(args: argparse.Namespace, cfg: KVServeConfig,
           run_dir: Path) -> tuple[Any, Callable[[str], str]]:
    """(the embedded server or None, role -> its Redis URL): one ACL user per role
    on the embedded server; a given URL serves every role. The server's directory
    (its log) is ``run_dir/redis``, not a temporary one: a launcher killed -9 has no
    chance to remove a temporary directory, and every file of a stack stays under
    its state directory (issue 18's sweep found 17 stale ``/tmp/kvserve-redis-*``)."""
    try:
        external = redis_url_from(args, cfg.redis)
    except SecretFileError as exc:
        raise UsageError(str(exc)) from exc
    if external:
        return None, lambda _role: external
    from kvstore.redis_server import EmbeddedRedis

    data = run_dir / "redis"
    data.mkdir(mode=0o700, exist_ok=True)
    redis = EmbeddedRedis(preexec=die_with_parent, data_dir=str(data)).start()
    return redis, redis.url_for


def _security(args: argparse.Namespace) -> SecurityConfig:
    """mTLS for every child unless --insecure: the deployment directory (secret,
    CA, one certificate per role, keys 0600) is made on first start and kept."""
    if args.insecure:
        print("WARNING: kvserve up --insecure: every service listens in PLAIN TEXT with NO "
              "authentication; anyone who reaches a port can read and overwrite every "
              "tenant's KV (docs/security.md)", file=sys.stderr, flush=True)
        return SecurityConfig(insecure=True)
    from security.pki import ensure_deployment

    tls = Path(args.tls_dir) if args.tls_dir else state_path().parent / "tls"
    try:
        ensure_deployment(tls)
        return SecurityConfig(cert_dir=str(tls.resolve()), role="operator")
    except (OSError, ValueError) as exc:
        raise UsageError(f"cannot prepare certificates in {tls}: {exc}") from exc


def _hand_out_credentials(children: list[Child], run_dir: Path, deployment: Path | None,
                          security: SecurityConfig, url: Callable[[str], str],
                          cert_days: int | None) -> Path:
    """Give each child its role's credentials directory (kvserve.credentials) on
    its command line; returns the operator's Redis URL file."""
    creds = hand_out_roles([c.role or c.name for c in children], run_dir, url=url,
                           deployment=deployment, days=cert_days)
    for c in children:
        c.creds = creds[c.role or c.name]
        c.argv += c.creds.argv()
        c.security = security
    return creds["operator"].redis_url_file


def stack_security(role: str = "operator") -> SecurityConfig:
    """Credentials of a command-line tool: KVSERVE_TLS_DIR if set, else those of
    the running ``kvserve up`` (its state file), else an error naming both."""
    from security.config import TLS_DIR_ENV

    state = None if os.environ.get(TLS_DIR_ENV) else UpState.load()
    try:
        return state.security(role) if state is not None else SecurityConfig.from_env(role)
    except ValueError as exc:
        raise UsageError(str(exc)) from exc


_write_private = write_private          # 0600, atomic; a missing parent is made 0700


def remove_state() -> None:
    """Remove the state file if it is ours (another launcher may have replaced it)."""
    with contextlib.suppress(OSError, ValueError, KeyError):
        if json.loads(state_path().read_text())["pid"] == os.getpid():
            state_path().unlink()


def refuse_second(path: Path) -> None:
    """One stack per state file: a second ``up`` would fight the first for its
    ports and overwrite its logs and state."""
    running = UpState.load(path)
    if running is None:
        return
    where = running.router_http or running.prefill
    raise UsageError(
        f"kvserve up is already running: pid {running.pid}, model {running.model}, {where} "
        f"(state {path}). Stop it first (Ctrl-C in its terminal, or kill {running.pid}), or "
        "start another beside it with --state-dir DIR --free-ports")


def check_ports_free(host: str, ports: dict[str, int]) -> None:
    """Fail before starting anything when a port is taken, naming it."""
    taken = []
    for name, port in ports.items():
        if port <= 0:
            continue
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
            # As the servers bind (SO_REUSEADDR, never SO_REUSEPORT): a port in
            # TIME_WAIT is free, one with a listener is not.
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind((host, port))
            except OSError as exc:
                taken.append(f"{name} port {port} ({exc.strerror})")
    if taken:
        raise UsageError(f"cannot start on {host}: " + ", ".join(taken) + ". Another kvserve "
                         "up or another server holds it; pick ports with --port (HTTP) or a "
                         "[ports] section, or use --free-ports")


# Instance i > 0 of a role listens on its role's configured port + PORT_STRIDE * i
# (metrics likewise), so a fixed [ports] section still gives every instance a port.
PORT_STRIDE = 100


@dataclass(frozen=True, slots=True)
class EngineSlot:
    """One engine instance ``up`` runs: its child name, role and ports."""

    name: str                   # "prefill" / "decode" alone, "prefill-0", "prefill-1", ...
    role: str
    index: int
    port: int
    metrics_port: int


def engine_slots(cfg: KVServeConfig, metrics: Mapping[str, int], *,
                 free: bool) -> list[EngineSlot]:
    """The prefill instances then the decode instances of ``cfg.engine``."""
    from kvstore.redis_server import free_port

    out = []
    for role, n, port in (("prefill", cfg.engine.prefill, cfg.ports.prefill),
                          ("decode", cfg.engine.decode, cfg.ports.decode)):
        for i in range(n):
            name = role if n == 1 else f"{role}-{i}"
            p = port if i == 0 else (free_port(cfg.ports.host) if free
                                     else port + PORT_STRIDE * i)
            out.append(EngineSlot(name, role, i, p, metrics[name]))
    return out


def _service_ports(cfg: KVServeConfig, *, router: bool, free: bool = False) -> dict[str, int]:
    p = cfg.ports
    ports = {"kvstore": p.kvstore}
    for role, n, port in (("prefill", cfg.engine.prefill, p.prefill),
                          ("decode", cfg.engine.decode, p.decode)):
        for i in range(n):
            if i == 0 or not free:          # free extra ports are picked at spawn time
                ports[role if n == 1 else f"{role}-{i}"] = port + PORT_STRIDE * i
    if router and router_available():
        ports |= {"router gRPC": p.router_grpc, "HTTP": p.http}
    return ports


def _metrics_ports(cfg: KVServeConfig, *, free: bool) -> dict[str, int]:
    """Prometheus ports of the kvstore and every engine instance ([ports].metrics,
    then +1 for prefill and +2 for decode, + PORT_STRIDE per further instance; the
    router serves /metrics on its HTTP port)."""
    base = cfg.ports.metrics
    names = {"kvstore": base}
    for offset, role, n in ((1, "prefill", cfg.engine.prefill), (2, "decode", cfg.engine.decode)):
        for i in range(n):
            names[role if n == 1 else f"{role}-{i}"] = base + offset + PORT_STRIDE * i
    if free:
        from kvstore.redis_server import free_port

        return {r: free_port(cfg.ports.host) for r in names}
    return names


def engine_threads(engine: EngineSection, cpus: int | None = None) -> int:
    """Torch threads per engine: as configured, else (several instances of a role,
    which compute at once) the cores split between them, so N+M engines on a small
    machine do not oversubscribe it; 0 (all cores) for one instance per role."""
    if engine.threads or max(engine.prefill, engine.decode) == 1:
        return engine.threads
    cpus = cpus or len(os.sched_getaffinity(0))
    return max(1, cpus // max(engine.prefill, engine.decode))


def effective_config(cfg: KVServeConfig, args: argparse.Namespace) -> KVServeConfig:
    if args.model:
        cfg = replace(cfg, model=replace(cfg.model, name=args.model))
    g3 = args.g3_path
    if g3 is None and not cfg.tiers.g3_path:
        # A local stack keeps its blocks on disk by default: users expect warm KV
        # (and what they paid to compute) to outlive a Ctrl-C. Beside another
        # stack (--state-dir) it keeps its own.
        g3 = str(Path(args.state_dir) / "g3" if args.state_dir else Path(os.environ.get(
            "KVSERVE_CACHE", Path.home() / ".cache" / "kvserve")) / "g3")
    if g3 is not None:
        cfg = replace(cfg, tiers=replace(cfg.tiers, g3_path="" if g3 == "none" else g3))
    ports = cfg.ports
    if args.host:
        ports = replace(ports, host=args.host)
    if args.free_ports:
        from kvstore.redis_server import free_port

        ports = replace(ports, kvstore=free_port(ports.host), prefill=free_port(ports.host),
                        decode=free_port(ports.host), router_grpc=free_port(ports.host),
                        http=free_port(ports.host), metrics=free_port(ports.host))
    if args.port is not None:
        ports = replace(ports, http=args.port)
    engine = cfg.engine
    given = {k: v for k, v in (("prefill", getattr(args, "prefill", None)),
                               ("decode", getattr(args, "decode", None)),
                               ("g1_bytes", getattr(args, "g1", None)),
                               ("decode_g1_bytes", getattr(args, "decode_g1", None)),
                               ("gpu_share", getattr(args, "gpu_share", None)))
             if v is not None}
    if given:
        for name, flag in (("g1_bytes", "--g1"), ("decode_g1_bytes", "--decode-g1")):
            if name in given:
                given[name] = parse_size(given[name], flag)
        engine = replace(engine, **given)     # validated again (ConfigError names the flag)
    engine = replace(engine, threads=engine_threads(engine))
    return replace(cfg, ports=ports, engine=engine)


def _prefetch(model: str) -> None:
    """Fetch a known model once here, so prefill and decode do not race to."""
    from engine.fetch import KNOWN_MODELS, fetch_model

    if model in KNOWN_MODELS:
        fetch_model(model)


def _children(cfg: KVServeConfig, config_file: Path, run_dir: Path, *, router: bool,
              metrics: dict[str, int], api_key_file: str | None = None,
              free: bool = False) -> list[Child]:
    """Every child of the stack, kvstore first and router last (the one place
    that builds their command lines)."""
    host, p = cfg.ports.host, cfg.ports
    # Children log at the level `kvserve -v up` asked for (their logs are 0600 files).
    level = logging.getLogger().getEffectiveLevel()
    verbose = ["-v"] * (level <= logging.INFO) + ["-v"] * (level <= logging.DEBUG)
    base = [sys.executable, "-m", "kvserve.cli", *verbose]
    # No --redis-url, no secret: argv is world-readable in /proc. Each child's own
    # credentials (Redis URL file, certificate) are added by _hand_out_credentials.
    common = ["--config", str(config_file), "--host", host]
    store_addr = f"{host}:{p.kvstore}"
    children = [
        Child("kvstore", [*base, "store", "serve", *common, "--port", str(p.kvstore),
                          "--metrics-port", str(metrics["kvstore"])], store_addr,
              run_dir / "kvstore.log")]
    decode_flags: list[str] = []
    if cfg.engine.decode_g1_bytes:
        from service.config import engine_spec_from, num_blocks_for

        decode_flags = ["--num-blocks",
                        str(num_blocks_for(cfg.engine.decode_g1_bytes, engine_spec_from(cfg)))]
    if cfg.engine.decode_gpu_fraction:
        decode_flags += ["--gpu-fraction", repr(cfg.engine.decode_gpu_fraction)]
    for slot in engine_slots(cfg, metrics, free=free):
        # Several instances of a role on one host: each its own registry id.
        ident = ["--instance-id", f"{slot.role}-{host}:{slot.port}"] if slot.name != slot.role \
            else []
        own = decode_flags if slot.role == "decode" else []
        children.append(Child(slot.name, [*base, slot.role, "serve", *common, "--port",
                                          str(slot.port), "--store", store_addr,
                                          "--metrics-port", str(slot.metrics_port), *ident,
                                          *own],
                              f"{host}:{slot.port}", run_dir / f"{slot.name}.log",
                              role=slot.role))
    if router and router_available():
        keys = ["--api-key-file", str(Path(api_key_file).resolve())] if api_key_file else []
        children.append(Child("router", [*base, "router", "serve", *common, *keys],
                              f"{host}:{p.router_grpc}", run_dir / "router.log"))
    return children


def router_available() -> bool:
    """Whether some module registered ``kvserve router serve`` (checked at run time)."""
    return build_registry().has("router serve")


def _state(cfg: KVServeConfig, children: list[Child], metrics: dict[str, int]) -> UpState:
    by = {c.name: c for c in children}
    p = cfg.ports
    tiers = ["G2 host " + human_size(cfg.tiers.g2_bytes)]
    if cfg.tiers.g3_path:
        tiers.append(f"G3 disk {cfg.tiers.g3_path} {human_size(cfg.tiers.g3_bytes)}")
    if cfg.tiers.g4_url:
        tiers.append(f"G4 {cfg.tiers.g4_url}")
    router = "router" in by
    prefills = [c.health for c in children if _role(c.name) == "prefill"]
    decodes = [c.health for c in children if _role(c.name) == "decode"]
    return UpState(redis_url=cfg.redis.url, model=cfg.model.name, store=by["kvstore"].health,
                   prefill=prefills[0], decode=decodes[0], prefills=prefills, decodes=decodes,
                   router_http=f"http://{p.host}:{p.http}" if router else "",
                   router_grpc=f"{p.host}:{p.router_grpc}" if router else "",
                   tiers=", ".join(tiers), pid=os.getpid(),
                   logs={c.name: str(c.log) for c in children},
                   metrics=_metrics_urls(p.host, metrics, p.http if router else 0))


def _role(name: str) -> str:
    """A child's role from its name ("prefill-1" -> "prefill")."""
    return name.split("-", 1)[0]


def _metrics_urls(host: str, ports: dict[str, int], http: int) -> dict[str, str]:
    urls = {role: f"http://{host}:{port}/metrics" for role, port in ports.items() if port > 0}
    if http:
        urls["router"] = f"http://{host}:{http}/metrics"
    return urls


def human_size(n: int) -> str:
    for unit, div in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20)):
        if n >= div:
            return f"{n / div:.1f}{unit}"
    return f"{n}B"


def _print_started(state: UpState, children: list[Child]) -> None:
    print("kvserve up: running (Ctrl-C stops everything)")
    print(f"  model     {state.model}")
    print(f"  redis     {state.redis_url}")
    print(f"  tiers     {state.tiers}")
    for c in children:
        assert c.proc is not None
        print(f"  {c.name:<9} {c.health:<22} pid {c.proc.pid:<8} log {c.log}")
    if state.router_http:
        print(f"  http      {state.router_http}/v1/chat/completions")
    for role, url in state.metrics.items():
        print(f"  metrics   {role:<9} {url}")
    print("  try:      kvserve chat --prompt 'Hello'   |   kvserve status", flush=True)


def _supervise(children: list[Child], stop: Stop, deployment: Path | None = None,
               cert_days: int | None = None) -> int:
    """Until Ctrl-C / SIGTERM. A child that exits stops the stack, unless it is one
    of several instances of its role: then the router places around it (it leaves
    the registry) and the stack runs on while one instance of the role is left."""
    days = {} if cert_days is None else {"days": cert_days}
    gone: set[str] = set()
    while not stop.requested:
        for c in children:
            assert c.proc is not None
            if c.name in gone:
                continue
            if c.proc.poll() is None:
                if c.creds is not None:     # short-lived certificates: renewed in place
                    c.creds = renew_due(c.creds, deployment, **days)
                continue
            gone.add(c.name)
            left = [o for o in children if _role(o.name) == _role(c.name)
                    and o.name not in gone]
            if left and c.name != _role(c.name):
                print(f"kvserve up: {c.name} exited with status {c.proc.returncode}; "
                      f"{len(left)} {_role(c.name)} instance(s) left, running on. Its log: "
                      f"{c.log}", file=sys.stderr, flush=True)
                continue
            print(f"kvserve up: {c.name} exited with status {c.proc.returncode}; stopping "
                  f"the rest. Its log: {c.log}\n{tail(c.log)}", file=sys.stderr, flush=True)
            return 1
        time.sleep(0.2)
    return 0


def to_toml(cfg: KVServeConfig) -> str:
    """The config as TOML that ``KVServeConfig.load`` reads back to an equal value."""
    out: list[str] = []
    nested: list[str] = []
    for section, value in asdict(cfg).items():
        out.append(f"[{section}]")
        for key, v in value.items():
            if isinstance(v, dict):
                nested.append(f"[{section}.{key}]")
                nested.extend(f"{k} = {_toml_value(x)}" for k, x in v.items())
                nested.append("")
            else:
                out.append(f"{key} = {_toml_value(v)}")
        out.append("")
    return "\n".join(out + nested)


def _toml_value(v: object) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int | float):
        return repr(v)
    return json.dumps(str(v))
