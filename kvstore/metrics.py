"""Prometheus metrics of one kvstore: hits/misses per tier and class, bytes
per tier, evictions, checksum failures, lookup latency and hit-rule tokens.

Tier gauges (used/capacity bytes, blocks, evictions, checksum failures) and
per-tenant ones (bytes, blocks, quota, evictions per tier; the tenant label is
bounded by ``[quotas].max_tenants``) are read from the tiers at scrape time
through collectors, so the tiers keep one set of counters and the exposition
can never drift from them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from kvstore.types import TenantSnapshot, TierSnapshot

# Loopback chain lookups sit around 0.1-2 ms; the tail buckets catch a slow Redis.
_LOOKUP_BUCKETS = (0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)


class _TierCollector(Collector):
    def __init__(self, snapshot: Callable[[], list[TierSnapshot]]) -> None:
        self._snapshot = snapshot

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        used = GaugeMetricFamily("kvstore_tier_used_bytes", "Bytes held per tier", labels=["tier"])
        cap = GaugeMetricFamily("kvstore_tier_capacity_bytes", "Capacity per tier",
                                labels=["tier"])
        blocks = GaugeMetricFamily("kvstore_tier_blocks", "Blocks held per tier", labels=["tier"])
        ev = CounterMetricFamily("kvstore_tier_evictions", "Blocks evicted per tier",
                                 labels=["tier"])
        bad = CounterMetricFamily("kvstore_checksum_failures",
                                  "Blocks that failed their checksum on read (deleted, not served)",
                                  labels=["tier"])
        for t in self._snapshot():
            used.add_metric([t.tier], t.used_bytes)
            cap.add_metric([t.tier], t.capacity_bytes)
            blocks.add_metric([t.tier], t.blocks)
            ev.add_metric([t.tier], t.evictions)
            bad.add_metric([t.tier], t.checksum_failures)
        yield from (used, cap, blocks, ev, bad)


class _TenantCollector(Collector):
    def __init__(self, snapshot: Callable[[], list[TenantSnapshot]]) -> None:
        self._snapshot = snapshot

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        labels = ["tier", "tenant"]
        used = GaugeMetricFamily("kvstore_tenant_used_bytes", "Bytes a tenant holds per tier",
                                 labels=labels)
        blocks = GaugeMetricFamily("kvstore_tenant_blocks", "Blocks a tenant holds per tier",
                                   labels=labels)
        quota = GaugeMetricFamily("kvstore_tenant_quota_bytes",
                                  "A tenant's quota per tier (absent: no limit)", labels=labels)
        ev = CounterMetricFamily("kvstore_tenant_evictions",
                                 "A tenant's blocks evicted per tier (its quota or a full tier)",
                                 labels=labels)
        for t in self._snapshot():
            used.add_metric([t.tier, t.tenant], t.used_bytes)
            blocks.add_metric([t.tier, t.tenant], t.blocks)
            if t.quota_bytes >= 0:
                quota.add_metric([t.tier, t.tenant], t.quota_bytes)
            ev.add_metric([t.tier, t.tenant], t.evictions)
        yield from (used, blocks, quota, ev)


@dataclass(slots=True)
class MetricsServer:
    port: int
    _httpd: object

    def close(self) -> None:
        self._httpd.shutdown()  # type: ignore[attr-defined]
        self._httpd.server_close()  # type: ignore[attr-defined]


class StoreMetrics:
    """One registry per store (tests run several stores in one process)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.hits = Counter("kvstore_hits", "Blocks served, by tier and traffic class",
                            ["tier", "traffic_class"], registry=r)
        self.misses = Counter("kvstore_misses",
                              "Blocks asked for and not found in a tier, by tier and class",
                              ["tier", "traffic_class"], registry=r)
        self.bytes_in = Counter("kvstore_put_bytes", "Payload bytes written, by tier", ["tier"],
                                registry=r)
        self.bytes_out = Counter("kvstore_get_bytes", "Payload bytes served, by tier", ["tier"],
                                 registry=r)
        self.promotions = Counter("kvstore_promotions", "Blocks copied up into G2, by source tier",
                                  ["tier"], registry=r)
        self.demotions = Counter("kvstore_demotions", "Blocks evicted from G2 into G3",
                                 registry=r)
        self.swept = Counter("kvstore_swept_blocks",
                             "Blocks deleted from a tier because their index entry expired",
                             ["tier"], registry=r)
        self.lookup_latency = Histogram("kvstore_lookup_seconds", "Chain lookup latency",
                                        buckets=_LOOKUP_BUCKETS, registry=r)
        self.lookup_tokens = Counter(
            "kvstore_lookup_tokens",
            "Tokens seen by lookups: prompt, matched (stored prefix), usable (after the hit rule)",
            ["kind"], registry=r)
        self.whatif_dropped = Counter(
            "kvstore_whatif_dropped_lookups",
            "Lookups the what-if estimator skipped to stay within its CPU share", registry=r)
        self.errors = Counter("kvstore_rpc_errors", "RPCs that ended in an error",
                              ["method", "code"], registry=r)

    def watch_tiers(self, snapshot: Callable[[], list[TierSnapshot]],
                    tenants: Callable[[], list[TenantSnapshot]] | None = None) -> None:
        self.registry.register(_TierCollector(snapshot))
        if tenants is not None:
            self.registry.register(_TenantCollector(tenants))

    def serve(self, port: int, host: str = "127.0.0.1") -> MetricsServer:
        httpd, _thread = start_http_server(port, addr=host, registry=self.registry)
        return MetricsServer(httpd.server_port, httpd)
