"""After a real ``kvserve up`` (its own embedded Redis, real processes), grep
everything a local user or a tenant could see for the stack's secrets: every
Redis password, the deployment secret and the private keys must appear in no
``/proc/<pid>/cmdline``, no child's ``/proc/<pid>/environ``, no log, the
banner, the state and config files, ``kvserve status`` / ``chat`` output or
gRPC error text. Each child holds only its own credentials (no ``ca.key``, no
other role's key, its own Redis user), every file the stack made is private,
and the children's certificates are short-lived. Then Ctrl-C stops the stack
cleanly. The stack is the package's (tests/kvserve/up_stack.py), shared with
test_up.py; this file's last test stops it."""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import os
import stat
import subprocess
import sys
from pathlib import Path
from urllib.parse import unquote, urlsplit

import grpc
import pytest
import redis
from cryptography import x509

from proto import common_pb2, kvstore_pb2, router_pb2, router_pb2_grpc
from security.config import SecurityConfig
from security.pki import CertAuthority, CertRequest
from tests.kvserve.test_up import healthy
from tests.kvserve.up_stack import CREDENTIAL_VARS, UpStack

CHILD_FILES = {"tls.crt", "tls.key", "ca.crt", "secret", "redis.url"}


def _kvserve(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvserve.cli", *args], env=env, text=True,
                          capture_output=True, timeout=120)


def _proc_bytes(pid: int, what: str) -> bytes:
    try:
        return Path(f"/proc/{pid}/{what}").read_bytes()
    except OSError:
        return b""


def _open_files(pid: int) -> list[str]:
    out = []
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        with contextlib.suppress(OSError):      # closed between listing and reading
            out.append(os.readlink(fd))
    return out


def _children(pid: int) -> list[int]:
    """Every descendant of ``pid`` (the services and the embedded Redis)."""
    out: list[int] = []
    todo = [pid]
    while todo:
        p = todo.pop()
        for task in Path(f"/proc/{p}/task").glob("*"):
            kids = [int(k) for k in _proc_bytes(p, f"task/{task.name}/children").split()]
            out += kids
            todo += kids
    return out


def _grpc_errors(state: dict[str, str], tls: Path, tmp: Path) -> list[str]:
    """Error texts a tenant and an operator can provoke from the services."""
    ca = CertAuthority.load(tls / "ca")
    ca.issue(CertRequest("tenant", tenant="bob")).save(tmp / "bob")
    bob = SecurityConfig(str(tmp / "bob"))
    texts: list[str] = []
    calls = [(state["store"], "kvstore", "/kvserve.v1.KVStore/Delete", b""),
             (state["store"], "kvstore", "/kvserve.v1.KVStore/Lookup", b"\xff\x00garbage"),
             (state["store"], "kvstore", "/kvserve.v1.KVStore/Lookup",
              kvstore_pb2.LookupRequest(keys=[b"x"], ctx=common_pb2.RequestContext(
                  tenant="alice")).SerializeToString()),
             (state["store"], "kvstore", "/kvserve.v1.KVStore/Stats", b""),
             (state["prefill"], "prefill", "/kvserve.v1.Prefill/Prefill", b"")]
    for address, role, path, payload in calls:
        with bob.sync_channel(address, role) as ch:
            try:
                ch.unary_unary(path)(payload, timeout=10)
            except grpc.RpcError as exc:
                texts.append(f"{exc.code().name}: {exc.details()}")
    with bob.sync_channel(state["router_grpc"], "router") as ch:
        req = router_pb2.GenerateRequest(ctx=common_pb2.RequestContext(tenant="alice"),
                                         prompt="hello")
        try:
            list(router_pb2_grpc.RouterStub(ch).Generate(req, timeout=30))
        except grpc.RpcError as exc:
            texts.append(f"{exc.code().name}: {exc.details()}")
    return texts


