"""Real service processes for the service tests: ``kvserve store|prefill|decode
serve`` started as children on free loopback ports, waited on through their
gRPC health service, stopped with SIGTERM (or killed, when a test says so)."""

from __future__ import annotations

import contextlib
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from kvserve.children import die_with_parent
from kvstore.redis_server import free_port
from tests.redis_args import redis_args
from tests.tls import channel

BLOCK = 16


def write_config(path: Path, *, model: str = "tiny-dense", block_tokens: int = BLOCK,
                 g3_path: str = "", local_tail_tokens: int | None = None,
                 local_cold_tokens: int | None = None) -> Path:
    lines = ["[model]", f'name = "{model}"', "", "[blocks]", f"block_tokens = {block_tokens}",
             "", "[router]", "heartbeat_s = 0.3", "instance_ttl_s = 2.0"]
    if local_tail_tokens is not None:
        lines.append(f"local_tail_tokens = {local_tail_tokens}")
    if local_cold_tokens is not None:
        lines.append(f"local_cold_tokens = {local_cold_tokens}")
    lines.append("")
    if g3_path:
        lines += ["[tiers]", f'g3_path = "{g3_path}"', ""]
    path.write_text("\n".join(lines))
    return path


@dataclass(slots=True)
class Proc:
    role: str
    argv: list[str]
    port: int
    log: Path
    metrics_port: int = -1
    popen: subprocess.Popen[bytes] | None = field(default=None, repr=False)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> Proc:
        with open(self.log, "ab") as log:
            # Dies with the test process: a killed run (OOM, Ctrl-C twice) must not
            # leave its session-long stacks holding GiBs for the next one.
            self.popen = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT,
                                          stdin=subprocess.DEVNULL, preexec_fn=die_with_parent)
        return self

    def wait_ready(self, timeout_s: float = 90.0) -> Proc:
        deadline = time.monotonic() + timeout_s
        while not healthy(self.address):
            assert self.popen is not None
            if self.popen.poll() is not None:
                raise RuntimeError(f"{self.role} exited ({self.popen.returncode}):\n"
                                   f"{self.log.read_text()[-3000:]}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.role} not healthy after {timeout_s}s:\n"
                                   f"{self.log.read_text()[-3000:]}")
            time.sleep(0.1)
        return self

    def stop(self, timeout_s: float = 20.0) -> int:
        if self.popen is None or self.popen.poll() is not None:
            return self.popen.returncode if self.popen else 0
        self.popen.send_signal(signal.SIGTERM)
        try:
            return self.popen.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            self.popen.wait()
            raise RuntimeError(f"{self.role} did not stop within {timeout_s}s of SIGTERM:\n"
                               f"{self.log.read_text()[-3000:]}") from None

    def kill(self) -> None:
        if self.popen is not None and self.popen.poll() is None:
            self.popen.kill()
            self.popen.wait()

    def metrics(self) -> dict[str, float]:
        """Every sample of the /metrics endpoint as "name{k=v}" -> value."""
        body = urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics",
                                      timeout=5).read().decode()
        out: dict[str, float] = {}
        for fam in text_string_to_metric_families(body):
            for s in fam.samples:
                labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
                out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
        return out


def healthy(address: str) -> bool:
    with channel(address) as ch:
        try:
            res = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(),
                                                       timeout=1.0)
        except grpc.RpcError:
            return False
    return res.status == health_pb2.HealthCheckResponse.SERVING


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "kvserve.cli", *args]


def store(config: Path, redis_url: str, log_dir: Path, port: int = 0) -> Proc:
    port = port or free_port()
    argv = _cli("store", "serve", "--config", str(config), "--host", "127.0.0.1",
                "--port", str(port), *redis_args(redis_url), "--metrics-port", "-1",
                "--grace", "1")
    return Proc("kvstore", argv, port, log_dir / f"kvstore-{port}.log")


def engine_service(role: str, config: Path, redis_url: str, log_dir: Path, *,
                   store_address: str = "", extra: tuple[str, ...] = ()) -> Proc:
    port, metrics = free_port(), free_port()
    argv = _cli("-v", role, "serve", "--config", str(config), "--host", "127.0.0.1",
                "--port", str(port), *redis_args(redis_url), "--store", store_address,
                "--metrics-port", str(metrics), *extra)
    return Proc(role, argv, port, log_dir / f"{role}-{port}.log", metrics)


def start_all(*procs: Proc) -> None:
    """Start in parallel (model loading overlaps), then wait for each."""
    for p in procs:
        p.start()
    try:
        for p in procs:
            p.wait_ready()
    except BaseException:
        for p in procs:
            with contextlib.suppress(Exception):
                p.kill()
        raise
