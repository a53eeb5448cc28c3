"""A new user's first run, each rough edge of issue 12 reproduced and checked:
a taken port fails fast with its name; ``router serve`` answers SIGINT and
SIGTERM; a second ``up`` names the running one; kill -9 of the launcher
leaves no child (Redis included) behind; ``up --port`` and
``--api-key-file``; every metrics endpoint is printed and served; cached
tokens add up (engine G1 + warehouse = the API's); ``store reindex`` /
``store whatif`` find the running stack; a closed stdout ends quietly. (Blocks
per class after a restart: tests/kvstore/test_warehouse.py.) Real processes,
sockets and Redis throughout."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from kvstore.redis_server import free_port
from tests.redis_args import redis_args

CLI = [sys.executable, "-m", "kvserve.cli"]


def _env(tmp_path: Path) -> dict[str, str]:
    env = {**os.environ, "KVSERVE_STATE": str(tmp_path / "up.json"),
           "KVSERVE_CACHE": str(tmp_path / "cache")}
    env.pop("REDIS_URL", None)
    # As a new user: no credentials in the environment; `up` makes the stack's
    # own and the other commands find them through its state file.
    env.pop("KVSERVE_TLS_DIR", None)
    return env


def _kvserve(*args: str, env: dict[str, str],
             timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, *args], env=env, text=True, capture_output=True,
                          timeout=timeout)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as fh:           # a zombie is as good as gone
        return fh.read().rsplit(")", 1)[1].split()[0] != "Z"


def _children_of(pid: int) -> set[int]:
    out: set[int] = set()
    for task in Path(f"/proc/{pid}/task").iterdir():
        out |= {int(c) for c in (task / "children").read_text().split()}
    return out


@pytest.fixture()
def taken_port() -> Iterator[int]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


def test_up_on_a_taken_http_port_fails_fast_naming_it(tmp_path: Path, taken_port: int) -> None:
    t0 = time.monotonic()
    res = _kvserve("up", "--model", "tiny-dense", "--free-ports", "--port", str(taken_port),
                   "--g3-path", "none", env=_env(tmp_path), timeout=60)
    assert res.returncode == 2, res.stderr
    assert f"HTTP port {taken_port} (Address already in use)" in res.stderr
    assert "Traceback" not in res.stderr and time.monotonic() - t0 < 30
    assert not (tmp_path / "up.json").exists()


def test_router_serve_on_a_taken_port_exits_and_signals_stop_it(redis_url: str,
                                                                taken_port: int) -> None:
    base = [*CLI, "router", "serve", "--model", "tiny-dense", *redis_args(redis_url),
            "--host", "127.0.0.1", "--port", "0"]
    # The three processes start together: most of each start is imports, which
    # overlap, and each one's checks concern only itself.
    taken = subprocess.Popen([*base, "--http-port", str(taken_port)], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    procs = {sig: subprocess.Popen([*base, "--http-port", "0"], stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE, text=True)
             for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        for sig, proc in procs.items():
            assert proc.stdout is not None and proc.stderr is not None
            line = proc.stdout.readline()
            assert line.startswith("KVSERVE_READY"), line + proc.stderr.read()
            proc.send_signal(sig)
            assert proc.wait(timeout=20) == 0
        _, err = taken.communicate(timeout=60)
        assert taken.returncode == 2, err
        assert f"cannot serve HTTP on 127.0.0.1:{taken_port}" in err
        assert "Traceback" not in err
    finally:
        for proc in [taken, *procs.values()]:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def test_a_closed_stdout_ends_quietly(tmp_path: Path) -> None:
    cfg = tmp_path / "ok.toml"
    cfg.write_text("[blocks]\nblock_tokens = 16\n")
    for args in (["--help"], ["config", "check", str(cfg), "--json"]):
        proc = subprocess.Popen([*CLI, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        assert proc.stdout is not None and proc.stderr is not None
        proc.stdout.close()                       # the reader of `| head` is gone
        err = proc.stderr.read().decode()
        proc.wait(timeout=60)
        assert "Traceback" not in err and "BrokenPipe" not in err, (args, err)
        assert proc.returncode in (0, 141)


def _start_up(env: dict[str, str], *args: str) -> tuple[subprocess.Popen[str], str]:
    small = Path(env["KVSERVE_STATE"]).with_name("small.toml")
    small.write_text('[tiers]\ng2_bytes = "64MiB"\n')       # a shared CI machine's memory
    up = subprocess.Popen([*CLI, "up", "--model", "tiny-dense", "--free-ports", "--grace", "5",
                           "--config", str(small), *args], env=env, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    lines = []
    deadline = time.monotonic() + 150
    assert up.stdout is not None and up.stderr is not None
    while time.monotonic() < deadline:
        line = up.stdout.readline()
        if not line:
            break
        lines.append(line)
        if line.startswith("  try:"):
            break
    banner = "".join(lines)
    assert "kvserve up: running" in banner, banner + (up.stderr.read() if up.poll() else "")
    return up, banner


def _metric(url: str, name: str, **labels: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(url, timeout=10).read().decode()
    return sum(s.value for fam in text_string_to_metric_families(text) for s in fam.samples
               if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


def _http(url: str, key: str = "") -> int:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {key}"} if key else {})
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return int(resp.status)
    except urllib.error.HTTPError as exc:
        return exc.code


def test_up_second_up_metrics_keys_counters_and_kill9(tmp_path: Path) -> None:
    env = _env(tmp_path)
    keys = tmp_path / "keys.txt"
    keys.write_text("first-run-key-123 acme\n")
    keys.chmod(0o600)                       # a key file readable by others is refused
    http_port = free_port()
    g3 = tmp_path / "g3"
    up, banner = _start_up(env, "--port", str(http_port), "--api-key-file", str(keys),
                           "--g3-path", str(g3))
    pool = ThreadPoolExecutor(2)
    try:
        state = json.loads((tmp_path / "up.json").read_text())
        # up --port; --api-key-file reached the router.
        assert state["router_http"] == f"http://127.0.0.1:{http_port}"
        models = f"{state['router_http']}/v1/models"
        assert _http(models) == 401 and _http(models, "first-run-key-123") == 200
        # Every metrics endpoint is printed and answers.
        assert set(state["metrics"]) == {"kvstore", "prefill", "decode", "router"}
        for role, url in state["metrics"].items():
            assert f"  metrics   {role:<9} {url}" in banner
            assert urllib.request.urlopen(url, timeout=10).status == 200

        # The CLI calls below run two at a time where neither depends on the other:
        # each is mostly a Python start (imports), one core each.
        # A second up on the same state refuses and names the running one.
        later = pool.submit(_kvserve, "up", "--model", "tiny-dense", "--free-ports", env=env,
                            timeout=60)

        # Cached tokens add up: engine G1 + warehouse = what the API reported.
        question = "Tell me about the warehouse tiers: G2, G3 and G4, and when each helps. " * 2
        for _ in range(2):
            chat = _kvserve("chat", "--prompt", question, "--max-tokens", "4", "--stats",
                            "--traffic-class", "agent",      # the key never in argv
                            env={**env, "KVSERVE_API_KEY": "first-run-key-123"})
            assert chat.returncode == 0, chat.stderr
        again = later.result()
        assert again.returncode == 2
        assert f"already running: pid {up.pid}" in again.stderr and "--state-dir" in again.stderr
        later = pool.submit(_kvserve, "status", env=env)
        snap = json.loads(_kvserve("status", "--json", env=env).stdout)
        c = snap["cached"]
        assert c["api_cached_tokens"] > 0
        assert c["engine_g1_tokens"] + c["warehouse_tokens"] == c["prefill_cached_tokens"]
        # The repeat is a short tail computed on decode from its own G1 (no prefill).
        assert c["prefill_cached_tokens"] + c["decode_g1_tokens"] == c["api_cached_tokens"]
        assert _metric(state["metrics"]["router"], "kvserve_router_tokens_total",
                       kind="cached") == c["api_cached_tokens"]
        assert "cached tokens since start: engine G1" in later.result().stdout

        # store reindex and store whatif find the running stack by themselves.
        later = pool.submit(_kvserve, "store", "whatif", "--ttl", "1h", "--capacity", "inf",
                            env=env)
        reindex = _kvserve("store", "reindex", "--json", env=env)
        assert reindex.returncode == 0, reindex.stderr
        assert json.loads(reindex.stdout)["blocks"].get("G3", 0) > 0
        whatif = later.result()
        assert whatif.returncode == 0, whatif.stderr
        assert "bytes at 1,024 KV bytes/token (tiny-dense, float32)" in whatif.stdout

        # kill -9 of the launcher: every child (Redis too) goes with it.
        kids = _children_of(up.pid)
        assert len(kids) == 5, kids              # redis, kvstore, prefill, decode, router
        up.kill()
        up.wait()
        deadline = time.monotonic() + 90        # each drains (grace 10 s) on a loaded machine
        while any(_alive(p) for p in kids) and time.monotonic() < deadline:
            time.sleep(0.2)
        left = {p: Path(f"/proc/{p}/cmdline").read_bytes()[:120] for p in kids if _alive(p)}
        assert not left, f"children outlived the launcher: {left}"
    finally:
        pool.shutdown(cancel_futures=True)
        if up.poll() is None:
            up.kill()
            up.wait()

