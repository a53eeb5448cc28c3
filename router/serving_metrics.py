"""Per-request latency histograms under vLLM's metric names, so dashboards
and alerts written for vLLM (and llm-d, which reads them) work on kvserve's
router unchanged. TTFT and end-to-end latency are the HTTP front's, as a
client sees them, for every backend (``router.metrics_vllm``); these are the
parts only kvserve's own services can report:

- ``vllm:time_per_output_token_seconds``: per request, the time after the
  first token over the tokens after the first;
- ``vllm:request_queue_time_seconds``: what the prefill instance reported as
  its engine queue wait (``KVHandle.timings.queue_s``);
- ``vllm:request_prefill_time_seconds``: its prefill compute.
All carry vLLM's ``model_name`` label. Bucket edges are vLLM's.

Registered on the router's own registry (``RouterMetrics.registry``), once
per registry.
"""

from __future__ import annotations

import time
import weakref
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Histogram

_TPOT = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
         10.0, 20.0, 40.0, 80.0)
_REQUEST = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
            120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)

_BY_REGISTRY: weakref.WeakKeyDictionary[CollectorRegistry, ServingMetrics] = \
    weakref.WeakKeyDictionary()


@dataclass(slots=True)
class ServingMetrics:
    registry: CollectorRegistry
    model_name: str
    tpot: Histogram = field(init=False)
    queue: Histogram = field(init=False)
    prefill: Histogram = field(init=False)

    def __post_init__(self) -> None:
        r, lbl = self.registry, ["model_name"]
        self.tpot = Histogram("vllm:time_per_output_token_seconds", "Time per output token "
                              "after the first", lbl, buckets=_TPOT, registry=r)
        self.queue = Histogram("vllm:request_queue_time_seconds", "Time waiting in the "
                               "prefill engine's queue", lbl, buckets=_REQUEST, registry=r)
        self.prefill = Histogram("vllm:request_prefill_time_seconds", "Prefill compute time",
                                 lbl, buckets=_REQUEST, registry=r)

    @classmethod
    def on(cls, registry: CollectorRegistry, model_name: str) -> ServingMetrics:
        found = _BY_REGISTRY.get(registry)
        if found is None:
            found = _BY_REGISTRY[registry] = cls(registry, model_name)
        return found

    def clock(self) -> RequestClock:
        return RequestClock(self)


@dataclass(slots=True)
class RequestClock:
    """One request's timeline; the core calls ``first`` and ``done``."""

    metrics: ServingMetrics
    t_first: float = 0.0

    def first(self, queue_s: float, prefill_s: float) -> None:
        self.t_first = time.perf_counter()
        m, name = self.metrics, self.metrics.model_name
        m.queue.labels(name).observe(queue_s)
        m.prefill.labels(name).observe(prefill_s)

    def done(self, completion_tokens: int) -> None:
        t = time.perf_counter()
        m, name = self.metrics, self.metrics.model_name
        if completion_tokens > 1 and self.t_first:
            m.tpot.labels(name).observe((t - self.t_first) / (completion_tokens - 1))
