"""``kvserve certs init|issue|rotate|show|redis-users``: the deployment's
secret, CA, certificates and Redis users.

- ``init DIR``: a deployment directory (``secret``, ``ca/``, one identity per
  service role and an ``operator``), made once; existing files are kept.
- ``issue DIR --role R [--tenant T] [--host H ...]``: one more identity signed
  by DIR's CA (e.g. a tenant-scoped client, or a server with its DNS names),
  written as ``tls.crt``, ``tls.key`` (0600) and ``ca.crt``: the layout of a
  cert-manager Secret, so ``kubectl create secret generic --from-file`` takes
  the directory as it is (docs/security.md).
- ``rotate DIR``: re-issue every identity under DIR (same role, tenant and
  names, a fresh key, ``--days`` of validity). Leaf certificates are
  short-lived (14 days by default): rotate weekly. Running servers take the new
  files on their next TLS handshake; clients on their next channel (restart a
  process to drop its old connections). The CA and its key are untouched.
- ``show DIR``: who a certificate directory says it is, and until when.
- ``redis-users DIR --address HOST:PORT``: one Redis ACL user per role with a
  random password: ``DIR/redis/users.acl`` for the Redis server (hashed
  passwords) and ``DIR/redis/<role>.url`` for each component (0600;
  docs/security.md, "Redis users").
"""

from __future__ import annotations

import argparse
from pathlib import Path

from kvserve.cli import CommandRegistry, UsageError


def _configure_init(p: argparse.ArgumentParser) -> None:
    p.add_argument("dir", help="deployment directory to create (kept where it exists)")
    p.add_argument("--host", action="append", default=[], metavar="NAME",
                   help="extra DNS name / IP for every server certificate (repeatable), e.g. "
                        "a Service name")


def _init(args: argparse.Namespace) -> int:
    from security.identity import ROLES
    from security.pki import CertRequest, PKIError, ensure_deployment

    try:
        wanted = tuple(CertRequest(r, hosts=tuple(args.host)) for r in ROLES if r != "tenant")
        root = ensure_deployment(args.dir, identities=wanted)
    except (OSError, PKIError, ValueError) as exc:
        raise UsageError(f"certs init {args.dir}: {exc}") from exc
    print(f"deployment in {root}: secret, ca/, " + ", ".join(r.role + "/" for r in wanted))
    print(f"serve with --tls-dir {root} (or {root}/<role> in its own Secret)")
    return 0


def _configure_issue(p: argparse.ArgumentParser) -> None:
    p.add_argument("dir", help="deployment directory (its ca/ signs)")
    p.add_argument("--role", required=True,
                   help="kvstore | prefill | decode | router | engine | operator | tenant")
    p.add_argument("--tenant", default="", help="scope: the one tenant this identity acts for")
    p.add_argument("--name", default="", help="common name (default: role[:tenant])")
    p.add_argument("--host", action="append", default=[], metavar="NAME",
                   help="DNS name / IP the server answers on (repeatable)")
    p.add_argument("--days", type=int, default=None,
                   help="validity in days (default 14; at most 397; rotate with `certs rotate`)")
    p.add_argument("--out", default="", help="output directory (default DIR/<role>[-<tenant>])")


def _issue(args: argparse.Namespace) -> int:
    from security.pki import CertAuthority, CertRequest, PKIError, identity_dir_name

    try:
        days = {} if args.days is None else {"days": args.days}
        req = CertRequest(args.role, name=args.name, tenant=args.tenant,
                          hosts=tuple(args.host), **days)
        ca = CertAuthority.load(Path(args.dir) / "ca")
        out = Path(args.out) if args.out else Path(args.dir) / identity_dir_name(req.role,
                                                                                   req.tenant)
        ca.issue(req).save(out)
    except (OSError, PKIError, ValueError) as exc:
        raise UsageError(f"certs issue: {exc}") from exc
    print(f"{out}: tls.crt, tls.key (0600), ca.crt for {req.role}"
          + (f" scoped to tenant {req.tenant}" if req.tenant else "")
          + f", valid {req.days} days")
    return 0


def _configure_rotate(p: argparse.ArgumentParser) -> None:
    p.add_argument("dir", help="deployment directory (its ca/ signs)")
    p.add_argument("--days", type=int, default=None, help="validity in days (default 14)")
    p.add_argument("--only", action="append", default=[], metavar="NAME",
                   help="rotate only this identity directory (repeatable), e.g. kvstore")


