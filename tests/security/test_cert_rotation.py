"""Short-lived certificates: they expire as configured, an expired one is refused
in the TLS handshake of a real kvstore server (and by the process that would
present it), and ``kvserve certs rotate`` produces working new ones that a
running server takes on its next handshake (security/certfiles.py)."""

from __future__ import annotations

import asyncio
import datetime as dt
import socket
import ssl
from pathlib import Path

import grpc
import pytest
from cryptography import x509

from kvserve.cli import main
from kvstore.client import KVStoreClient
from kvstore.errors import KVStoreError
from kvstore.service import start_server
from kvstore.warehouse import Warehouse
from security.config import SecurityConfig, SecurityError
from security.pki import (
    DEFAULT_DAYS,
    MAX_DAYS,
    TLS_CERT,
    CertAuthority,
    CertRequest,
    PKIError,
    ensure_deployment,
)
from tests.kvstore.storeproc import wh_config


def not_after(d: Path) -> dt.datetime:
    return x509.load_pem_x509_certificate((d / TLS_CERT).read_bytes()).not_valid_after_utc


def serial(d: Path) -> int:
    return x509.load_pem_x509_certificate((d / TLS_CERT).read_bytes()).serial_number


def presented_serial(port: int, client: Path) -> int:
    """The serial of the certificate the server presents on a new connection."""
    ctx = ssl.create_default_context(cafile=str(client / "ca.crt"))
    ctx.check_hostname = False
    ctx.load_cert_chain(client / "tls.crt", client / "tls.key")
    ctx.set_alpn_protocols(["h2"])
    with socket.create_connection(("127.0.0.1", port), timeout=10) as raw, \
            ctx.wrap_socket(raw) as tls:
        der = tls.getpeercert(binary_form=True)
    assert der is not None
    return x509.load_der_x509_certificate(der).serial_number


def test_certificates_expire_as_configured(tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    root = ensure_deployment(tmp_path / "dep")
    now = dt.datetime.now(dt.UTC)
    for role in ("kvstore", "prefill", "decode", "router", "engine", "operator"):
        left = not_after(root / role) - now
        assert dt.timedelta(days=DEFAULT_DAYS - 1) < left <= dt.timedelta(days=DEFAULT_DAYS)
    assert main(["certs", "issue", str(root), "--role", "tenant", "--tenant", "acme",
                 "--days", "3"]) == 0
    left = not_after(root / "tenant-acme") - now
    assert dt.timedelta(days=2, hours=23) < left <= dt.timedelta(days=3)
    assert "valid 3 days" in capsys.readouterr().out
    with pytest.raises(PKIError, match="days must be in"):
        CertRequest("kvstore", days=MAX_DAYS + 1)
    assert main(["certs", "issue", str(root), "--role", "kvstore", "--days", "825"]) == 2


def test_an_expired_certificate_is_refused(redis_url: str, tmp_path: Path) -> None:
    root = ensure_deployment(tmp_path / "dep")
    ca = CertAuthority.load(root / "ca")
    expired = ca.issue(CertRequest("operator", days=1),
                       now=dt.datetime.now(dt.UTC) - dt.timedelta(days=3))
    expired.save(tmp_path / "old")
    # The process that would present it refuses to start, and says what to do.
    with pytest.raises(SecurityError, match=r"expired on .*kvserve certs rotate"):
        SecurityConfig(str(tmp_path / "old"))

    async def body() -> None:
        wh = await Warehouse(wh_config(redis_url)).start()
        srv = await start_server(wh, security=SecurityConfig(str(root), role="kvstore"))
        try:
            address = f"127.0.0.1:{srv.port}"
            async with KVStoreClient(address, use_shm=False,
                                     security=SecurityConfig(str(root), role="operator")) as ok:
                assert (await ok.stats()).node
            # Presented anyway (bypassing SecurityConfig): the handshake refuses it.
            creds = grpc.ssl_channel_credentials(expired.ca_pem, expired.key_pem,
                                                 expired.cert_pem)
            async with grpc.aio.secure_channel(address, creds, options=[
                    ("grpc.ssl_target_name_override", "kvstore.kvserve.internal")]) as ch:
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await ch.unary_unary("/kvserve.v1.KVStore/Stats")(b"", timeout=10)
                assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        finally:
            await srv.server.stop(0)
            await wh.close()

    asyncio.run(body())


def test_rotate_makes_working_certificates_that_a_running_server_takes(
        redis_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = ensure_deployment(tmp_path / "dep")
    before = {role: serial(root / role) for role in ("kvstore", "operator", "prefill")}
    key_before = (root / "operator" / "tls.key").read_bytes()
    ca_key = (root / "ca" / "ca.key").read_bytes()

    async def body() -> None:
        wh = await Warehouse(wh_config(redis_url)).start()
        srv = await start_server(wh, security=SecurityConfig(str(root), role="kvstore"))
        try:
            address = f"127.0.0.1:{srv.port}"
            assert presented_serial(srv.port, root / "operator") == before["kvstore"]
            assert await asyncio.to_thread(main, ["certs", "rotate", str(root), "--days", "2"]) == 0
            out = capsys.readouterr().out
            assert "kvstore" in out and "operator" in out and "new key" in out
            for role in before:                      # every identity: new serial, new key
                assert serial(root / role) != before[role]
                left = not_after(root / role) - dt.datetime.now(dt.UTC)
                assert dt.timedelta(days=1, hours=23) < left <= dt.timedelta(days=2)
            assert (root / "operator" / "tls.key").read_bytes() != key_before
            assert (root / "ca" / "ca.key").read_bytes() == ca_key       # the CA stays
            # The running server presents its new certificate from the next handshake ...
            assert presented_serial(srv.port, root / "operator") == serial(root / "kvstore")
            # ... and the new operator certificate works against it.
            async with KVStoreClient(address, use_shm=False,
                                     security=SecurityConfig(str(root), role="operator")) as c:
                assert (await c.stats()).node
            # A tenant identity issued afterwards from the same CA works too.
            assert await asyncio.to_thread(main, ["certs", "issue", str(root), "--role",
                                                  "tenant", "--tenant", "acme"]) == 0
            async with KVStoreClient(address, use_shm=False,
                                     security=SecurityConfig(str(root / "tenant-acme"))) as t:
                with pytest.raises(KVStoreError, match="may not call"):
                    await t.stats()                  # authenticated; Stats is not a tenant's
        finally:
            await srv.server.stop(0)
            await wh.close()

    asyncio.run(body())
    assert main(["certs", "rotate", str(root), "--only", "nosuch"]) == 2
