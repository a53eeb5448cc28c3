"""``kvserve status``: the instance registry and the warehouse of a running
deployment (the one ``kvserve up`` started, or any Redis given).

Instances: role, address, load, queue, tokens in flight, expert imbalance,
seconds since the last heartbeat. Warehouse (each kvstore's Stats): bytes,
blocks and hit rate per tier, and TTL, hits and hit rate per traffic class.
Cached tokens (a stack ``kvserve up`` started, from its /metrics): the
prefill engines' own G1 hits plus what they restored from the warehouse,
which add up to the ``cached_tokens`` the API reported.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from dataclasses import asdict, dataclass, field, replace

from kvserve.cli import UsageError
from security.config import SecurityConfig
from security.flags import add_redis_flags, redis_url_from
from security.redact import redact, redact_url
from security.secret_files import SecretFileError


@dataclass(frozen=True, slots=True)
class Snapshot:
    redis_url: str
    instances: list[dict[str, object]]
    stores: dict[str, dict[str, object]]      # address -> StoreStats as a dict, or {"error": ...}
    cached: dict[str, float] = field(default_factory=dict)   # CACHED_METRICS name -> tokens


# What ``status`` reads from /metrics: (role, sample name, label kind or "").
CACHED_METRICS: dict[str, tuple[str, str, str]] = {
    "engine_g1_tokens": ("prefill", "kvserve_prefill_prefill_g1_tokens_total", ""),
    "warehouse_tokens": ("prefill", "kvserve_prefill_prefill_warehouse_tokens_total", ""),
    "prefill_cached_tokens": ("prefill", "kvserve_prefill_prefill_cached_tokens_total", ""),
    # Short tails computed on decode alone reuse decode's own G1 (docs/services.md).
    "decode_g1_tokens": ("decode", "kvserve_decode_decode_local_cached_tokens_total", ""),
    "api_cached_tokens": ("router", "kvserve_router_tokens_total", "cached"),
}


def configure(p: argparse.ArgumentParser) -> None:
    add_redis_flags(p, default="the running `kvserve up`, else REDIS_URL(_FILE)")
    p.add_argument("--store", action="append", default=[], metavar="ADDRESS",
                   help="also query this kvstore (repeatable)")
    p.add_argument("--json", action="store_true")
    p.add_argument("--timeout", type=float, default=5.0)


def run(args: argparse.Namespace) -> int:
    from kvserve.launcher import UpState

    state = UpState.load()
    try:
        explicit = redis_url_from(args, env=False)
        url = explicit or (state.registry_url() if state else "") or redis_url_from(None)
    except SecretFileError as exc:
        raise UsageError(str(exc)) from exc
    if not url:
        raise UsageError("no registry: start `kvserve up` or pass --redis-url(-file) / set "
                         "REDIS_URL(_FILE)")
    snap = asyncio.run(collect(url, args.store, args.timeout,
                               state.security() if state is not None else None))
    if state is not None and not explicit:
        snap = replace(snap, cached=cached_tokens(state.metrics, args.timeout))
    if args.json:
        print(json.dumps(asdict(snap), indent=1, sort_keys=True))
    else:
        print(render(snap))
    return 0


async def collect(redis_url: str, extra_stores: list[str], timeout_s: float,
                  security: SecurityConfig | None = None) -> Snapshot:
    from kvstore.client import KVStoreClient
    from kvstore.errors import KVStoreError
    from kvstore.registry import InstanceRegistry

    try:
        async with InstanceRegistry(redis_url) as reg:
            live = await reg.list_instances()
    except Exception as exc:  # redis errors of every kind: say where and why
        raise UsageError(f"registry at {redact_url(redis_url)}: {exc}") from exc
    addresses = [i.address for i in live if i.role == "kvstore"] + list(extra_stores)
    stores: dict[str, dict[str, object]] = {}
    for address in dict.fromkeys(addresses):
        try:
            async with KVStoreClient(address, timeout_s=timeout_s, use_shm=False,
                                     security=security) as c:
                stores[address] = asdict(await c.stats())
        except (KVStoreError, ValueError) as exc:   # ValueError: no credentials
            stores[address] = {"error": redact(exc)}
    return Snapshot(redact_url(redis_url), [asdict(i) for i in sorted(live, key=lambda i: (i.role,
                                                                              i.instance_id))],
                    stores)


def cached_tokens(metrics_urls: dict[str, str], timeout_s: float) -> dict[str, float]:
    """Sum CACHED_METRICS over the roles' /metrics; a role that does not answer is left out."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for role, url in metrics_urls.items():
        # Several instances of a role are "prefill-0", "prefill-1", ...: summed.
        base = role.split("-", 1)[0]
        wanted = {n: (s, k) for n, (r, s, k) in CACHED_METRICS.items() if r == base}
        if not wanted:
            continue
        try:
            with urllib.request.urlopen(url, timeout=timeout_s) as resp:
                text = resp.read().decode()
        except OSError:
            continue
        for fam in text_string_to_metric_families(text):
            for sample in fam.samples:
                for name, (sample_name, kind) in wanted.items():
                    if sample.name == sample_name and sample.labels.get("kind", "") == kind:
                        out[name] = out.get(name, 0.0) + sample.value
    return out


