"""``SecurityConfig``: the credentials one process serves and dials with.

Built once at the entry point (CLI flags ``--tls-dir`` / ``--insecure``, else the
environment) and passed down; every gRPC server and client in kvserve takes one.

- ``cert_dir`` holds ``tls.crt``, ``tls.key`` and ``ca.crt`` (a cert-manager
  Secret mounted as a directory, or what ``kvserve certs`` wrote). It may also
  be a whole deployment directory (``security.pki.ensure_deployment``): then the
  identity ``<cert_dir>/<role>`` is used for the asked role.
- ``insecure``: plain text, no authentication at all. Only on request, and it
  says so in the log.

Environment (read by ``from_env`` only when no flag decided): ``KVSERVE_TLS_DIR``.
There is deliberately no environment switch for plain text.

The deployment secret (``secret``) keys every tenant salt (kvstore.keys), so a
tenant's block keys cannot be computed from its name and prompt. It is read
from ``secret_file``, else ``KVSERVE_SECRET_FILE``, else a file named ``secret``
in the identity directory or the deployment directory above it: hex text of
16-64 bytes (``kvserve certs init`` writes 32 random ones). A process that
computes keys asks for ``require_secret()``; outside ``--insecure`` a missing
secret is an error, never a silent unkeyed salt.
"""

from __future__ import annotations

import datetime as dt
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from security.certfiles import WARN_LEFT, CertFileError, CertFiles
from security.identity import ROLES
from security.pki import TLS_CERT, server_name
from security.redact import register_secret
from security.secret_files import read_secret_text
from telemetry.grpc_hooks import client_interceptors

log = logging.getLogger(__name__)

TLS_DIR_ENV = "KVSERVE_TLS_DIR"
SECRET_FILE_ENV = "KVSERVE_SECRET_FILE"
SECRET_FILE = "secret"
MIN_SECRET_BYTES = 16
MAX_SECRET_BYTES = 64


class SecurityError(ValueError):
    """No usable credentials, and plain text was not asked for."""


def resolve_cert_dir(directory: str | Path, role: str) -> Path:
    """``directory`` itself when it holds tls.crt, else its ``role`` subdirectory."""
    d = Path(directory)
    if (d / TLS_CERT).exists():
        return d
    if role and (d / role / TLS_CERT).exists():
        return d / role
    raise SecurityError(f"no {TLS_CERT} in {d} (nor in {d / role}): make certificates with "
                        "`kvserve certs init` or pass --insecure")


@dataclass(frozen=True, slots=True)
class SecurityConfig:
    """mTLS credentials of one identity, or explicit plain text."""

    cert_dir: str = ""
    insecure: bool = False
    role: str = ""                 # which identity to pick from a deployment directory
    secret_file: str = ""          # deployment secret; default: see the module doc
    _secret: bytes = field(default=b"", init=False, repr=False, compare=False)
    _files: CertFiles | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.insecure:
            if self.cert_dir:
                raise SecurityError("choose --insecure or --tls-dir, not both")
            self._load_secret(None)
            return
        if self.role and self.role not in ROLES:
            raise SecurityError(f"role {self.role!r} is not one of {', '.join(ROLES)}")
        if not self.cert_dir:
            raise SecurityError("no credentials: pass --tls-dir DIR (tls.crt, tls.key, ca.crt; "
                                f"or set {TLS_DIR_ENV}) or run in plain text with --insecure")
        d = resolve_cert_dir(self.cert_dir, self.role)
        try:
            files = CertFiles(d)
        except CertFileError as exc:
            raise SecurityError(str(exc)) from None
        left = files.current()[0].not_after - dt.datetime.now(dt.UTC)
        if left < WARN_LEFT:
            log.warning("SECURITY: the certificate in %s expires in %s: run `kvserve certs "
                        "rotate`", d, str(left).split(".")[0])
        object.__setattr__(self, "_files", files)
        self._load_secret(d)

    def _load_secret(self, identity_dir: Path | None) -> None:
        candidates = [self.secret_file or os.environ.get(SECRET_FILE_ENV, "")]
        if identity_dir is not None and not candidates[0]:
            candidates += [str(identity_dir / SECRET_FILE), str(identity_dir.parent / SECRET_FILE)]
        for path in filter(None, candidates):
            p = Path(path)
            if p.is_file() or path == candidates[0]:
                object.__setattr__(self, "_secret", read_secret(p))
                return

    def require_secret(self) -> bytes:
        """The deployment secret; an error outside ``--insecure`` when there is none."""
        if not self._secret and not self.insecure:
            raise SecurityError("no deployment secret: pass --secret-file, set "
                                f"{SECRET_FILE_ENV}, or put a '{SECRET_FILE}' file beside the "
                                "certificates (`kvserve certs init` writes one)")
        return self._secret

    @classmethod
    def from_env(cls, role: str = "") -> SecurityConfig:
        return cls(cert_dir=os.environ.get(TLS_DIR_ENV, ""), role=role)

    @classmethod
    def from_flags(cls, *, tls_dir: str | None = "", insecure: bool = False, role: str = "",
                   secret_file: str | None = "") -> SecurityConfig:
        """What a ``serve`` command was told; the environment fills in a missing dir."""
        if insecure:
            return cls(insecure=True, secret_file=secret_file or "")
        return cls(cert_dir=tls_dir or os.environ.get(TLS_DIR_ENV, ""), role=role,
                   secret_file=secret_file or "")

    @classmethod
    def for_local_run(cls, directory: str | Path, role: str = "operator") -> SecurityConfig:
        """For tools that start their own stack (benchmarks): the deployment in
        ``KVSERVE_TLS_DIR`` if set, else one made (once) in ``directory``."""
        if os.environ.get(TLS_DIR_ENV):
            return cls.from_env(role)
        from security.pki import ensure_deployment

        return cls(cert_dir=str(ensure_deployment(directory)), role=role)

    def for_role(self, role: str) -> SecurityConfig:
        """The same deployment, another identity (a deployment directory only)."""
        if self.insecure or not self.cert_dir:
            return self
        return SecurityConfig(cert_dir=self.cert_dir, role=role, secret_file=self.secret_file)

    # -- pieces ------------------------------------------------------------------------------
    @property
    def ca_pem(self) -> bytes:
        return self._files.current()[0].ca if self._files is not None else b""

    @property
    def identity_dir(self) -> Path | None:
        """The directory whose tls.crt / tls.key this process presents."""
        return self._files.directory if self._files is not None else None

    def _cert_files(self) -> CertFiles:
        if self._files is None:
            raise SecurityError("plain-text mode (--insecure) has no certificates")
        return self._files

    def server_credentials(self) -> grpc.ServerCredentials:
        """mTLS (client certificate required) that follows certificate rotations."""
        return self._cert_files().server_credentials()

    def channel_credentials(self) -> grpc.ChannelCredentials:
        """The identity as on disk now (a rotated certificate serves new channels)."""
        return self._cert_files().channel_credentials()

    # -- servers and channels ----------------------------------------------------------------
    def add_port(self, server: grpc.aio.Server, address: str) -> int:
        """Bind ``address`` with mTLS (or plain text when insecure); the bound port."""
        if self.insecure:
            log.warning("SECURITY: %s serves PLAIN TEXT with no authentication (--insecure); "
                        "anyone who can reach it can read and overwrite every tenant's KV",
                        address)
            return server.add_insecure_port(address)
        return server.add_secure_port(address, self.server_credentials())

    def channel_options(self, peer_role: str) -> list[tuple[str, str]]:
        # Verify the server's certificate names the role we mean to talk to,
        # whatever address the registry gave us (pod IPs are not in certificates).
        # peer_role "": verify the dialled host name itself (tools, probes).
        if self.insecure or not peer_role:
            return []
        return [("grpc.ssl_target_name_override", server_name(peer_role))]

    def aio_channel(self, address: str, peer_role: str,
                    options: list[tuple[str, object]] | tuple[tuple[str, object], ...] = (),
                    ) -> grpc.aio.Channel:
        opts = _with_defaults(options, self.channel_options(peer_role))
        hooks = client_interceptors()     # trace context out (none while tracing is off)
        if self.insecure:
            return grpc.aio.insecure_channel(address, options=opts, interceptors=hooks)
        return grpc.aio.secure_channel(address, self.channel_credentials(), options=opts,
                                       interceptors=hooks)

    def sync_channel(self, address: str, peer_role: str,
                     options: list[tuple[str, object]] | tuple[tuple[str, object], ...] = (),
                     ) -> grpc.Channel:
        opts = _with_defaults(options, self.channel_options(peer_role))
        if self.insecure:
            return grpc.insecure_channel(address, options=opts)
        return grpc.secure_channel(address, self.channel_credentials(), options=opts)


