"""A deployment's certificate authority and the certificates it issues.

One CA per deployment (``kvserve up`` makes one under its state dir, ``kvserve
certs`` makes one for a real deployment). Every certificate names who holds it
in URI SANs, which is what servers read (``security.identity``)::

    urn:kvserve:role:<role>         kvstore | prefill | decode | router | operator | tenant
    urn:kvserve:tenant:<tenant>     optional: the one tenant this holder may act for

Server certificates also carry ``<role>.kvserve.internal`` as a DNS name;
clients verify that name (``grpc.ssl_target_name_override``) whatever address
they dial, so a decode certificate cannot pose as a kvstore server. Files use
cert-manager's names (``ca.crt``, ``tls.crt``, ``tls.key``); keys are 0600.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
import secrets
import socket
from dataclasses import dataclass, field
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from security.identity import ROLES, SERVICE_ROLES, role_uri, tenant_uri, validate_identity

CA_CERT = "ca.crt"
CA_KEY = "ca.key"
TLS_CERT = "tls.crt"
TLS_KEY = "tls.key"
INTERNAL_DOMAIN = "kvserve.internal"
DEFAULT_DAYS = 825
SECRET_FILE = "secret"     # the deployment secret (security.config reads it)


class PKIError(ValueError):
    """Bad certificate request or unusable certificate files."""


def server_name(role: str) -> str:
    """The DNS name a client verifies on a server of ``role``."""
    return f"{role}.{INTERNAL_DOMAIN}"


def _now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


def _write(path: Path, data: bytes, mode: int) -> None:
    # Created with the final mode (no window where a key is world-readable).
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.chmod(path, mode)


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


@dataclass(frozen=True, slots=True)
class CertRequest:
    """What to put in one leaf certificate."""

    role: str
    name: str = ""                  # common name; defaults to the role
    tenant: str = ""                # scope: the one tenant the holder may act for
    hosts: tuple[str, ...] = ()     # extra DNS names / IPs (servers)
    days: int = DEFAULT_DAYS

    def __post_init__(self) -> None:
        validate_identity(self.role, self.tenant)
        if self.days < 1:
            raise PKIError(f"days must be >= 1, got {self.days}")

    @property
    def is_server(self) -> bool:
        return self.role in SERVICE_ROLES


@dataclass(frozen=True, slots=True)
class CertAuthority:
    """A loaded CA: its certificate and private key."""

    cert: x509.Certificate
    key: ec.EllipticCurvePrivateKey

    @classmethod
    def create(cls, name: str = "kvserve deployment CA", days: int = 3650) -> CertAuthority:
        key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        cert = (x509.CertificateBuilder().subject_name(subject).issuer_name(subject)
                .public_key(key.public_key()).serial_number(x509.random_serial_number())
                .not_valid_before(_now() - dt.timedelta(minutes=5))
                .not_valid_after(_now() + dt.timedelta(days=days))
                .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
                .add_extension(x509.KeyUsage(False, False, False, False, False, True, True,
                                             False, False), critical=True)
                .sign(key, hashes.SHA256()))
        return cls(cert, key)

    @classmethod
    def load(cls, directory: str | Path) -> CertAuthority:
        d = Path(directory)
        try:
            cert = x509.load_pem_x509_certificate((d / CA_CERT).read_bytes())
            key = serialization.load_pem_private_key((d / CA_KEY).read_bytes(), None)
        except (OSError, ValueError) as exc:
            raise PKIError(f"cannot load the CA from {d}: {exc}") from None
        if not isinstance(key, ec.EllipticCurvePrivateKey):
            raise PKIError(f"{d / CA_KEY} is not an EC private key")
        return cls(cert, key)

    @property
    def cert_pem(self) -> bytes:
        return self.cert.public_bytes(serialization.Encoding.PEM)

    def save(self, directory: str | Path) -> None:
        d = Path(directory)
        _write(d / CA_CERT, self.cert_pem, 0o600)
        _write(d / CA_KEY, _key_pem(self.key), 0o600)

    def issue(self, req: CertRequest) -> IssuedCert:
        key = ec.generate_private_key(ec.SECP256R1())
        cn = req.name or (f"{req.role}:{req.tenant}" if req.tenant else req.role)
        sans: list[x509.GeneralName] = [x509.UniformResourceIdentifier(role_uri(req.role))]
        if req.tenant:
            sans.append(x509.UniformResourceIdentifier(tenant_uri(req.tenant)))
        usages = [ExtendedKeyUsageOID.CLIENT_AUTH]
        if req.is_server:
            usages.append(ExtendedKeyUsageOID.SERVER_AUTH)
            hosts = [server_name(req.role), "localhost", "127.0.0.1", "::1",
                     socket.gethostname(), *req.hosts]
            sans.extend(_host_name(h) for h in dict.fromkeys(hosts) if h)
        cert = (x509.CertificateBuilder()
                .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn[:64]),
                                         x509.NameAttribute(NameOID.ORGANIZATIONAL_UNIT_NAME,
                                                            req.role)]))
                .issuer_name(self.cert.subject).public_key(key.public_key())
                .serial_number(x509.random_serial_number())
                .not_valid_before(_now() - dt.timedelta(minutes=5))
                .not_valid_after(_now() + dt.timedelta(days=req.days))
                .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
                .add_extension(x509.SubjectAlternativeName(sans), critical=False)
                .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
                .sign(self.key, hashes.SHA256()))
        return IssuedCert(cert.public_bytes(serialization.Encoding.PEM), _key_pem(key),
                          self.cert_pem)


def _host_name(host: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(host))
    except ValueError:
        return x509.DNSName(host)


@dataclass(frozen=True, slots=True)
class IssuedCert:
    """PEM bytes of one leaf, its key and the CA that signed it."""

    cert_pem: bytes
    key_pem: bytes
    ca_pem: bytes = field(repr=False)

    def save(self, directory: str | Path) -> Path:
        """Writes tls.crt, tls.key (0600) and ca.crt: a cert-manager Secret's layout."""
        d = Path(directory)
        _write(d / TLS_CERT, self.cert_pem, 0o600)
        _write(d / TLS_KEY, self.key_pem, 0o600)
        _write(d / CA_CERT, self.ca_pem, 0o600)
        return d


def ensure_deployment(directory: str | Path, *,
                      identities: tuple[CertRequest, ...] = ()) -> Path:
    """A deployment secret ``directory/secret`` and a CA under ``directory/ca``
    (each created once) and one certificate directory
    per identity (``directory/<role>`` or ``directory/<role>-<tenant>``), made
    only where missing. Returns ``directory``. Used by ``kvserve up``."""
    root = Path(directory)
    if not (root / SECRET_FILE).exists():
        _write(root / SECRET_FILE, secrets.token_hex(32).encode() + b"\n", 0o600)
    ca_dir = root / "ca"
    if (ca_dir / CA_KEY).exists():
        ca = CertAuthority.load(ca_dir)
    else:
        ca = CertAuthority.create()
        ca.save(ca_dir)
    wanted = identities or tuple(CertRequest(r) for r in ROLES if r != "tenant")
    for req in wanted:
        d = root / identity_dir_name(req.role, req.tenant)
        if not (d / TLS_KEY).exists():
            ca.issue(req).save(d)
    return root


def identity_dir_name(role: str, tenant: str = "") -> str:
    return f"{role}-{tenant}" if tenant else role


__all__ = ["CA_CERT", "CA_KEY", "TLS_CERT", "TLS_KEY", "CertAuthority", "CertRequest",
           "IssuedCert", "PKIError", "ensure_deployment", "identity_dir_name", "server_name"]
