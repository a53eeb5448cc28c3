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

Leaf certificates are short-lived (``DEFAULT_DAYS``): ``rotate_deployment``
(``kvserve certs rotate``) re-issues every identity of a deployment directory
with the same names and a fresh key, in place; servers pick the new files up
on their next handshake (security.certfiles). Only the CA lives for years, and
its key stays with ``kvserve certs`` / the operator: ``kvserve up`` hands each
child a directory with its own certificate, key and ``ca.crt`` alone.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import secrets
import socket
from dataclasses import dataclass, field
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from security.identity import (
    ROLES,
    SERVICE_ROLES,
    identity_from_uris,
    role_uri,
    tenant_uri,
    validate_identity,
)
from security.secret_files import write_private

CA_CERT = "ca.crt"
CA_KEY = "ca.key"
TLS_CERT = "tls.crt"
TLS_KEY = "tls.key"
INTERNAL_DOMAIN = "kvserve.internal"
DEFAULT_DAYS = 14               # leaf certificates: rotate weekly (docs/security.md)
MAX_DAYS = 397                  # the CA/Browser Forum's ceiling; never 825 again
CA_DAYS = 3650
SECRET_FILE = "secret"     # the deployment secret (security.config reads it)


class PKIError(ValueError):
    """Bad certificate request or unusable certificate files."""


def server_name(role: str) -> str:
    """The DNS name a client verifies on a server of ``role``."""
    return f"{role}.{INTERNAL_DOMAIN}"


def _now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


def _write(path: Path, data: bytes, mode: int) -> None:
    # Created with the final mode (no window where a key is world-readable) and
    # renamed into place (a reader sees the old file or the new, never half).
    write_private(path, data, mode=mode)


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
        if not 1 <= self.days <= MAX_DAYS:
            raise PKIError(f"days must be in 1..{MAX_DAYS}, got {self.days} (leaf certificates "
                           "are short-lived; rotate them with `kvserve certs rotate`)")

    @property
    def is_server(self) -> bool:
        return self.role in SERVICE_ROLES


@dataclass(frozen=True, slots=True)
class CertAuthority:
    """A loaded CA: its certificate and private key."""

    cert: x509.Certificate
    key: ec.EllipticCurvePrivateKey

    @classmethod
    def create(cls, name: str = "kvserve deployment CA", days: int = CA_DAYS) -> CertAuthority:
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

    def issue(self, req: CertRequest, *, now: dt.datetime | None = None) -> IssuedCert:
        """A leaf valid from ``now`` (default: the clock) for ``req.days``."""
        now = now or _now()
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
                .not_valid_before(now - dt.timedelta(minutes=5))
                .not_valid_after(now + dt.timedelta(days=req.days))
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
        _write(d / CA_CERT, self.ca_pem, 0o600)
        _write(d / TLS_KEY, self.key_pem, 0o600)
        _write(d / TLS_CERT, self.cert_pem, 0o600)
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
        if not (d / TLS_KEY).exists() or _expiring(d / TLS_CERT, req.days / 2):
            ca.issue(req).save(d)
    return root


def _expiring(cert_path: Path, days: float) -> bool:
    """Whether the certificate is unreadable or has less than ``days`` left."""
    try:
        cert = x509.load_pem_x509_certificate(cert_path.read_bytes())
    except (OSError, ValueError):
        return True
    return cert.not_valid_after_utc - _now() < dt.timedelta(days=days)


def identity_dir_name(role: str, tenant: str = "") -> str:
    return f"{role}-{tenant}" if tenant else role


def request_of(cert_pem: bytes, days: int = DEFAULT_DAYS) -> CertRequest:
    """The request that reproduces ``cert_pem``'s identity and names."""
    cert = x509.load_pem_x509_certificate(cert_pem)
    ident = identity_from_uris(cert.extensions.get_extension_for_class(
        x509.SubjectAlternativeName).value.get_values_for_type(x509.UniformResourceIdentifier))
    if ident is None:
        raise PKIError("the certificate names no kvserve identity")
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    hosts = [*san.get_values_for_type(x509.DNSName),
             *(str(ip) for ip in san.get_values_for_type(x509.IPAddress))]
    cn = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    name = str(cn[0].value) if cn else ""
    default_cn = f"{ident.role}:{ident.tenant}" if ident.tenant else ident.role
    return CertRequest(ident.role, name="" if name == default_cn else name, tenant=ident.tenant,
                       hosts=tuple(h for h in hosts if h != server_name(ident.role)), days=days)


@dataclass(frozen=True, slots=True)
class Rotated:
    directory: Path
    request: CertRequest
    not_after: dt.datetime


def identity_dirs(directory: str | Path) -> list[Path]:
    """Every identity directory of a deployment (those holding a tls.crt), CA excluded."""
    root = Path(directory)
    return sorted(p.parent for p in root.glob(f"*/{TLS_CERT}") if p.parent.name != "ca")


def rotate_deployment(directory: str | Path, *, days: int = DEFAULT_DAYS,
                      only: tuple[str, ...] = ()) -> list[Rotated]:
    """Re-issue every identity under ``directory`` (or the directory names in
    ``only``) from its CA: same role, tenant, names; a fresh key; ``days`` of
    validity. The key is written before the certificate, and readers accept a
    pair only when they match (security.certfiles)."""
    root = Path(directory)
    ca = CertAuthority.load(root / "ca")
    done: list[Rotated] = []
    for d in identity_dirs(root):
        if only and d.name not in only:
            continue
        req = request_of((d / TLS_CERT).read_bytes(), days)
        issued = ca.issue(req)
        issued.save(d)
        cert = x509.load_pem_x509_certificate(issued.cert_pem)
        done.append(Rotated(d, req, cert.not_valid_after_utc))
    if only and len(done) != len(set(only)):
        missing = sorted(set(only) - {r.directory.name for r in done})
        raise PKIError(f"no identity directory {missing} under {root}")
    return done


__all__ = ["CA_CERT", "CA_KEY", "DEFAULT_DAYS", "MAX_DAYS", "TLS_CERT", "TLS_KEY",
           "CertAuthority", "CertRequest", "IssuedCert", "PKIError", "Rotated",
           "ensure_deployment", "identity_dir_name", "identity_dirs", "request_of",
           "rotate_deployment", "server_name"]
