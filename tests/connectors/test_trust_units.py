"""Issue 19's vLLM half, without a vLLM server: salts that prove a tenant, the
untrusted namespace, the API key, and registry entries signed by the identity
they name."""

from __future__ import annotations

import dataclasses
import datetime as dt

import pytest

from connectors.vllm_entry import attested, events_endpoint, signed_fields
from connectors.vllm_identity import identity_of
from kvstore.registry import InstanceInfo
from security.attest import AttestationError, SignedFields, sign, verify
from security.config import SecurityConfig
from security.pki import CertAuthority, CertRequest
from security.secret_files import write_private
from security.vllm_trust import (
    UNTRUSTED_TENANT,
    salt_scope,
    tenant_salt,
    tenant_tag,
    untrusted_fingerprint,
    vllm_api_key,
)

SECRET = bytes(range(32))
FP = b"\x07" * 16


def test_only_a_salt_minted_with_the_secret_proves_its_tenant() -> None:
    s = tenant_salt("alice", SECRET)
    assert salt_scope(s, SECRET) == ("alice", True, "")
    assert salt_scope(tenant_salt("a.b-c", SECRET, "n1"), SECRET).tenant == "a.b-c"
    head, tenant, nonce, mac = s.split(".")
    forged = ["alice", "", None, f"{head}.{tenant}.{nonce}.{'0' * len(mac)}",
              f"{head}.{tenant}.{nonce}.{mac[:-1]}", f"{head}.bob.{nonce}.{mac}",
              f"{head}.{tenant}.other.{mac}", f"kvs2.{tenant}.{nonce}.{mac}",
              f"{head}.{tenant}.{nonce}.{mac.upper()}", s + "x",
              tenant_salt("alice", b"another deployment's secret")]
    for text in forged:
        scope = salt_scope(text, SECRET)
        assert scope == (UNTRUSTED_TENANT, False, text or ""), text
    with pytest.raises(ValueError, match="tenant"):
        tenant_salt("no spaces", SECRET)
    with pytest.raises(ValueError, match="nonce"):
        tenant_salt("alice", SECRET, "a.b")


def test_untrusted_salts_are_isolated_from_each_other_and_from_every_tenant() -> None:
    trusted = identity_of(tenant_salt("alice", SECRET), FP, SECRET)
    assert trusted.trusted and trusted.fingerprint == FP and trusted.tenant == "alice"
    free = [identity_of(t, FP, SECRET) for t in ("alice", "bob", None)]
    assert {i.tenant for i in free} == {UNTRUSTED_TENANT}          # one bounded namespace
    prints = {i.fingerprint for i in free} | {FP}
    assert len(prints) == 4                                       # but no shared block
    assert identity_of("alice", FP, SECRET).fingerprint == untrusted_fingerprint(FP, "alice")


def test_api_key_and_tag_are_per_deployment_and_not_the_salt() -> None:
    assert vllm_api_key(SECRET) == vllm_api_key(SECRET) != vllm_api_key(b"x" * 32)
    assert vllm_api_key(b"") == ""                                  # --insecure: none
    tag = tenant_tag("alice", SECRET)
    assert tag != tenant_tag("bob", SECRET) and "alice" not in tag
    assert tag not in tenant_salt("alice", SECRET)


@pytest.fixture(scope="module")
def ca() -> CertAuthority:
    return CertAuthority.create()


def _entry(**kw: str) -> InstanceInfo:
    base = dict(instance_id="vllm-0", role="prefill", address="https://10.0.0.5:8100",
                node="node-0", model_fingerprint="ab" * 16, kv_events="tcp://10.0.0.5:5557")
    return InstanceInfo(**{**base, **kw})  # type: ignore[arg-type]


def test_an_entry_verifies_only_for_the_identity_it_names(ca: CertAuthority, tmp_path) -> None:
    own = ca.issue(CertRequest("engine", name="vllm-0"))
    info = _entry()
    token = sign(signed_fields(info), own.cert_pem, own.key_pem)
    assert verify(signed_fields(info), token, ca.cert_pem) == "vllm-0"
    # Any field that decides where prompts go, changed after signing: refused.
    for change in ({"address": "https://evil:8100"}, {"kv_events": "tcp://evil:1"},
                   {"role": "decode"}, {"node": "node-9"}, {"model_fingerprint": "cd" * 16}):
        with pytest.raises(AttestationError, match="signature"):
            verify(signed_fields(dataclasses.replace(info, **change)), token, ca.cert_pem)
    # The same signature under another instance id: the certificate names vllm-0.
    with pytest.raises(AttestationError, match="names 'vllm-0'"):
        verify(signed_fields(_entry(instance_id="vllm-1")), token, ca.cert_pem)
    cases = {
        "another CA": (CertAuthority.create().issue(CertRequest("engine", name="vllm-0")),
                       "not issued"),
        "a router": (ca.issue(CertRequest("router", name="vllm-0")), "role"),
        "a tenant": (ca.issue(CertRequest("tenant", name="vllm-0", tenant="alice")), "role"),
        "expired": (ca.issue(CertRequest("engine", name="vllm-0", days=1)), "validity"),
    }
    for what, (cert, why) in cases.items():
        tok = sign(signed_fields(info), cert.cert_pem, cert.key_pem)
        later = dt.datetime.now(dt.UTC) + dt.timedelta(days=2) if what == "expired" else None
        with pytest.raises(AttestationError, match=why):
            verify(signed_fields(info), tok, ca.cert_pem, now=later)
    for junk in ("", "v1.x.y", "v2." + token[3:], token[:-8] + "AAAAAAAA", "v1" * 5000):
        with pytest.raises(AttestationError):
            verify(signed_fields(info), junk, ca.cert_pem)
    with pytest.raises(AttestationError, match="NUL"):
        SignedFields("a\x00", "", "", "", "", "").message()


def test_attested_signs_with_the_identity_directory(ca: CertAuthority, tmp_path) -> None:
    d = tmp_path / "vllm-0"
    ca.issue(CertRequest("engine", name="vllm-0")).save(d)
    write_private(tmp_path / "secret", SECRET.hex())
    sec = SecurityConfig(cert_dir=str(d), role="engine", secret_file=str(tmp_path / "secret"))
    info = attested(_entry(), sec)
    assert verify(signed_fields(info), info.attestation, ca.cert_pem) == "vllm-0"
    assert attested(_entry(), SecurityConfig(insecure=True)).attestation == ""
    back = InstanceInfo.from_fields({k.encode(): v.encode() for k, v in info.to_fields().items()})
    assert back.attestation == info.attestation and back.kv_events == info.kv_events


def test_events_endpoint_advertises_a_dialable_address() -> None:
    @dataclasses.dataclass
    class Cfg:
        enable_kv_cache_events: bool = True
        publisher: str = "zmq"
        endpoint: str = "tcp://*:5557"

    assert events_endpoint(Cfg(), "https://10.1.2.3:8100") == "tcp://10.1.2.3:5557"
    assert events_endpoint(Cfg(endpoint="ipc:///run/v.ev"), "https://h:1") == "ipc:///run/v.ev"
    assert events_endpoint(Cfg(enable_kv_cache_events=False), "https://h:1") == ""
    assert events_endpoint(None, "https://h:1") == ""
