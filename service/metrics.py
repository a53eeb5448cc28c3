"""Prometheus exposition of a service's plain counters.

Components keep their counters in small dataclasses (``WriterStats``,
``BufferStats``, the services' own), readable in-process; this module wraps
them once for /metrics: a numeric field becomes one sample (``*_total``
fields as counters, the rest as gauges) and a ``dict[str, number]`` field one
sample per key under the label ``kind``. Each service has a private registry.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

log = logging.getLogger(__name__)

Source = Callable[[], Any]          # returns a dataclass instance of numbers / dicts of numbers


class StatsCollector:
    def __init__(self, prefix: str, sources: dict[str, Source]) -> None:
        self._prefix = prefix
        self._sources = sources

    def collect(self) -> Iterator[Metric]:
        for group, source in self._sources.items():
            snap = source()
            for f in dataclasses.fields(snap):
                value = getattr(snap, f.name)
                base = f"{self._prefix}_{group}_{f.name}"
                counter = f.name.endswith("_total")
                name = base.removesuffix("_total") if counter else base
                family_cls = CounterMetricFamily if counter else GaugeMetricFamily
                if isinstance(value, dict):
                    fam = family_cls(name, f"{group} {f.name}", labels=["kind"])
                    for k, v in sorted(value.items()):
                        fam.add_metric([str(k)], float(v))
                    yield fam
                elif isinstance(value, int | float):
                    fam = family_cls(name, f"{group} {f.name}", labels=[])
                    fam.add_metric([], float(value))
                    yield fam


def serve_metrics(prefix: str, sources: dict[str, Source], *, host: str, port: int) -> int:
    """Start a /metrics HTTP server on a daemon thread; returns its port."""
    registry = CollectorRegistry()
    registry.register(StatsCollector(prefix, sources))  # type: ignore[arg-type]
    server, _ = start_http_server(port, addr=host, registry=registry)
    bound = int(server.server_port)
    log.info("metrics on http://%s:%d/metrics", host, bound)
    return bound
