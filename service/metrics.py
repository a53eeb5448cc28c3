"""Prometheus exposition of a service's plain counters.

Components keep their counters in small dataclasses (``WriterStats``,
``BufferStats``, the services' own), readable in-process; this module wraps
them once for /metrics: a numeric field becomes one sample (``*_total``
fields as counters, the rest as gauges) and a ``dict[str, number]`` field one
sample per key under the label ``kind``; a ``Hist`` field (or a dict of them)
becomes a histogram. Each service has a private registry.
"""

from __future__ import annotations

import bisect
import dataclasses
import logging
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

log = logging.getLogger(__name__)

Source = Callable[[], Any]          # returns a dataclass instance of numbers / dicts of numbers

# Seconds: a queue wait or a hand-off on one host is ms; seconds mean trouble.
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                   10.0, 30.0, 60.0)


class Hist:
    """A histogram kept by a component in its stats dataclass. No lock: one
    writer (the event loop or the engine thread), and a scrape that reads a
    count one observation late is harmless."""

    __slots__ = ("buckets", "counts", "total")

    def __init__(self, buckets: tuple[float, ...] = LATENCY_BUCKETS) -> None:
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)      # the last one is +Inf
        self.total = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.total += value

    def cumulative(self) -> list[tuple[str, float]]:
        out, acc = [], 0
        for le, n in zip((*map(str, self.buckets), "+Inf"), self.counts, strict=True):
            acc += n
            out.append((le, float(acc)))
        return out


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
                if isinstance(value, Hist) or (
                        isinstance(value, dict) and value
                        and all(isinstance(v, Hist) for v in value.values())):
                    yield _histogram(base, f"{group} {f.name}", value)
                elif isinstance(value, dict):
                    fam = family_cls(name, f"{group} {f.name}", labels=["kind"])
                    for k, v in sorted(value.items()):
                        fam.add_metric([str(k)], float(v))
                    yield fam
                elif isinstance(value, int | float):
                    fam = family_cls(name, f"{group} {f.name}", labels=[])
                    fam.add_metric([], float(value))
                    yield fam


def _histogram(name: str, doc: str, value: Hist | dict[str, Hist]) -> HistogramMetricFamily:
    if isinstance(value, Hist):
        return HistogramMetricFamily(name, doc, buckets=value.cumulative(), sum_value=value.total)
    fam = HistogramMetricFamily(name, doc, labels=["kind"])
    for k, h in sorted(value.items()):
        fam.add_metric([str(k)], h.cumulative(), h.total)
    return fam


def serve_metrics(prefix: str, sources: dict[str, Source], *, host: str, port: int) -> int:
    """Start a /metrics HTTP server on a daemon thread; returns its port."""
    registry = CollectorRegistry()
    registry.register(StatsCollector(prefix, sources))  # type: ignore[arg-type]
    server, _ = start_http_server(port, addr=host, registry=registry)
    bound = int(server.server_port)
    log.info("metrics on http://%s:%d/metrics", host, bound)
    return bound
