"""Authentication between every pair of services, tried the way an attacker on
the same network would: real ``kvserve store|prefill|decode serve`` processes
with mTLS (the session deployment, tests/conftest.py), a real Redis.

- No credentials at all (plain text), a TLS client without a certificate, or
  a certificate from another CA: the TLS handshake refuses the connection, so
  no handler ever runs (gRPC reports UNAVAILABLE: a status cannot be sent on a
  connection that was never authenticated; docs/security.md).
- A certificate of this CA that names no kvserve identity: UNAUTHENTICATED.
- An authenticated identity calling what its role may not: PERMISSION_DENIED,
  for every (role, method) pair of the per-role table (security/methods.py):
  a kvstore certificate cannot call Prefill, the router cannot Put or Delete,
  operator-only methods (Delete, reflection, anything unlisted) refuse everyone
  else, a tenant-scoped identity of any role gets only its tenant's calls.
- Redis without the password: an authentication error (NOAUTH).
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
import redis
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from proto import kvstore_pb2, prefill_pb2
from security.config import SecurityConfig
from security.methods import may_call
from security.pki import CertAuthority, CertRequest, IssuedCert, server_name
from tests.prefill_svc.procs import Proc, engine_service, start_all, store, write_config
from tests.redis_args import redis_args

CALLS = {  # role -> (method, a valid request)
    "kvstore": ("/kvserve.v1.KVStore/Lookup",
                kvstore_pb2.LookupRequest(keys=[bytes(16)], prompt_tokens=64)),
    "prefill": ("/kvserve.v1.Prefill/Prefill",
                prefill_pb2.PrefillRequest(token_ids=list(range(1, 40)))),
    "decode": ("/kvserve.v1.Decode/Decode", None),
}


@dataclass(frozen=True, slots=True)
class Stack:
    procs: dict[str, Proc]
    redis_url: str


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, redis_server: str) -> Iterator[Stack]:
    d = tmp_path_factory.mktemp("auth-stack")
    config = write_config(d / "kvserve.toml")
    kv = store(config, redis_server, d)
    kv.start().wait_ready()
    pre = engine_service("prefill", config, redis_server, d, store_address=kv.address)
    dec = engine_service("decode", config, redis_server, d, store_address=kv.address)
    try:
        start_all(pre, dec)
        yield Stack({"kvstore": kv, "prefill": pre, "decode": dec}, redis_server)
    finally:
        for p in (dec, pre, kv):
            p.kill()


def _call(channel: grpc.Channel, role: str) -> grpc.StatusCode:
    method, req = CALLS[role]
    payload = req.SerializeToString() if req is not None else b""
    try:
        if role == "decode":
            for _ in channel.unary_stream(method)(payload, timeout=10):
                pass
        else:
            channel.unary_unary(method)(payload, timeout=10)
    except grpc.RpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


# Every method of the three engine-side servers, as (server, path, kind); payloads
# are empty, so an allowed call fails later (INVALID_ARGUMENT and the like) and
# does no work: only whether the interceptor let it through matters here.
METHODS = [("kvstore", f"/kvserve.v1.KVStore/{m}", k) for m, k in (
    ("Lookup", "uu"), ("Get", "us"), ("Put", "su"), ("Stage", "uu"), ("Stats", "uu"),
    ("Delete", "uu"))] + [
    ("prefill", "/kvserve.v1.Prefill/Prefill", "uu"),
    ("prefill", "/kvserve.v1.Prefill/PullKV", "us"),
    ("prefill", "/kvserve.v1.Prefill/Release", "uu"),
    ("decode", "/kvserve.v1.Decode/Decode", "us"),
    ("kvstore", "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo", "ss"),
]
CALLERS = [("kvstore", ""), ("prefill", ""), ("decode", ""), ("router", ""), ("engine", ""),
           ("operator", ""), ("tenant", "acme"), ("engine", "acme"), ("operator", "acme")]
REFUSALS = (grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNAUTHENTICATED,
            grpc.StatusCode.UNAVAILABLE)


def _invoke(ch: grpc.Channel, path: str, kind: str) -> grpc.StatusCode:
    try:
        if kind == "uu":
            ch.unary_unary(path)(b"", timeout=10)
        elif kind == "us":
            for _ in ch.unary_stream(path)(b"", timeout=10):
                pass
        elif kind == "su":
            ch.stream_unary(path)(iter([b""]), timeout=10)
        else:
            for _ in ch.stream_stream(path)(iter([b""]), timeout=10):
                pass
    except grpc.RpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


@pytest.mark.parametrize(("role", "tenant"), CALLERS)
def test_each_role_may_call_exactly_its_methods(stack: Stack, tls_dir: str, tmp_path: Path,
                                                role: str, tenant: str) -> None:
    ca = CertAuthority.load(Path(tls_dir) / "ca")
    ca.issue(CertRequest(role, tenant=tenant)).save(tmp_path)
    sec = SecurityConfig(str(tmp_path))
    wrong = []
    for server, path, kind in METHODS:
        with sec.sync_channel(stack.procs[server].address, server) as ch:
            code = _invoke(ch, path, kind)
        allowed = may_call(role, path, scoped=bool(tenant))
        if allowed != (code not in REFUSALS) or (not allowed and
                                                 code != grpc.StatusCode.PERMISSION_DENIED):
            wrong.append(f"{path}: {code.name} (allowed: {allowed})")
    assert wrong == [], f"{role}{'/' + tenant if tenant else ''}"


def test_the_table_says_what_the_issue_asks() -> None:
    assert not may_call("kvstore", "/kvserve.v1.Prefill/Prefill", scoped=False)
    for m in ("Put", "Delete", "Get", "Lookup"):
        assert not may_call("router", f"/kvserve.v1.KVStore/{m}", scoped=False)
    for role in ("kvstore", "prefill", "decode", "router", "engine", "tenant"):
        assert not may_call(role, "/kvserve.v1.KVStore/Delete", scoped=False)
        assert not may_call(role, "/kvserve.v1.KVStore/SomethingNew", scoped=False)
    assert may_call("operator", "/kvserve.v1.KVStore/SomethingNew", scoped=False)
    assert not may_call("operator", "/kvserve.v1.KVStore/Delete", scoped=True)


def _stranger(ca: CertAuthority | None, uris: list[str]) -> IssuedCert:
    """A client certificate with the given URI SANs, signed by ``ca`` (None: its own CA)."""
    ca = ca or CertAuthority.create("someone else's CA")
    key = ec.generate_private_key(ec.SECP256R1())
    b = (x509.CertificateBuilder()
         .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "stranger")]))
         .issuer_name(ca.cert.subject).public_key(key.public_key())
         .serial_number(x509.random_serial_number())
         .not_valid_before(ca.cert.not_valid_before_utc)
         .not_valid_after(ca.cert.not_valid_after_utc))
    if uris:
        b = b.add_extension(x509.SubjectAlternativeName(
            [x509.UniformResourceIdentifier(u) for u in uris]), critical=False)
    cert = b.sign(ca.key, hashes.SHA256())
    return IssuedCert(cert.public_bytes(serialization.Encoding.PEM),
                      key.private_bytes(serialization.Encoding.PEM,
                                        serialization.PrivateFormat.PKCS8,
                                        serialization.NoEncryption()), ca.cert_pem)


def _tls(ca_pem: bytes, client: IssuedCert | None, role: str, address: str) -> grpc.Channel:
    creds = (grpc.ssl_channel_credentials(ca_pem, client.key_pem, client.cert_pem) if client
             else grpc.ssl_channel_credentials(ca_pem))
    return grpc.secure_channel(address, creds,
                               options=[("grpc.ssl_target_name_override", server_name(role))])


@pytest.mark.parametrize("role", sorted(CALLS))
def test_callers_without_valid_credentials_are_refused(stack: Stack, tls_dir: str,
                                                       role: str) -> None:
    address = stack.procs[role].address
    ca = CertAuthority.load(Path(tls_dir) / "ca")
    with grpc.insecure_channel(address) as ch:                         # plain text
        assert _call(ch, role) == grpc.StatusCode.UNAVAILABLE
    with _tls(ca.cert_pem, None, role, address) as ch:                  # no certificate
        assert _call(ch, role) == grpc.StatusCode.UNAVAILABLE
    foreign = _stranger(None, ["urn:kvserve:role:operator"])           # another CA
    with _tls(ca.cert_pem, foreign, role, address) as ch:
        assert _call(ch, role) == grpc.StatusCode.UNAVAILABLE
    nobody = _stranger(ca, [])                                         # our CA, no identity
    with _tls(ca.cert_pem, nobody, role, address) as ch:
        assert _call(ch, role) == grpc.StatusCode.UNAUTHENTICATED
    bogus = _stranger(ca, ["urn:kvserve:role:superuser"])              # our CA, no such role
    with _tls(ca.cert_pem, bogus, role, address) as ch:
        assert _call(ch, role) == grpc.StatusCode.UNAUTHENTICATED


@pytest.mark.parametrize("role", ("prefill", "decode"))
def test_a_tenant_identity_may_not_drive_the_engines(stack: Stack, tls_dir: str,
                                                     tmp_path: Path, role: str) -> None:
    ca = CertAuthority.load(Path(tls_dir) / "ca")
    ca.issue(CertRequest("tenant", tenant="acme")).save(tmp_path)
    with SecurityConfig(str(tmp_path)).sync_channel(stack.procs[role].address, role) as ch:
        assert _call(ch, role) == grpc.StatusCode.PERMISSION_DENIED
    # ... while a service identity gets through authentication to the handler.
    with SecurityConfig(tls_dir, role="router").sync_channel(stack.procs[role].address,
                                                             role) as ch:
        assert _call(ch, role) not in (grpc.StatusCode.UNAUTHENTICATED,
                                       grpc.StatusCode.PERMISSION_DENIED,
                                       grpc.StatusCode.UNAVAILABLE)


def test_a_server_cannot_pose_as_another_role(stack: Stack, tls_dir: str) -> None:
    """Clients verify the role name in the server's certificate: the prefill
    server's certificate does not pass for a kvstore."""
    sec = SecurityConfig(tls_dir, role="decode")
    with sec.sync_channel(stack.procs["prefill"].address, "kvstore") as ch:
        assert _call(ch, "kvstore") == grpc.StatusCode.UNAVAILABLE


