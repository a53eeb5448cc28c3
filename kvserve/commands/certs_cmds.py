"""``kvserve certs init|issue|show``: the deployment's secret, CA and certificates.

- ``init DIR``: a deployment directory (``secret``, ``ca/``, one identity per
  service role and an ``operator``), made once; existing files are kept.
- ``issue DIR --role R [--tenant T] [--host H ...]``: one more identity signed
  by DIR's CA (e.g. a tenant-scoped client, or a server with its DNS names),
  written as ``tls.crt``, ``tls.key`` (0600) and ``ca.crt``: the layout of a
  cert-manager Secret, so ``kubectl create secret generic --from-file`` takes
  the directory as it is (docs/security.md).
- ``show DIR``: who a certificate directory says it is, and until when.
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
    p.add_argument("--days", type=int, default=825, help="validity in days")
    p.add_argument("--out", default="", help="output directory (default DIR/<role>[-<tenant>])")


def _issue(args: argparse.Namespace) -> int:
    from security.pki import CertAuthority, CertRequest, PKIError, identity_dir_name

    try:
        req = CertRequest(args.role, name=args.name, tenant=args.tenant,
                          hosts=tuple(args.host), days=args.days)
        ca = CertAuthority.load(Path(args.dir) / "ca")
        out = Path(args.out) if args.out else Path(args.dir) / identity_dir_name(req.role,
                                                                                   req.tenant)
        ca.issue(req).save(out)
    except (OSError, PKIError, ValueError) as exc:
        raise UsageError(f"certs issue: {exc}") from exc
    print(f"{out}: tls.crt, tls.key (0600), ca.crt for {req.role}"
          + (f" scoped to tenant {req.tenant}" if req.tenant else ""))
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
    reg.add("certs show", help="print the identity a certificate directory carries",
            configure=_configure_show, run=_show)