def _rate(hits: object, misses: object) -> str:
    h, m = int(hits), int(misses)  # type: ignore[call-overload]
    return f"{100 * h / (h + m):.1f}%" if h + m else "-"


def _tenant_rows(s: dict[str, object]) -> list[str]:
    """Per-tier tenant usage and quotas (kvstore quotas, docs/operators.md)."""
    rows = s.get("tenants") or []
    out = [f"  tenants: {s.get('tenant_names', 0)} of {s.get('max_tenants', 0)} names"]
    if rows:
        out.append(f"  {'tier':<5} {'tenant':<20} {'used bytes':>14} {'quota':>14} "
                   f"{'blocks':>8} {'evicted':>8}")
    for t in rows:  # type: ignore[attr-defined]
        quota = "none" if int(t["quota_bytes"]) < 0 else f"{int(t['quota_bytes']):,}"
        out.append(f"  {t['tier']:<5} {str(t['tenant'])[:20]:<20} {t['used_bytes']:>14,} "
                   f"{quota:>14} {t['blocks']:>8} {t['evictions']:>8}")
    return out


def render(snap: Snapshot) -> str:
    now = time.time()
    out = [f"registry {snap.redis_url}: {len(snap.instances)} instance(s)",
           f"{'role':<8} {'instance':<34} {'address':<22} {'load':>5} {'queue':>5} "
           f"{'in-flight':>9} {'imbalance':>9} {'beat':>6}"]
    for i in snap.instances:
        age = now - float(i["last_heartbeat"])  # type: ignore[arg-type]
        out.append(f"{i['role']:<8} {str(i['instance_id'])[:34]:<34} {i['address']:<22} "
                   f"{float(i['load']):>5.2f} {i['queue']:>5} {i['tokens_in_flight']:>9} "  # type: ignore[arg-type]
                   f"{float(i['expert_imbalance']):>9.3f} {age:>5.1f}s")  # type: ignore[arg-type]
    for address, s in snap.stores.items():
        out.append("")
        if "error" in s:
            out.append(f"kvstore {address}: unreachable ({s['error']})")
            continue
        out.append(f"kvstore {address} (node {s['node']})")
        out.append(f"  {'tier':<5} {'used bytes':>14} {'capacity':>14} {'blocks':>8} "
                   f"{'hits':>8} {'misses':>8} {'hit rate':>8}")
        for t in s["tiers"]:  # type: ignore[attr-defined]
            out.append(f"  {t['tier']:<5} {t['used_bytes']:>14,} {t['capacity_bytes']:>14,} "
                       f"{t['blocks']:>8} {t['hits']:>8} {t['misses']:>8} "
                       f"{_rate(t['hits'], t['misses']):>8}")
        out.append(f"  {'class':<8} {'ttl':>9} {'blocks':>8} {'hits':>8} {'misses':>8} "
                   f"{'hit rate':>8}")
        for c in s["classes"]:  # type: ignore[attr-defined]
            ttl = f"{int(c['ttl_s']) / 86400:.1f}d"
            out.append(f"  {c['traffic_class']:<8} {ttl:>9} {c['blocks']:>8} {c['hits']:>8} "
                       f"{c['misses']:>8} {_rate(c['hits'], c['misses']):>8}")
        out += _tenant_rows(s)
    if snap.cached:
        c = {k: int(snap.cached.get(k, 0)) for k in CACHED_METRICS}
        out += ["", f"cached tokens since start: engine G1 {c['engine_g1_tokens']:,} + warehouse "
                f"{c['warehouse_tokens']:,} = {c['prefill_cached_tokens']:,} (prefill), + "
                f"{c['decode_g1_tokens']:,} (short tails on decode); "
                f"the API reported {c['api_cached_tokens']:,} (router)"]
    return "\n".join(out)
