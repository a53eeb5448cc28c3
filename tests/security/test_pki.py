"""The deployment's secret, CA and identities (security.pki / config / identity)."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from kvstore.keys import chain_keys
from security.config import SecurityConfig, SecurityError
from security.identity import Identity, IdentityError, identity_from_uris
from security.pki import CertAuthority, CertRequest, ensure_deployment

FP = bytes(16)


def test_deployment_files_are_private_and_made_once(tmp_path: Path) -> None:
    root = ensure_deployment(tmp_path / "dep")
    files = [p for p in root.rglob("*") if p.is_file()]
    assert {p.name for p in files} == {"secret", "ca.crt", "ca.key", "tls.crt", "tls.key"}
    for p in files:
        assert stat.S_IMODE(p.stat().st_mode) == 0o600, p
    for d in [root, *(p for p in root.rglob("*") if p.is_dir())]:
        assert stat.S_IMODE(d.stat().st_mode) == 0o700, d
    before = {p: p.read_bytes() for p in files}
    ensure_deployment(root)                 # a second start keeps everything
    assert {p: p.read_bytes() for p in files} == before


def test_keys_of_one_prompt_differ_between_deployments(tmp_path: Path) -> None:
    tokens = list(range(1, 257))
    keys = {}
    for name in ("one", "two"):
        sec = SecurityConfig(str(ensure_deployment(tmp_path / name)), role="prefill")
        keys[name] = chain_keys(tokens, block_tokens=64, tenant="acme", fingerprint=FP,
                                secret=sec.require_secret())
    unkeyed = chain_keys(tokens, block_tokens=64, tenant="acme", fingerprint=FP)
    assert len(keys["one"]) == len(keys["two"]) == 4
    # Not one block key in common, and neither is what name + prompt alone give.
    assert not set(keys["one"]) & set(keys["two"])
    assert not set(unkeyed) & (set(keys["one"]) | set(keys["two"]))
    again = SecurityConfig(str(tmp_path / "one"), role="decode").require_secret()
    assert chain_keys(tokens, block_tokens=64, tenant="acme", fingerprint=FP,
                      secret=again) == keys["one"]     # every service of one deployment agrees


def test_secret_is_required_outside_insecure(tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    ca = CertAuthority.create()
    ca.issue(CertRequest("prefill")).save(tmp_path / "id")
    monkeypatch.delenv("KVSERVE_SECRET_FILE", raising=False)
    with pytest.raises(SecurityError, match="no deployment secret"):
        SecurityConfig(str(tmp_path / "id")).require_secret()
    (tmp_path / "short").write_text("abcd")
    (tmp_path / "short").chmod(0o600)
    with pytest.raises(SecurityError, match="holds 2 bytes"):
        SecurityConfig(str(tmp_path / "id"), secret_file=str(tmp_path / "short"))
    (tmp_path / "good").write_text(os.urandom(32).hex())
    (tmp_path / "good").chmod(0o644)        # readable by every local user: refused
    with pytest.raises(SecurityError, match="readable by every local user"):
        SecurityConfig(str(tmp_path / "id"), secret_file=str(tmp_path / "good"))
    (tmp_path / "good").chmod(0o600)
    assert len(SecurityConfig(str(tmp_path / "id"),
                              secret_file=str(tmp_path / "good")).require_secret()) == 32
    assert SecurityConfig(insecure=True).require_secret() == b""
    with pytest.raises(SecurityError, match="--insecure"):
        SecurityConfig()                    # neither credentials nor plain text asked for


def test_identity_comes_from_exactly_one_role_and_at_most_one_tenant() -> None:
    assert identity_from_uris(["urn:kvserve:role:prefill"]) == Identity("prefill")
    t = identity_from_uris(["urn:kvserve:role:tenant", "urn:kvserve:tenant:acme"])
    assert t == Identity("tenant", tenant="acme") and not t.is_service
    assert identity_from_uris(["urn:kvserve:role:router", "urn:kvserve:tenant:acme"]).tenant
    for bad in ([], ["urn:kvserve:role:root"], ["urn:kvserve:role:prefill",
                                                 "urn:kvserve:role:operator"],
                ["urn:kvserve:role:tenant"],
                ["urn:kvserve:role:tenant", "urn:kvserve:tenant:a", "urn:kvserve:tenant:b"],
                ["https://example.com"]):
        assert identity_from_uris(bad) is None, bad
    with pytest.raises(IdentityError):
        CertRequest("tenant")                # a tenant certificate must name its tenant
