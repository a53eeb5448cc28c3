"""Who may call which gRPC method: one table, per role, for the whole deployment.

``AuthInterceptor`` (security.authz) consults it on every server. A method
nobody lists is for operators only, so a new RPC is locked down until a role
that needs it is added here. The roles call exactly what their code calls:

- prefill: the kvstore's data methods (restore, write-through) and Stats;
- decode: the same, plus prefill's PullKV and Release (it pulls the prompt KV);
- router: Prefill, Release (cancel) and Decode; the engines' ResetPrefixCache
  (its operator-only ``/reset_prefix_cache``, router.cluster_ops); of the
  kvstore only Warm (blocks up the tiers on a session's arrival: it moves
  blocks, returns none), so it can neither read, Put nor Delete;
- engine (an outside engine, e.g. the vLLM connector): the kvstore's data
  methods and Stats;
- kvstore: nothing (it serves; it calls no kvserve service);
- tenant: the kvstore's data methods and the Router API, for its own tenant only;
- operator: everything (maintenance, tools).

A tenant-scoped identity of any role (``urn:kvserve:tenant:`` in its
certificate) gets only the methods that carry a tenant, and acts only for its
own (``acting_tenant``).
"""

from __future__ import annotations

from collections.abc import Mapping

KVSTORE = "/kvserve.v1.KVStore/"
PREFILL = "/kvserve.v1.Prefill/"
DECODE = "/kvserve.v1.Decode/"
ROUTER = "/kvserve.v1.Router/"

HEALTH_METHODS = frozenset({"/grpc.health.v1.Health/Check", "/grpc.health.v1.Health/Watch"})
STORE_DATA = frozenset(KVSTORE + m for m in ("Lookup", "Get", "Put", "Stage"))
STORE_STATS = frozenset({KVSTORE + "Stats"})
STORE_WARM = frozenset({KVSTORE + "Warm"})
# Methods whose effect is bounded by the acting tenant (the handler asks acting_tenant).
TENANT_METHODS = STORE_DATA | STORE_WARM | {ROUTER + "Generate"}

METHODS_BY_ROLE: Mapping[str, frozenset[str]] = {
    "kvstore": frozenset(),
    "prefill": STORE_DATA | STORE_STATS,
    "decode": STORE_DATA | STORE_STATS | {PREFILL + "PullKV", PREFILL + "Release"},
    "router": frozenset({PREFILL + "Prefill", PREFILL + "Release", DECODE + "Decode",
                         PREFILL + "ResetPrefixCache", DECODE + "ResetPrefixCache"}) | STORE_WARM,
    "engine": STORE_DATA | STORE_STATS,
    "tenant": TENANT_METHODS,
}
OPERATOR = "operator"


def may_call(role: str, method: str, *, scoped: bool) -> bool:
    """Whether an identity of ``role`` (tenant-``scoped`` or not) may call ``method``."""
    if method in HEALTH_METHODS:
        return True
    if scoped:
        allowed = METHODS_BY_ROLE.get(role, frozenset()) | (
            TENANT_METHODS if role == OPERATOR else frozenset())
        return method in allowed and method in TENANT_METHODS
    if role == OPERATOR:
        return True
    return method in METHODS_BY_ROLE.get(role, frozenset())


def callers_of(method: str) -> list[str]:
    """The unscoped roles that may call ``method`` (for error messages and docs)."""
    return sorted({OPERATOR} | {r for r, ms in METHODS_BY_ROLE.items() if method in ms})


__all__ = ["HEALTH_METHODS", "METHODS_BY_ROLE", "STORE_DATA", "TENANT_METHODS", "callers_of",
           "may_call"]
