"""The security flags every ``serve`` command and ``up`` share, in one place."""

from __future__ import annotations

import argparse

from security.config import SECRET_FILE_ENV, TLS_DIR_ENV, SecurityConfig


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


def security_from_args(args: argparse.Namespace, role: str) -> SecurityConfig:
    return SecurityConfig.from_flags(tls_dir=args.tls_dir, insecure=args.insecure, role=role,
                                     secret_file=args.secret_file)


__all__ = ["add_security_flags", "security_from_args"]
