"""What ``kvserve up`` hands each child (kvserve/credentials.py): its own
certificate, the CA certificate, the deployment secret and its role's Redis
URL, all 0600 in a 0700 directory; never the CA key; renewed at half-life."""

from __future__ import annotations

import datetime as dt
import stat
from pathlib import Path

from cryptography import x509

from kvserve.credentials import child_env, hand_out, renew_due
from security.config import SecurityConfig
from security.pki import ensure_deployment

URL = "redis://prefill:Zq8vT1pLw0@127.0.0.1:6379/0"


def test_a_child_gets_its_own_credentials_and_nothing_else(tmp_path: Path) -> None:
    dep = ensure_deployment(tmp_path / "dep")
    creds = hand_out("prefill", tmp_path / "run", redis_url=URL, deployment=dep, days=3)
    d = creds.directory
    assert sorted(p.name for p in d.iterdir()) == ["ca.crt", "redis.url", "secret", "tls.crt",
                                                   "tls.key"]
    assert stat.S_IMODE(d.stat().st_mode) == stat.S_IMODE(d.parent.stat().st_mode) == 0o700
    assert all(stat.S_IMODE(p.stat().st_mode) == 0o600 for p in d.iterdir())
    assert (d / "redis.url").read_text().strip() == URL
    assert (d / "secret").read_bytes() == (dep / "secret").read_bytes()
    argv = creds.argv()
    assert argv == ["--redis-url-file", str(d / "redis.url"), "--secret-file",
                    str(d / "secret"), "--tls-dir", str(d)]
    assert "Zq8vT1pLw0" not in " ".join(argv) and str(dep) not in " ".join(argv)
    # It is a working identity of that role, and it alone.
    sec = SecurityConfig(str(d), role="prefill")
    assert sec.identity_dir == d and len(sec.require_secret()) == 32
    cert = x509.load_pem_x509_certificate((d / "tls.crt").read_bytes())
    assert cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value \
        .get_values_for_type(x509.UniformResourceIdentifier) == ["urn:kvserve:role:prefill"]
    assert not list((tmp_path / "run").rglob("ca.key"))


def test_certificates_are_renewed_past_half_life(tmp_path: Path) -> None:
    dep = ensure_deployment(tmp_path / "dep")
    creds = hand_out("decode", tmp_path / "run", redis_url=URL, deployment=dep, days=1)
    assert creds.not_after is not None
    assert creds.not_after - dt.datetime.now(dt.UTC) <= dt.timedelta(days=1)
    assert renew_due(creds, dep, days=1) is creds               # a full day left of one
    renewed = renew_due(creds, dep, days=4)                     # one day left of four: due
    assert renewed.not_after is not None and renewed.not_after > creds.not_after
    assert x509.load_pem_x509_certificate((creds.directory / "tls.crt").read_bytes()) \
        .not_valid_after_utc == renewed.not_after


def test_plain_text_children_get_no_certificate(tmp_path: Path) -> None:
    creds = hand_out("kvstore", tmp_path / "run", redis_url=URL, deployment=None)
    assert sorted(p.name for p in creds.directory.iterdir()) == ["redis.url"]
    assert creds.argv() == ["--redis-url-file", str(creds.redis_url_file), "--insecure"]


def test_children_inherit_no_credential_variable() -> None:
    base = {"PATH": "/bin", "REDIS_URL": URL, "REDIS_URL_FILE": "/f", "KVSERVE_TLS_DIR": "/d",
            "KVSERVE_SECRET_FILE": "/s", "KVSERVE_API_KEY": "sk-1", "AWS_SECRET_ACCESS_KEY": "a"}
    assert child_env("prefill", base) == {"PATH": "/bin"}
    assert child_env("kvstore", base) == {"PATH": "/bin", "AWS_SECRET_ACCESS_KEY": "a"}
