"""What ``kvserve up`` hands each child: its own credentials and nothing else.

Per role, a directory ``<run>/creds/<role>`` (0700) with

- ``tls.crt`` / ``tls.key`` / ``ca.crt``: a short-lived certificate of that role,
  issued at start from the deployment's CA (whose key stays with the launcher
  and the operator: no child is given ``ca/ca.key``, another role's key or the
  operator's certificate);
- ``secret``: the deployment secret (it keys tenant salts and block MACs);
- ``redis.url``: that role's Redis ACL user (kvstore.redis_acl).

Every file is 0600. A child's command line names only these files, never a
value, and its environment carries no credential variable (``child_env``).
The launcher re-issues the certificates before half their life is gone
(``renew_due``); servers pick the new files up on their next handshake.
Children run as the launcher's OS user: this keeps each child's view minimal,
it is not a boundary against code running as that user (docs/security.md).
"""

from __future__ import annotations

import datetime as dt
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from security.pki import CertAuthority, CertRequest
from security.secret_files import write_private

SECRET_FILE = "secret"
REDIS_URL_FILE = "redis.url"
# Variables a child must not inherit: it gets its own files named on its command line.
CREDENTIAL_ENV = ("REDIS_URL", "REDIS_URL_FILE", "KVSERVE_TLS_DIR", "KVSERVE_SECRET_FILE",
                  "KVSERVE_API_KEY")
# The object store's credentials: only the kvstore writes G4.
STORE_ONLY_ENV = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN")
DEFAULT_CERT_DAYS = 7


@dataclass(frozen=True, slots=True)
class ChildCredentials:
    role: str
    directory: Path
    tls: bool                      # False: --insecure (no certificate)
    not_after: dt.datetime | None = None

    @property
    def redis_url_file(self) -> Path:
        return self.directory / REDIS_URL_FILE

    def argv(self) -> list[str]:
        """The flags that point a ``kvserve ... serve`` child at its files."""
        flags = ["--redis-url-file", str(self.redis_url_file)]
        secret = self.directory / SECRET_FILE
        if secret.exists():
            flags += ["--secret-file", str(secret)]
        return [*flags, "--tls-dir", str(self.directory)] if self.tls else [*flags, "--insecure"]


def hand_out(role: str, run_dir: Path, *, redis_url: str, deployment: Path | None,
             days: int = DEFAULT_CERT_DAYS) -> ChildCredentials:
    """Make ``<run_dir>/creds/<role>`` for one child. ``deployment``: the
    directory with ``ca/`` and ``secret`` (None: plain text, no certificate)."""
    d = run_dir / "creds" / role
    d.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.chmod(d.parent, 0o700)
    os.chmod(d, 0o700)
    write_private(d / REDIS_URL_FILE, redis_url + "\n")
    if deployment is None:
        return ChildCredentials(role, d, tls=False)
    write_private(d / SECRET_FILE, (deployment / SECRET_FILE).read_bytes())
    return _issue(role, d, deployment, days)


def hand_out_roles(roles: Iterable[str], run_dir: Path, *, url: Callable[[str], str],
                   deployment: Path | None, days: int | None = None
                   ) -> dict[str, ChildCredentials]:
    """One directory per distinct role (instances of a role share it), and the
    operator's, which holds only its Redis URL (its certificate stays in the
    deployment directory)."""
    kw = {} if days is None else {"days": days}
    out = {r: hand_out(r, run_dir, redis_url=url(r), deployment=deployment, **kw)
           for r in dict.fromkeys(roles) if r != "operator"}
    out["operator"] = hand_out("operator", run_dir, redis_url=url("operator"), deployment=None)
    return out


def _issue(role: str, d: Path, deployment: Path, days: int) -> ChildCredentials:
    from cryptography import x509

    ca = CertAuthority.load(deployment / "ca")
    issued = ca.issue(CertRequest(role, days=days))
    issued.save(d)
    cert = x509.load_pem_x509_certificate(issued.cert_pem)
    return ChildCredentials(role, d, tls=True, not_after=cert.not_valid_after_utc)


def renew_due(creds: ChildCredentials, deployment: Path | None, *,
              days: int = DEFAULT_CERT_DAYS) -> ChildCredentials:
    """``creds`` with a fresh certificate when less than half its life is left."""
    if deployment is None or creds.not_after is None:
        return creds
    left = creds.not_after - dt.datetime.now(dt.UTC)
    if left > dt.timedelta(days=days) / 2:
        return creds
    return _issue(creds.role, creds.directory, deployment, days)


def child_env(role: str, base: dict[str, str] | None = None) -> dict[str, str]:
    """The launcher's environment without any credential variable (the kvstore
    keeps the object store's, which G4 needs)."""
    env = dict(os.environ if base is None else base)
    for name in (*CREDENTIAL_ENV, *(() if role == "kvstore" else STORE_ONLY_ENV)):
        env.pop(name, None)
    return env


__all__ = ["CREDENTIAL_ENV", "DEFAULT_CERT_DAYS", "STORE_ONLY_ENV", "ChildCredentials",
           "child_env", "hand_out", "hand_out_roles", "renew_due"]
