"""vLLM OpenAI servers with kvserve's connector, as child processes.

``VLLMSpec`` is one server's whole command line and environment (the connector's
``--kv-transfer-config`` included); ``VLLMProcess`` starts it, waits for its
``/health`` and stops it.

Trust (docs/vllm.md, "Trust"): outside ``--insecure`` a server answers HTTPS
only, with its own ``engine`` identity (``engine_identity``: a certificate
whose common name is the instance id, so its registry entry can be verified)
and requires a client certificate of the deployment's CA; it requires the
deployment's vLLM API key, handed over in ``VLLM_API_KEY`` (never argv); and
it runs without ``VLLM_SERVER_DEV_MODE`` (whose endpoints are unauthenticated).

``configure_up`` adds the flags of ``kvserve up --engine vllm``
(kvserve/launch_vllm_up.py): Redis, one kvstore, ``--vllm-instances`` vLLM
servers (``kv_both``, or with ``--pd`` one ``kv_producer`` + one
``kv_consumer``) and the router with its vLLM backend.
Tests and ``kvserve bench vllm`` start servers through the same spec.

vLLM is started as ``python -m connectors.vllm_cli serve`` (the ``vllm``
console script of the CPU build fails on its distribution name; docs/vllm.md).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import ssl
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from kvserve.children import die_with_parent
from security.redact import has_credentials
from security.secret_files import write_private

KV_ROLES = ("kv_both", "kv_producer", "kv_consumer")

# What vLLM's CPU build wants on these machines (docs/vllm.md): no usage reports,
# offline, threads on every core. Never VLLM_SERVER_DEV_MODE: its endpoints
# (reset caches, collective RPCs, sleep) sit outside vLLM's API-key check.
BASE_ENV = {"VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
# Removed from a child's environment whatever the parent had.
DROP_ENV = ("VLLM_SERVER_DEV_MODE", "VLLM_CPU_KVCACHE_SPACE", "VLLM_API_KEY")


@dataclass(frozen=True, slots=True)
class VLLMSpec:
    model_dir: str
    port: int
    store: str                                  # kvstore gRPC address
    redis_url: str                              # without credentials (else redis_url_file)
    instance_id: str
    served_name: str = "smollm2"
    host: str = "127.0.0.1"
    kv_role: str = "kv_both"
    block_tokens: int = 64
    node: str = "node-0"
    kv_cache_mib: int = 1024                    # vLLM's KV cache (--kv-cache-memory-bytes)
    max_model_len: int = 4096
    max_num_seqs: int = 64                      # vLLM's default sizes buffers for 256
    enforce_eager: bool = True                  # ~40 s start instead of ~2-3 min
    connector: bool = True                      # False: plain vLLM (its own cache only)
    tls_dir: str = ""                           # its engine identity (engine_identity)
    insecure: bool = False                      # plain HTTP, no API key, no attestation
    secret_file: str = ""                       # deployment secret (salts, API key)
    kv_events: str = ""                         # vLLM's own KV events: a ZMQ endpoint
    redis_url_file: str = ""                    # 0600 file with the URL; VLLMProcess writes it
    log_stats: bool = False                     # vLLM's stats (its /metrics prefix-cache series)
    extra_config: dict[str, Any] = field(default_factory=dict)
    extra_args: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.kv_role not in KV_ROLES:
            raise ValueError(f"kv_role {self.kv_role!r} is not one of {KV_ROLES}")
        if self.block_tokens % 32:
            raise ValueError(f"block_tokens {self.block_tokens}: vLLM's CPU build needs a "
                             "multiple of 32")
        if not self.insecure and not (self.tls_dir and self.secret_file):
            raise ValueError(f"vLLM {self.instance_id}: pass tls_dir (its engine identity) "
                             "and secret_file, or insecure=True for plain text")

    @property
    def scheme(self) -> str:
        return "http" if self.insecure else "https"

    @property
    def base_url(self) -> str:
        return f"{self.scheme}://{self.host}:{self.port}"

    def security(self) -> Any:
        """Its own identity (security.config.SecurityConfig), also what probes it."""
        from security.config import SecurityConfig

        if self.insecure:
            return SecurityConfig(insecure=True)
        return SecurityConfig(cert_dir=self.tls_dir, role="engine", secret_file=self.secret_file)

    def api_key(self) -> str:
        from security.vllm_trust import vllm_api_key

        return vllm_api_key(self.security().require_secret())

    def kv_transfer_config(self) -> dict[str, Any]:
        # A Redis URL with a password goes by a 0600 file (VLLMProcess writes it),
        # never in argv (readable by every local user).
        if self.redis_url_file:
            registry: dict[str, Any] = {"redis_url_file": self.redis_url_file}
        elif has_credentials(self.redis_url):
            raise ValueError("a Redis URL with a password never goes on vLLM's command line: "
                             "set redis_url_file (VLLMProcess.start does)")
        else:
            registry = {"redis_url": self.redis_url} if self.redis_url else {}
        extra: dict[str, Any] = {"store": self.store, **registry,
                                 "instance_id": self.instance_id, "advertise": self.base_url,
                                 "node": self.node, "block_tokens": self.block_tokens,
                                 **self.extra_config}
        if self.tls_dir:
            extra["tls_dir"] = self.tls_dir
        if self.insecure:
            extra["insecure"] = True
        if self.secret_file:
            extra["secret_file"] = self.secret_file
        return {"kv_connector": "KVServeConnector", "kv_connector_module_path": "connectors.vllm",
                "kv_role": self.kv_role, "kv_load_failure_policy": "recompute",
                "kv_connector_extra_config": extra}

    def argv(self) -> list[str]:
        cmd = [sys.executable, "-m", "connectors.vllm_cli", "serve", self.model_dir,
               "--host", self.host, "--port", str(self.port),
               "--served-model-name", self.served_name, "--dtype", "float32",
               "--max-model-len", str(self.max_model_len), "--block-size", str(self.block_tokens),
               "--max-num-seqs", str(self.max_num_seqs),
               "--enable-prefix-caching", "--enable-prompt-tokens-details",
               "--kv-cache-memory-bytes", str(self.kv_cache_mib * 2**20)]
        if not self.log_stats:
            cmd.append("--disable-log-stats")
        if self.enforce_eager:
            cmd.append("--enforce-eager")
        if not self.insecure:
            from security.https import server_args

            cmd += server_args(self.tls_dir)
        if self.kv_events:
            cmd += ["--kv-events-config", json.dumps({"enable_kv_cache_events": True,
                                                      "publisher": "zmq",
                                                      "endpoint": self.kv_events})]
        if self.connector:
            cmd += ["--kv-transfer-config", json.dumps(self.kv_transfer_config())]
        return cmd + list(self.extra_args)

    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k not in DROP_ENV}
        env.update(BASE_ENV)
        if not self.insecure:
            env["VLLM_API_KEY"] = self.api_key()       # vLLM's --api-key, out of argv
        env.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{max(0, (os.cpu_count() or 1) - 1)}")
        root = str(Path(__file__).resolve().parent.parent)   # connectors/ importable in spawns
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH", "")]))
        return env


class VLLMError(RuntimeError):
    """A vLLM server did not start (the message carries its log's tail)."""


class VLLMProcess:
    def __init__(self, spec: VLLMSpec, log: Path) -> None:
        self.spec = spec
        self.log = log
        self.proc: subprocess.Popen[bytes] | None = None
        self.started_at = 0.0
        self.ready_s = 0.0
        self.tmp_dir: Path | None = None
        self._ssl = client_ssl(spec)

    def start(self) -> VLLMProcess:
        self.log.parent.mkdir(parents=True, exist_ok=True)
        if has_credentials(self.spec.redis_url) and not self.spec.redis_url_file:
            # Its password goes by a 0600 file beside the log, never in argv.
            path = write_private(self.log.with_suffix(".redis.url"), self.spec.redis_url + "\n")
            self.spec = replace(self.spec, redis_url_file=str(path))
        self.started_at = time.monotonic()
        # 0600: a log may quote prompts.
        # vLLM leaves its torch.distributed store file and ZMQ sockets in the temp dir
        # (world-readable, never removed): a 0700 one of its own, short enough for a
        # socket path, removed at stop; umask 077 whoever launched us.
        self.tmp_dir = Path(tempfile.mkdtemp(prefix="kvserve-vllm-"))
        env = {**self.spec.env(), "TMPDIR": str(self.tmp_dir)}
        with os.fdopen(os.open(self.log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600),
                       "wb") as out:
            self.proc = subprocess.Popen(self.spec.argv(), env=env, stdout=out,
                                         stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         start_new_session=True, preexec_fn=die_with_parent,
                                         umask=0o077)
        return self

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def wait_ready(self, timeout_s: float = 900.0) -> VLLMProcess:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not self.alive():
                raise VLLMError(f"vLLM {self.spec.instance_id} exited while starting; "
                                f"log {self.log}:\n{tail(self.log)}")
            if http_ok(self.spec.base_url + "/health", ssl_context=self._ssl):
                self.ready_s = time.monotonic() - self.started_at
                return self
            time.sleep(0.5)
        raise VLLMError(f"vLLM {self.spec.instance_id} not ready after {timeout_s:.0f}s; "
                        f"log {self.log}:\n{tail(self.log)}")

    def stop(self, grace_s: float = 20.0) -> None:
        """SIGTERM to its process group (the API server, engine core and workers),
        then its temp dir goes."""
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        if self.tmp_dir is not None:
            shutil.rmtree(self.tmp_dir, ignore_errors=True)
            self.tmp_dir = None


def client_ssl(spec: VLLMSpec) -> ssl.SSLContext | None:
    """How tools on this host call the server: its own identity's certificate
    (the server's names include 127.0.0.1 and localhost)."""
    from security.https import client_context

    return None if spec.insecure else client_context(spec.security())


def http_ok(url: str, timeout_s: float = 2.0, ssl_context: ssl.SSLContext | None = None) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s, context=ssl_context) as resp:
            return resp.status == 200
    except (urllib.error.URLError, OSError):
        return False


