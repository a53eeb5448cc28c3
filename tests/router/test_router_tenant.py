"""The router's gRPC API takes the tenant from authentication only (router/service.py
``tenant_of``), tried as a tenant with a valid certificate would: real Redis,
kvstore, prefill, decode and router processes, real mTLS.

Tenant ``bob``'s certificate naming ``alice`` (in ``ctx.tenant`` or the
``x-kvserve-tenant`` metadata) is refused; without a claim it is coerced to
``bob`` and gets none of alice's cached blocks. With API keys, a key and a
certificate or claim of different tenants are refused.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from kvstore.redis_server import EmbeddedRedis
from proto import common_pb2, router_pb2, router_pb2_grpc
from router.auth import ApiKeys
from router.serve import warn_if_open
from security.config import SecurityConfig
from security.pki import CertAuthority, CertRequest
from tests.prefill_svc.procs import engine_service, start_all, store, write_config
from tests.router.front_stack import RouterProc, live_counts, router_proc, wait_until

MODEL = "tiny-dense"
BLOCK = 16
KEYS = {"alice": "sk-alice-5f1c0a9e77", "bob": "sk-bob-93d2b6e401"}


@dataclass(frozen=True, slots=True)
class Routers:
    open: RouterProc          # no API keys: the certificate decides
    keyed: RouterProc         # API keys: the key decides


@pytest.fixture(scope="module")
def routers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Routers]:
    d = tmp_path_factory.mktemp("tenant")
    config = write_config(d / "kvserve.toml", model=MODEL, block_tokens=BLOCK)
    keys = d / "keys.txt"
    keys.write_text("".join(f"{k} {t}\n" for t, k in KEYS.items()))
    keys.chmod(0o600)
    with EmbeddedRedis() as redis:
        st = store(config, redis.url_for("kvstore"), d)
        engines = [engine_service(role, config, redis.url_for(role), d,
                                  store_address=st.address) for role in ("prefill", "decode")]
        plain = router_proc(config, redis.url_for("router"), d)
        keyed = router_proc(config, redis.url_for("router"), d,
                            extra=("--api-key-file", str(keys)))
        procs = [st, *engines, plain.proc, keyed.proc]
        try:
            start_all(*procs)
            for r in (plain, keyed):
                wait_until(lambda r=r: live_counts(r.http) == {"prefill": 1, "decode": 1}, 30,
                           "router sees prefill and decode")
            yield Routers(plain, keyed)
        finally:
            for p in procs:
                p.kill()


@pytest.fixture(scope="module")
def ids(tmp_path_factory: pytest.TempPathFactory, tls_dir: str) -> dict[str, SecurityConfig]:
    """Client identities of the session deployment: two tenants, an operator,
    and service roles that have no business calling the Router API."""
    ca = CertAuthority.load(Path(tls_dir) / "ca")
    out: dict[str, SecurityConfig] = {}
    for name, req in {"alice": CertRequest("tenant", tenant="alice"),
                      "bob": CertRequest("tenant", tenant="bob"),
                      "bob-engine": CertRequest("engine", tenant="bob"),
                      "operator": CertRequest("operator"),
                      **{r: CertRequest(r) for r in ("kvstore", "prefill", "decode",
                                                     "router", "engine")}}.items():
        d = tmp_path_factory.mktemp(f"id-{name}")
        ca.issue(req).save(d)
        out[name] = SecurityConfig(str(d))
    return out


def generate(sec: SecurityConfig, address: str, prompt: str, *, tenant: str = "",
             metadata: tuple[tuple[str, str], ...] = (),
             key: str = "") -> tuple[grpc.StatusCode, int]:
    """(status, cached tokens) of one Generate call."""
    meta = [*metadata, *((("authorization", f"Bearer {key}"),) if key else ())]
    req = router_pb2.GenerateRequest(
        ctx=common_pb2.RequestContext(tenant=tenant, traffic_class="chat"), prompt=prompt,
        sampling=common_pb2.SamplingParams(max_tokens=2, ignore_eos=True))
    with sec.sync_channel(address, "router") as ch:
        try:
            events = list(router_pb2_grpc.RouterStub(ch).Generate(req, timeout=60,
                                                                  metadata=meta))
        except grpc.RpcError as exc:
            return exc.code(), -1
    return grpc.StatusCode.OK, events[-1].usage.cached_tokens


def secret_prompt() -> str:
    # Unique from the first token on: tiny-dense tokenizes bytes, so a shared
    # opening would make one shared block (a tenant's own earlier prompt).
    return f"{uuid.uuid4().hex} alice's private notes " * 4


def test_a_tenant_certificate_naming_another_tenant_gets_nothing(
        routers: Routers, ids: dict[str, SecurityConfig]) -> None:
    at = routers.open.grpc
    prompt = secret_prompt()
    assert generate(ids["alice"], at, prompt)[0] == grpc.StatusCode.OK
    code, cached = generate(ids["alice"], at, prompt)
    assert code == grpc.StatusCode.OK and cached > 0          # alice's own repeat hits
    # Bob names alice: refused, however he says it.
    assert generate(ids["bob"], at, prompt, tenant="alice")[0] == \
        grpc.StatusCode.PERMISSION_DENIED
    assert generate(ids["bob"], at, prompt,
                    metadata=(("x-kvserve-tenant", "alice"),))[0] == \
        grpc.StatusCode.PERMISSION_DENIED
    assert generate(ids["bob-engine"], at, prompt, tenant="alice")[0] == \
        grpc.StatusCode.PERMISSION_DENIED
    # Without a claim he is bob: the same prompt is a miss (no oracle on alice's prompts).
    assert generate(ids["bob"], at, prompt) == (grpc.StatusCode.OK, 0)
    assert generate(ids["bob"], at, prompt, tenant="bob")[0] == grpc.StatusCode.OK
    # An operator is trusted to name a tenant.
    code, cached = generate(ids["operator"], at, prompt, tenant="alice")
    assert code == grpc.StatusCode.OK and cached > 0


@pytest.mark.parametrize("role", ["kvstore", "prefill", "decode", "router", "engine"])
def test_service_identities_may_not_call_the_router_api(
        routers: Routers, ids: dict[str, SecurityConfig], role: str) -> None:
    assert generate(ids[role], routers.open.grpc, "hello " * 8, tenant="alice")[0] == \
        grpc.StatusCode.PERMISSION_DENIED


def test_with_api_keys_the_key_decides_and_claims_must_agree(
        routers: Routers, ids: dict[str, SecurityConfig]) -> None:
    at = routers.keyed.grpc
    prompt = secret_prompt()
    assert generate(ids["operator"], at, prompt)[0] == grpc.StatusCode.UNAUTHENTICATED
    assert generate(ids["operator"], at, prompt, key=KEYS["alice"])[0] == grpc.StatusCode.OK
    code, cached = generate(ids["alice"], at, prompt, key=KEYS["alice"])
    assert code == grpc.StatusCode.OK and cached > 0
    for sec, key, tenant in ((ids["bob"], KEYS["alice"], ""),          # stolen key
                             (ids["operator"], KEYS["bob"], "alice"),   # key vs claim
                             (ids["alice"], KEYS["bob"], "")):
        assert generate(sec, at, prompt, key=key, tenant=tenant)[0] == \
            grpc.StatusCode.PERMISSION_DENIED
    assert generate(ids["operator"], at, prompt, key=KEYS["bob"],
                    metadata=(("x-kvserve-tenant", "alice"),))[0] == \
        grpc.StatusCode.PERMISSION_DENIED
    assert generate(ids["bob"], at, prompt, key=KEYS["bob"]) == (grpc.StatusCode.OK, 0)


def test_no_api_keys_beyond_loopback_is_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    keyed = ApiKeys({KEYS["alice"]: "alice"})
    with caplog.at_level(logging.WARNING, logger="router.serve"):
        assert not warn_if_open("127.0.0.1", ApiKeys())
        assert not warn_if_open("::1", ApiKeys())
        assert not warn_if_open("0.0.0.0", keyed)
        assert caplog.records == []
        assert warn_if_open("0.0.0.0", ApiKeys()) and warn_if_open("10.1.2.3", ApiKeys())
    assert "no API keys" in caplog.records[0].getMessage()
