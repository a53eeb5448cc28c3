"""One identity's certificate files, re-read when they change on disk.

``kvserve certs rotate`` (or cert-manager, or ``kvserve up`` before its
children's certificates run out) replaces ``tls.crt`` / ``tls.key`` / ``ca.crt``
in place. Servers pick the new pair up on their next TLS handshake (gRPC's
dynamic server credentials ask ``server_config`` before each one); every
channel made after the change presents the new client certificate. A pair
caught half-written (the new certificate beside the old key) is ignored until
both match, so a rotation never serves a broken identity.
"""

from __future__ import annotations

import datetime as dt
import threading
from dataclasses import dataclass
from pathlib import Path

import grpc
from cryptography import x509
from cryptography.hazmat.primitives import serialization

from security.pki import CA_CERT, TLS_CERT, TLS_KEY

# Below this much validity left a process warns at start (rotate soon).
WARN_LEFT = dt.timedelta(days=1)


class CertFileError(ValueError):
    """Unreadable, mismatched or expired certificate files."""


@dataclass(frozen=True, slots=True)
class Pem:
    ca: bytes
    cert: bytes
    key: bytes
    not_after: dt.datetime


def load_pem(directory: Path, *, now: dt.datetime | None = None) -> Pem:
    """Read and check one identity directory: the key matches the certificate,
    which is valid now."""
    try:
        ca, cert, key = ((directory / n).read_bytes() for n in (CA_CERT, TLS_CERT, TLS_KEY))
    except OSError as exc:
        raise CertFileError(f"cannot read credentials in {directory}: {exc.strerror}") from None
    try:
        leaf = x509.load_pem_x509_certificate(cert)
        private = serialization.load_pem_private_key(key, None)
    except ValueError as exc:
        raise CertFileError(f"{directory}: unreadable certificate or key ({exc})") from None
    if leaf.public_key().public_bytes(serialization.Encoding.DER,
                                      serialization.PublicFormat.SubjectPublicKeyInfo) != \
            private.public_key().public_bytes(serialization.Encoding.DER,
                                              serialization.PublicFormat.SubjectPublicKeyInfo):
        raise CertFileError(f"{directory}: {TLS_KEY} does not belong to {TLS_CERT}")
    now = now or dt.datetime.now(dt.UTC)
    if leaf.not_valid_after_utc <= now:
        raise CertFileError(f"{directory / TLS_CERT} expired on "
                            f"{leaf.not_valid_after_utc:%Y-%m-%d %H:%M} UTC: renew it with "
                            "`kvserve certs rotate` (docs/security.md)")
    if leaf.not_valid_before_utc > now + dt.timedelta(minutes=5):
        raise CertFileError(f"{directory / TLS_CERT} is not valid before "
                            f"{leaf.not_valid_before_utc:%Y-%m-%d %H:%M} UTC")
    return Pem(ca, cert, key, leaf.not_valid_after_utc)


class CertFiles:
    """The current PEMs of one identity directory, reloaded when a file's
    modification time changes (checked at most once per call)."""

    __slots__ = ("_lock", "_pem", "_stamp", "directory")

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._lock = threading.Lock()
        self._pem = load_pem(directory)
        self._stamp = self._stamps()

    def _stamps(self) -> tuple[int, ...]:
        try:
            return tuple((self.directory / n).stat().st_mtime_ns
                         for n in (CA_CERT, TLS_CERT, TLS_KEY))
        except OSError:
            return ()

    def current(self) -> tuple[Pem, bool]:
        """(the newest valid PEMs, whether they changed since the last call)."""
        with self._lock:
            stamp = self._stamps()
            if stamp and stamp != self._stamp:
                try:
                    pem = load_pem(self.directory)
                except CertFileError:
                    return self._pem, False      # mid-rotation or broken: keep serving
                self._pem, self._stamp = pem, stamp
                return pem, True
            return self._pem, False

    def server_credentials(self) -> grpc.ServerCredentials:
        """mTLS server credentials that follow rotations (client certificate required)."""
        pem = self._pem

        def config(p: Pem) -> grpc.ServerCertificateConfiguration:
            return grpc.ssl_server_certificate_configuration([(p.key, p.cert)],
                                                             root_certificates=p.ca)

        def fetch() -> grpc.ServerCertificateConfiguration | None:
            fresh, changed = self.current()
            return config(fresh) if changed else None

        # require_client_authentication: the TLS handshake itself refuses a caller
        # without a certificate of this deployment's CA, before any handler runs.
        return grpc.dynamic_ssl_server_credentials(config(pem), fetch,
                                                   require_client_authentication=True)

    def channel_credentials(self) -> grpc.ChannelCredentials:
        pem, _ = self.current()
        return grpc.ssl_channel_credentials(pem.ca, pem.key, pem.cert)


__all__ = ["WARN_LEFT", "CertFileError", "CertFiles", "Pem", "load_pem"]
