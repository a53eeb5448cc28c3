"""The children of a launcher (``kvserve up``, the benchmarks' stacks): each a
process in its own session that dies with its parent, logging to a private
file, holding only its own credentials (kvserve.credentials); started in
parallel and waited for on their health checks, stopped in reverse order.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvserve.cli import UsageError
from kvserve.credentials import ChildCredentials, child_env
from security.config import SecurityConfig


@dataclass(slots=True)
class Child:
    name: str
    argv: list[str]
    health: str                                 # gRPC address with a health service; "" = none
    log: Path
    proc: subprocess.Popen[bytes] | None = None
    security: SecurityConfig | None = None      # how the launcher dials its health check
    creds: ChildCredentials | None = None       # what the child was handed (renewed in place)
    role: str = ""                              # its identity; "" = its name ("prefill-1": set it)
    env: dict[str, str] = field(default_factory=dict)   # added to its environment (gpu_share)


def _spawn(c: Child) -> subprocess.Popen[bytes]:
    # 0600: a log may quote prompts; the child owns the file for its lifetime.
    log = os.fdopen(os.open(c.log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "wb")
    try:
        # Own process group: Ctrl-C reaches the launcher only, which stops
        # children in order; PDEATHSIG stops them if the launcher is killed.
        return subprocess.Popen(c.argv, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True,
                                preexec_fn=die_with_parent, env=child_env(c.name) | c.env)
    finally:
        log.close()


def die_with_parent() -> None:
    with contextlib.suppress(Exception):
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class Stop:
    def __init__(self) -> None:
        self.requested = False

    def __call__(self, signum: int, frame: Any) -> None:
        self.requested = True


def stop_on_signals() -> Stop:
    stop = Stop()
    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    return stop


def _healthy(address: str, security: SecurityConfig | None = None) -> bool:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    sec = security or SecurityConfig.from_env("operator")
    with sec.sync_channel(address, "") as ch:
        try:
            res = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""),
                                                       timeout=1.0)
        except grpc.RpcError:
            return False
    return res.status == health_pb2.HealthCheckResponse.SERVING


def start_children(children: list[Child], timeout_s: float, stop: Stop | None = None) -> None:
    """Spawn every child (they load models in parallel), then wait until each
    answers its health check; a child that exits first fails with its log."""
    for c in children:
        c.proc = _spawn(c)
    _wait_ready(children, timeout_s, stop)


def _wait_ready(children: list[Child], timeout_s: float, stop: Stop | None) -> None:
    deadline = time.monotonic() + timeout_s
    pending = [c for c in children if c.health]
    while pending:
        for c in list(pending):
            assert c.proc is not None
            if c.proc.poll() is not None:
                raise UsageError(f"{c.name} exited with status {c.proc.returncode} while "
                                 f"starting; its log: {c.log}\n{tail(c.log)}")
            if _healthy(c.health, c.security):
                pending.remove(c)
                print(f"  {c.name:<8} ready at {c.health}", file=sys.stderr, flush=True)
        if stop is not None and stop.requested:
            raise KeyboardInterrupt
        if pending and time.monotonic() > deadline:
            names = ", ".join(c.name for c in pending)
            raise UsageError(f"not ready after {timeout_s:.0f}s: {names} (logs in "
                             f"{pending[0].log.parent})")
        if pending:
            time.sleep(0.2)


def wait_registered(redis_url: str, roles: set[str] | Mapping[str, int],
                    timeout_s: float) -> None:
    """Until every role has as many live entries in the instance registry as
    asked (a set: one each)."""
    import asyncio
    from collections import Counter

    from kvstore.registry import InstanceRegistry

    want = dict.fromkeys(roles, 1) if isinstance(roles, set) else dict(roles)

    async def wait() -> None:
        async with InstanceRegistry(redis_url) as reg:
            deadline = time.monotonic() + timeout_s
            while True:
                have = Counter(i.role for i in await reg.list_instances())
                short = {r: n for r, n in want.items() if have[r] < n}
                if not short:
                    return
                if time.monotonic() > deadline:
                    raise UsageError(f"not registered after {timeout_s:.0f}s: "
                                     + ", ".join(f"{r} ({have[r]} of {n})"
                                                 for r, n in sorted(short.items())))
                await asyncio.sleep(0.1)

    asyncio.run(wait())


def tail(path: Path, lines: int = 15) -> str:
    with contextlib.suppress(OSError):
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    return ""


def stop_children(children: list[Child], grace_s: float) -> None:
    """SIGTERM in reverse start order, wait up to ``grace_s`` each, then SIGKILL."""
    for c in reversed(children):
        if c.proc is not None and c.proc.poll() is None:
            c.proc.send_signal(signal.SIGTERM)
            try:
                c.proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                c.proc.kill()
                c.proc.wait()