def test_up_shows_no_secret_and_hands_each_child_only_its_own(up_stack: UpStack) -> None:
    stack = up_stack.running()
    up, banner, env, tmp_path = stack.proc, stack.banner, stack.env, stack.tmp
    assert up is not None
    state = json.loads((tmp_path / "up.json").read_text())
    run_dir = Path(state["config"]).parent
    tls = Path(state["tls_dir"])
    creds = run_dir / "creds"

    # -- the secrets, as the files that hold them say -------------------------------
    secrets: dict[str, str] = {"deployment secret": (tls / "secret").read_text().strip()}
    for url_file in creds.glob("*/redis.url"):
        parts = urlsplit(url_file.read_text().strip())
        role = url_file.parent.name
        assert parts.username == role                     # its own ACL user
        secrets[f"{role} Redis password"] = unquote(parts.password or "")
    for key in [*creds.glob("*/tls.key"), tls / "ca" / "ca.key"]:
        body = "".join(key.read_text().splitlines()[1:-1])
        secrets[f"{key.parent.name}/{key.name}"] = body[10:50]
    assert {f"{r} Redis password" for r in ("kvstore", "prefill", "decode", "router",
                                             "operator")} <= set(secrets)
    assert all(len(v) >= 16 for v in secrets.values())

    def leaks(where: str, text: str | bytes) -> list[str]:
        raw = text.encode() if isinstance(text, str) else text
        return [f"{name} in {where}" for name, v in secrets.items() if v.encode() in raw]

    found: list[str] = []
    # -- processes: argv of all, environment of the children ------------------------
    kids = _children(up.pid)
    assert len(kids) >= 5                                  # redis, store, p, d, router
    for pid in [up.pid, *kids]:
        found += leaks(f"/proc/{pid}/cmdline", _proc_bytes(pid, "cmdline"))
    services = {}
    for pid in kids:
        argv = _proc_bytes(pid, "cmdline").split(b"\0")
        environ = _proc_bytes(pid, "environ")
        found += leaks(f"/proc/{pid}/environ", environ)
        names = {e.split(b"=", 1)[0].decode() for e in environ.split(b"\0") if b"=" in e}
        assert not names & set(CREDENTIAL_VARS), (pid, names & set(CREDENTIAL_VARS))
        if b"serve" in argv:
            role = argv[argv.index(b"serve") - 1].decode()
            role = "kvstore" if role == "store" else role
            services[role] = [a.decode() for a in argv]
            # No child is pointed at the deployment directory (CA key, other roles).
            assert not any(str(tls) in a for a in services[role]), services[role]
            assert services[role][services[role].index("--tls-dir") + 1] == \
                str(creds / role)
            assert not [f for f in _open_files(pid) if f.endswith("ca.key") or str(tls) in f]
    assert set(services) == {"kvstore", "prefill", "decode", "router"}

    # -- what each child holds -------------------------------------------------------
    now = dt.datetime.now(dt.UTC)
    for role in services:
        d = creds / role
        assert {p.name for p in d.iterdir()} == CHILD_FILES, role
        cert = x509.load_pem_x509_certificate((d / "tls.crt").read_bytes())
        uris = cert.extensions.get_extension_for_class(
            x509.SubjectAlternativeName).value.get_values_for_type(
                x509.UniformResourceIdentifier)
        assert uris == [f"urn:kvserve:role:{role}"]
        assert cert.not_valid_after_utc - now <= dt.timedelta(days=7)
    assert not list(creds.rglob("ca.key"))
    # A child's Redis user cannot do another role's work.
    prefill = redis.Redis.from_url((creds / "prefill" / "redis.url").read_text().strip())
    with pytest.raises(redis.exceptions.NoPermissionError):
        prefill.set(b"B" + bytes(16), b"forged")
    with pytest.raises(redis.exceptions.NoPermissionError):
        prefill.flushall()
    prefill.close()

    # -- everything a user or operator sees ------------------------------------------
    status = _kvserve("status", env=env)
    status_json = _kvserve("status", "--json", env=env)
    chat = _kvserve("chat", "--prompt", "Hello, warehouse!", "--max-tokens", "3", env=env)
    assert status.returncode == status_json.returncode == chat.returncode == 0, \
        status.stderr + status_json.stderr + chat.stderr
    assert "***" in status.stdout and "redis://operator:***@" in banner
    errors = _grpc_errors(state, tls, tmp_path)
    assert any(e.startswith("PERMISSION_DENIED") for e in errors)
    assert any(e.startswith("INVALID_ARGUMENT") for e in errors), errors
    for where, text in (("banner", banner), ("status", status.stdout + status.stderr),
                        ("status --json", status_json.stdout), ("chat", chat.stdout +
                                                                 chat.stderr),
                        ("gRPC errors", "\n".join(errors)),
                        ("state file", (tmp_path / "up.json").read_text()),
                        ("config file", Path(state["config"]).read_text())):
        found += leaks(where, text)
    for log in run_dir.glob("*.log"):
        found += leaks(str(log), log.read_bytes())
    assert found == []

    # -- every file the stack made is private ------------------------------------------
    loose = [f"{p} {stat.S_IMODE(p.stat().st_mode):o}" for p in
             [*run_dir.rglob("*"), *tls.rglob("*"), tmp_path / "up.json"]
             if p.is_file() and p.stat().st_mode & 0o077]
    loose += [f"{p} {stat.S_IMODE(p.stat().st_mode):o}" for p in
              [run_dir, creds, *creds.iterdir()] if p.stat().st_mode & 0o077]
    assert loose == []


def test_ctrl_c_stops_the_stack_cleanly(up_stack: UpStack) -> None:
    state = up_stack.running().state
    tls_dir, tmp_path = state["tls_dir"], up_stack.tmp
    code, out, err = up_stack.interrupt()
    assert code == 0, err
    assert "kvserve up: stopped" in out
    assert not (tmp_path / "up.json").exists()
    for role in ("prefill", "decode", "store"):
        assert not healthy(state[role], tls_dir), role