def _rotate(args: argparse.Namespace) -> int:
    from security.pki import PKIError, rotate_deployment

    try:
        days = {} if args.days is None else {"days": args.days}
        done = rotate_deployment(args.dir, only=tuple(args.only), **days)
    except (OSError, PKIError, ValueError) as exc:
        raise UsageError(f"certs rotate: {exc}") from exc
    if not done:
        raise UsageError(f"certs rotate: no identity directories under {args.dir}")
    for r in done:
        scope = f" for tenant {r.request.tenant}" if r.request.tenant else ""
        print(f"{r.directory}: {r.request.role}{scope}, new key, valid until "
              f"{r.not_after:%Y-%m-%d %H:%M} UTC")
    print("running servers use the new certificates from their next handshake")
    return 0


def _configure_redis_users(p: argparse.ArgumentParser) -> None:
    p.add_argument("dir", help="deployment directory (writes DIR/redis/)")
    p.add_argument("--address", required=True, metavar="HOST:PORT",
                   help="where the components reach Redis, e.g. kvserve-redis:6379")
    p.add_argument("--scheme", default="redis",
                   choices=("redis", "rediss", "redis+cluster", "rediss+cluster"),
                   help="URL scheme: TLS (rediss) and/or Redis Cluster (+cluster)")
    p.add_argument("--redis6", action="store_true",
                   help="for Redis 6.2 (no read-only key patterns: the router's user may "
                        "also write other registry entries)")


def _redis_users(args: argparse.Namespace) -> int:
    from kvstore.redis_acl import ROLES, RedisUsers
    from security.secret_files import write_private

    host, sep, port = args.address.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise UsageError(f"--address {args.address!r}: want HOST:PORT")
    users = RedisUsers.generate(admin=False)
    out = Path(args.dir) / "redis"
    acl = users.acl_lines(read_only_patterns=not args.redis6)
    write_private(out / "users.acl", "\n".join(acl) + "\n")
    for role in ROLES:
        write_private(out / f"{role}.url", users.url(role, host.strip("[]"), int(port),
                                                     scheme=args.scheme) + "\n")
    print(f"{out}/users.acl: the Redis server's ACL file (--aclfile; passwords hashed)")
    print(f"{out}/<role>.url for {', '.join(ROLES)}: each component's --redis-url-file (0600)")
    return 0


def _configure_show(p: argparse.ArgumentParser) -> None:
    p.add_argument("dir", help="a directory with tls.crt (or a deployment directory)")
    p.add_argument("--role", default="", help="identity inside a deployment directory")


def _show(args: argparse.Namespace) -> int:
    from cryptography import x509

    from security.config import SecurityError, resolve_cert_dir
    from security.identity import identity_from_uris

    try:
        d = resolve_cert_dir(args.dir, args.role)
        cert = x509.load_pem_x509_certificate((d / "tls.crt").read_bytes())
    except (OSError, SecurityError, ValueError) as exc:
        raise UsageError(f"certs show: {exc}") from exc
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    uris = san.get_values_for_type(x509.UniformResourceIdentifier)
    ident = identity_from_uris(uris)
    print(f"{d}: {ident.describe() if ident else 'NOT a kvserve identity'}; "
          f"DNS {', '.join(san.get_values_for_type(x509.DNSName)) or '-'}; "
          f"valid until {cert.not_valid_after_utc:%Y-%m-%d}")
    return 0


def register(reg: CommandRegistry) -> None:
    reg.add("certs init", help="create a deployment's secret, CA and service certificates",
            configure=_configure_init, run=_init)
    reg.add("certs issue", help="issue one more certificate (e.g. a tenant-scoped client)",
            configure=_configure_issue, run=_issue)
    reg.add("certs rotate", help="re-issue every certificate of a deployment (fresh keys)",
            configure=_configure_rotate, run=_rotate)
    reg.add("certs show", help="print the identity a certificate directory carries",
            configure=_configure_show, run=_show)
    reg.add("certs redis-users", help="one Redis ACL user per role: users.acl and URL files",
            configure=_configure_redis_users, run=_redis_users)
