"""``kvserve up`` on one machine, then ``kvserve chat`` and ``kvserve status``
against it: real processes, real sockets, real Redis (its own embedded one, as
a user gets). The stack is the package's (tests/kvserve/up_stack.py), shared
with test_up_secrets.py, whose last test checks Ctrl-C."""

from __future__ import annotations

import json
import stat
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlsplit

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from security.config import SecurityConfig
from tests.kvserve.up_stack import UpStack


def healthy(address: str, tls_dir: str) -> bool:
    """Health check with the stack's own credentials (``up`` made them)."""
    sec = SecurityConfig(tls_dir, role="operator") if tls_dir else SecurityConfig(insecure=True)
    with sec.sync_channel(address, "") as ch:
        try:
            res = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(),
                                                       timeout=1.0)
        except grpc.RpcError:
            return False
    return res.status == health_pb2.HealthCheckResponse.SERVING


def _kvserve(*args: str, env: dict[str, str],
             timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvserve.cli", *args], env=env, text=True,
                          capture_output=True, timeout=timeout)


def test_up_chat_and_status(up_stack: UpStack) -> None:
    stack = up_stack.running()
    banner, env, tmp_path = stack.banner, stack.env, stack.tmp
    state = stack.state
    assert state["model"] == "tiny-dense" and state["redis_url"].startswith("redis://")
    for role in ("kvstore", "prefill", "decode"):
        assert f"  {role}" in banner
    # The banner names Redis with its password masked (the password itself is
    # only in the operator's 0600 file; tests/kvserve/test_up_secrets.py greps).
    assert state["redis_url"] in banner and "G2 host" in banner
    password = urlsplit(Path(state["redis_url_file"]).read_text().strip()).password
    assert password and password not in banner and ":***@" in state["redis_url"]
    # First start made the stack's own CA and certificates under its state dir
    # (KVSERVE_STATE's directory), every file 0600, and every child serves mTLS
    # with them.
    tls = Path(state["tls_dir"])
    assert tls == (tmp_path / "tls").resolve()
    files = [p for p in tls.rglob("*") if p.is_file()]
    assert {"secret", "ca.key", "tls.key"} <= {p.name for p in files}
    assert all(stat.S_IMODE(p.stat().st_mode) == 0o600 for p in files)
    # The embedded Redis keeps its directory under the state dir too, not in /tmp
    # (where a launcher killed -9 left it behind).
    redis_dir = tmp_path / "run" / "redis"
    assert (redis_dir / "redis.log").is_file()
    assert stat.S_IMODE(redis_dir.stat().st_mode) == 0o700
    for role in ("store", "prefill", "decode"):
        assert healthy(state[role], state["tls_dir"]), role
        with grpc.insecure_channel(state[role]) as plain:       # no credentials
            with pytest.raises(grpc.RpcError) as refused:
                health_pb2_grpc.HealthStub(plain).Check(health_pb2.HealthCheckRequest(),
                                                        timeout=2.0)
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE

    # A prompt of its own: the stack is shared, and this one must start uncached.
    prompt = f"{tmp_path.name}: hello, warehouse!"
    chat = _kvserve("chat", "--prompt", prompt, "--max-tokens", "6", "--stats", env=env)
    assert chat.returncode == 0, chat.stderr
    assert "output 6" in chat.stderr and "cached 0" in chat.stderr
    again = _kvserve("chat", "--prompt", prompt, "--max-tokens", "6", "--stats", env=env)
    assert again.returncode == 0 and again.stdout == chat.stdout      # greedy: same text

    # Interactive: each turn resends the conversation; the second one hits the first.
    question = "Tell me about the warehouse tiers: G2, G3 and G4, and when each one helps. " * 2
    talk = subprocess.run([sys.executable, "-m", "kvserve.cli", "chat", "--max-tokens", "4",
                           "--stats"], env=env, text=True, capture_output=True, timeout=120,
                          input=f"{question}\nAnd G1?\n")
    assert talk.returncode == 0, talk.stderr
    turns = [line for line in talk.stderr.splitlines() if line.startswith("[prompt")]
    assert len(turns) == 2, talk.stderr
    cached = int(turns[1].split("cached ")[1].split(",")[0])
    assert cached >= 128, turns

    status = _kvserve("status", "--json", env=env)
    assert status.returncode == 0, status.stderr
    snap = json.loads(status.stdout)
    roles = {i["role"] for i in snap["instances"]}
    assert {"kvstore", "prefill", "decode"} <= roles
    (store,) = snap["stores"].values()
    assert {t["tier"] for t in store["tiers"]} >= {"G2"}
    assert {c["traffic_class"] for c in store["classes"]} == {"agent", "chat"}
    table = _kvserve("status", env=env)
    assert "hit rate" in table.stdout and "prefill" in table.stdout
