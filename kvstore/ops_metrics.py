"""The store's answers to operators' questions in /metrics, beside
``kvstore.metrics`` (the per-tier traffic counters):

- ``kvstore_lookup_blocks_total{traffic_class, result}``: blocks looked up that
  matched a stored prefix or missed, so the hit rate per class is one ratio;
- ``kvstore_owner_put_bytes_total{tenant_ns, traffic_class}``: bytes stored
  per tenant namespace id (a small number, never the tenant's name) and class;
- ``kvstore_evictions_total{tier, reason}``: blocks leaving a tier because it
  was full (``capacity``), their TTL ran out (``ttl``) or they failed their
  checksum on read (``corrupt``: deleted, never served);
- ``kvstore_redis_up``: 1 while the store's last Redis heartbeat succeeded;
- ``kvstore_whatif_hit_rate{traffic_class, ttl_s, capacity_tokens}`` and
  ``..._hit_rate_bound``: the live what-if (kvstore.whatif) for the TTLs and
  capacities of the ``[whatif]`` config section, computed at scrape time from
  the estimator's histograms (no replay; a few ms per scrape).
Everything read at scrape time comes from the store's own counters, so the
exposition cannot drift from them.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from kvstore.types import TierSnapshot

log = logging.getLogger(__name__)


class WhatIfSource(Protocol):
    """What the collector needs from the store (kvstore.warehouse.Warehouse)."""

    def tier_snapshots(self) -> list[TierSnapshot]: ...
    def whatif_rows(self, ttls: Sequence[float], capacities: Sequence[float]) -> list[Any]: ...


def _label(v: float) -> str:
    return "inf" if math.isinf(v) else f"{v:g}"


class _Collector(Collector):
    def __init__(self, store: WhatIfSource, swept: Callable[[], dict[str, float]],
                 ttls: Sequence[float], capacities: Sequence[float]) -> None:
        self._store = store
        self._swept = swept
        self._ttls = tuple(ttls)
        self._caps = tuple(capacities)

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        ev = CounterMetricFamily("kvstore_evictions", "Blocks leaving a tier, by reason "
                                 "(capacity, ttl, corrupt)", labels=["tier", "reason"])
        swept = self._swept()
        for t in self._store.tier_snapshots():
            ev.add_metric([t.tier, "capacity"], t.evictions)
            ev.add_metric([t.tier, "ttl"], swept.get(t.tier, 0.0))
            ev.add_metric([t.tier, "corrupt"], t.checksum_failures)
        yield ev
        yield from self._whatif()

    def _whatif(self) -> Iterable[GaugeMetricFamily]:
        labels = ["traffic_class", "ttl_s", "capacity_tokens"]
        rate = GaugeMetricFamily("kvstore_whatif_hit_rate", "Predicted block hit rate of an LRU "
                                 "store at this TTL and capacity, from the traffic seen",
                                 labels=labels)
        tok = GaugeMetricFamily("kvstore_whatif_token_hit_rate", "Predicted prompt-token hit "
                                "rate at this TTL and capacity", labels=labels)
        bound = GaugeMetricFamily("kvstore_whatif_hit_rate_bound", "Error bound (+-) of "
                                  "kvstore_whatif_hit_rate for the traffic seen", labels=labels)
        try:
            rows = self._store.whatif_rows(self._ttls, self._caps)
        except Exception:  # a scrape must answer even if the estimator fails
            log.exception("what-if prediction failed")
            rows = []
        for r in rows:
            key = [r.cls, _label(r.ttl_s), _label(r.capacity_tokens)]
            rate.add_metric(key, r.hit_rate)
            tok.add_metric(key, r.token_hit_rate)
            bound.add_metric(key, r.hit_rate_bound)
        yield from (rate, tok, bound)


class OpsMetrics:
    """Counters the warehouse feeds, and the scrape-time collector."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self.lookup_blocks = Counter(
            "kvstore_lookup_blocks", "Blocks looked up, by class and result (matched: part of "
            "the stored prefix; missed: not)", ["traffic_class", "result"], registry=registry)
        self.owner_bytes = Counter(
            "kvstore_owner_put_bytes", "Bytes stored, by tenant namespace id and class",
            ["tenant_ns", "traffic_class"], registry=registry)
        self.redis_up = Gauge("kvstore_redis_up", "1 while the store's last Redis heartbeat "
                              "succeeded, else 0", registry=registry)
        self.redis_up.set(1)

    def lookup(self, traffic_class: str, blocks: int, matched: int) -> None:
        self.lookup_blocks.labels(traffic_class, "matched").inc(matched)
        self.lookup_blocks.labels(traffic_class, "missed").inc(blocks - matched)

    def stored(self, tenant_ns: int, traffic_class: str, nbytes: int) -> None:
        if nbytes:
            self.owner_bytes.labels(str(tenant_ns), traffic_class).inc(nbytes)

    def watch(self, store: WhatIfSource, swept: Counter, ttls: Sequence[float],
              capacities: Sequence[float]) -> None:
        """Start answering the scrape-time series for ``store``."""
        def swept_by_tier() -> dict[str, float]:
            out: dict[str, float] = {}
            for fam in swept.collect():
                for s in fam.samples:
                    if s.name.endswith("_total"):
                        out[s.labels["tier"]] = s.value
            return out

        self.registry.register(_Collector(store, swept_by_tier, ttls, capacities))