def read_secret(path: Path) -> bytes:
    """A deployment secret file: hex text of 16-64 random bytes, not
    world-readable (security.secret_files)."""
    try:
        text = read_secret_text(path, "the deployment secret")
        secret = bytes.fromhex(text)
    except ValueError as exc:
        raise SecurityError(f"deployment secret {path}: {exc} (want hex text of "
                            f"{MIN_SECRET_BYTES}-{MAX_SECRET_BYTES} bytes)") from None
    if not MIN_SECRET_BYTES <= len(secret) <= MAX_SECRET_BYTES:
        raise SecurityError(f"deployment secret {path} holds {len(secret)} bytes; want "
                            f"{MIN_SECRET_BYTES}-{MAX_SECRET_BYTES}")
    if len(set(secret)) < 4:
        # 00..00, ff..ff, a repeated byte pair: a placeholder, not random bytes.
        raise SecurityError(f"deployment secret {path} is a placeholder, not random bytes: "
                            "make one with `kvserve certs init` (32 random bytes)")
    register_secret(secret)
    register_secret(text)
    return secret


INSECURE_CONFIG = SecurityConfig(insecure=True)

__all__ = ["INSECURE_CONFIG", "SECRET_FILE_ENV", "TLS_DIR_ENV", "SecurityConfig",
           "SecurityError", "read_secret", "resolve_cert_dir"]


# Peers inside one deployment start in parallel and restart in seconds; gRPC's
# default reconnect backoff (1 s growing to 120 s) would keep a channel that
# dialled too early failing fast long after its server is up.
#
# Despite its name, gRPC core reads ``grpc.min_reconnect_backoff_ms`` as the
# deadline of one connection attempt (TCP connect, TLS handshake, HTTP/2
# settings). At 100 ms, a handshake slowed by a loaded host was cut off by the
# client itself ("Handshake read failed (Endpoint closing)"), every attempt
# again, and calls failed UNAVAILABLE while the server was up
# (tests/security/test_channels.py). gRPC's own default: an attempt may take 20 s;
# each call's deadline still bounds how long a call waits for it.
CONNECT_ATTEMPT_MS = 20_000

_CHANNEL_DEFAULTS: tuple[tuple[str, object], ...] = (
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", CONNECT_ATTEMPT_MS),
    ("grpc.max_reconnect_backoff_ms", 2_000),
)


def _with_defaults(options: list[tuple[str, object]] | tuple[tuple[str, object], ...],
                   security: list[tuple[str, str]]) -> list[tuple[str, object]]:
    """Caller options over the deployment defaults, security options last."""
    merged = dict(_CHANNEL_DEFAULTS)
    merged.update(options)
    merged.update(security)
    return list(merged.items())