def engine_identity(deployment: str | Path, instance_id: str, host: str = "127.0.0.1") -> Path:
    """A vLLM instance's own identity under ``deployment/vllm/<instance_id>``:
    role ``engine``, common name = the instance id (the router accepts its
    registry entry only when signed so), made once. Needs the deployment's CA key,
    so only the launcher (operator side) calls this, never a child."""
    from security.pki import CertAuthority, CertRequest

    d = Path(deployment) / "vllm" / instance_id
    if not (d / "tls.key").exists():
        ca = CertAuthority.load(Path(deployment) / "ca")
        ca.issue(CertRequest("engine", name=instance_id, hosts=(host,))).save(d)
    return d


def tail(path: Path, lines: int = 25) -> str:
    with contextlib.suppress(OSError):
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    return ""


def security_args(tls_dir: str, insecure: bool) -> list[str]:
    return ["--insecure"] if insecure else ["--tls-dir", tls_dir] if tls_dir else []


# --------------------------------------------------------------------- kvserve up


def configure_up(p: argparse.ArgumentParser) -> None:
    """Flags only ``kvserve up --engine vllm`` reads (the launcher adds them)."""
    p.add_argument("--vllm-instances", type=int, default=2,
                   help="vLLM servers (kv_both) with --engine vllm (default 2)")
    p.add_argument("--pd", action="store_true",
                   help="with --engine vllm: one kv_producer (prefill) + one kv_consumer "
                   "(decode) that loads the prefill's KV through the warehouse")
    p.add_argument("--vllm-kv-cache-mib", type=int, default=2048,
                   help="KV cache of each vLLM server, MiB (--kv-cache-memory-bytes)")
