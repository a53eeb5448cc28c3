"""The security flags every ``serve`` command and ``up`` share, in one place:
mTLS identity, deployment secret, and how a Redis URL (which may carry a
password) reaches a process: ``--redis-url`` never with credentials (argv is
readable by every local user in /proc), ``--redis-url-file`` for one that has.
"""

from __future__ import annotations

import argparse
import os

from common.config import RedisSection
from security.config import SECRET_FILE_ENV, TLS_DIR_ENV, SecurityConfig
from security.redact import has_credentials
from security.secret_files import SecretFileError, check_url_secret, read_secret_text

REDIS_URL_ENV = "REDIS_URL"
REDIS_URL_FILE_ENV = "REDIS_URL_FILE"


def add_security_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tls-dir", default=None, metavar="DIR",
                   help="mTLS identity: tls.crt, tls.key, ca.crt (a cert-manager Secret), or a "
                        f"deployment directory from `kvserve certs init` (default ${TLS_DIR_ENV})")
    p.add_argument("--secret-file", default=None, metavar="FILE",
                   help="deployment secret that keys tenant salts (hex; default "
                        f"${SECRET_FILE_ENV}, else 'secret' beside the certificates)")
    p.add_argument("--insecure", action="store_true",
                   help="plain text, NO authentication: anyone who reaches a port can read and "
                        "overwrite every tenant's KV (logged as a warning)")
    p.add_argument("--health-port", type=int, default=-1, metavar="PORT",
                   help="plain-text port serving only grpc.health.v1 (Kubernetes probes cannot "
                        "do mTLS); -1 off (default), 0 any free port")


def argv_redis_url(url: str) -> str:
    """argparse ``type`` of ``--redis-url``: a URL without a password."""
    if has_credentials(url):
        raise argparse.ArgumentTypeError(
            "the URL carries a password, and command lines are readable by every local user "
            "(/proc/PID/cmdline): put the URL in a file (chmod 600) and pass "
            f"--redis-url-file FILE (or set {REDIS_URL_FILE_ENV})")
    return url


def argv_url(url: str) -> str:
    """argparse ``type`` of any other URL flag (``--g4-url``): no credentials in it."""
    if has_credentials(url):
        raise argparse.ArgumentTypeError(
            "the URL carries a password, and command lines are readable by every local user: "
            "give credentials through the service's own files or environment instead "
            "(docs/security.md)")
    return url


def add_redis_flags(p: argparse.ArgumentParser, *, default: str) -> None:
    """``--redis-url`` (no credentials) and ``--redis-url-file``; ``default``
    says what happens without either."""
    p.add_argument("--redis-url", default=None, type=argv_redis_url, metavar="URL",
                   help=f"Redis URL without credentials (default: {default})")
    p.add_argument("--redis-url-file", default=None, metavar="FILE",
                   help="file (mode 0600) holding the Redis URL with its ACL user and "
                        f"password, e.g. redis://prefill:PASSWORD@host:6379/0 (default "
                        f"${REDIS_URL_FILE_ENV})")


def redis_url_from(args: argparse.Namespace | None, section: RedisSection | None = None, *,
                   env: bool = True) -> str:
    """The Redis URL of this process, first found of: ``--redis-url-file``,
    ``--redis-url``, ``$REDIS_URL_FILE``, ``$REDIS_URL`` (when ``env``),
    ``[redis].url_file``, ``[redis].url``; "" when none. A URL read from
    anywhere is checked (no placeholder password) and its password registered
    for redaction."""
    file_flag = getattr(args, "redis_url_file", None) if args is not None else None
    url_flag = getattr(args, "redis_url", None) if args is not None else None
    sources: list[tuple[str, str, bool]] = [
        ("--redis-url-file", file_flag or "", True),
        ("--redis-url", url_flag or "", False),
    ]
    if env:
        sources += [(f"${REDIS_URL_FILE_ENV}", os.environ.get(REDIS_URL_FILE_ENV, ""), True),
                    (f"${REDIS_URL_ENV}", os.environ.get(REDIS_URL_ENV, ""), False)]
    if section is not None:
        sources += [("[redis].url_file", section.url_file, True), ("[redis].url", section.url,
                                                                    False)]
    for setting, value, is_file in sources:
        if not value:
            continue
        url = read_secret_text(value, setting) if is_file else value
        return check_url_secret(url, setting)
    return ""


def security_from_args(args: argparse.Namespace, role: str) -> SecurityConfig:
    return SecurityConfig.from_flags(tls_dir=args.tls_dir, insecure=args.insecure, role=role,
                                     secret_file=args.secret_file)


__all__ = ["REDIS_URL_ENV", "REDIS_URL_FILE_ENV", "SecretFileError", "add_redis_flags",
           "add_security_flags", "argv_redis_url", "argv_url", "redis_url_from",
           "security_from_args"]