def test_redis_refuses_clients_without_the_password(stack: Stack) -> None:
    url = redis.connection.parse_url(stack.redis_url)
    bare = redis.Redis(host=url["host"], port=url["port"], protocol=2)
    with pytest.raises(redis.AuthenticationError, match=r"(?i)noauth|authentication"):
        bare.get("Bsomething")
    wrong = redis.Redis(host=url["host"], port=url["port"], password="guess", protocol=2)
    with pytest.raises(redis.AuthenticationError):
        wrong.ping()
    assert redis.Redis.from_url(stack.redis_url).ping()


def test_serve_refuses_plain_text_unless_told_insecure(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch,
                                                      redis_server: str) -> None:
    monkeypatch.delenv("KVSERVE_TLS_DIR")
    out = subprocess.run([sys.executable, "-m", "kvserve.cli", "store", "serve", "--port", "0",
                          *redis_args(redis_server)], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode != 0 and "--insecure" in out.stderr
    p = subprocess.Popen([sys.executable, "-m", "kvserve.cli", "store", "serve", "--port", "0",
                          "--metrics-port", "-1", *redis_args(redis_server), "--insecure",
                          "--grace", "0"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True)
    try:
        assert p.stdout is not None and p.stdout.readline().startswith("kvstore ready")
    finally:
        p.terminate()
        _, err = p.communicate(timeout=30)
    assert "PLAIN TEXT with no authentication (--insecure)" in err
